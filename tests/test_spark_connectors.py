"""The Spark connectors' pure parts, without a Spark session: option parsing, the read limit's
split over partitions, and bids as a pure function of their number."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from keyshift.runtime import nexmark
from keyshift.runtime.auth import Security
from keyshift.runtime.job import StepProfile
from keyshift.runtime.job_secret import SECRET_ENV, new_job_secret
from keyshift.spark.bids import DUE_COLUMN, BidOptions, bids, profile_json
from keyshift.spark.ingest_writer import (
    KeyshiftStreamWriter,
    KeyshiftWriteError,
    WriterOptions,
    check_due_column,
    due_backlog,
)
from keyshift.spark.log_reader import limit_ends, log_schema
from keyshift.spark.nexmark import NexmarkOptions, nexmark_rows


def test_writer_options_parse_endpoints_and_defaults() -> None:
    options = WriterOptions.parse({"endpoint": "a:1, b:2"})
    assert options == WriterOptions(("a:1", "b:2"), "fail", 300.0, Security.from_env())
    assert WriterOptions.parse({"endpoint": "a:1", "badrows": "drop", "timeout": "5"}).timeout == 5


def test_the_writer_presents_the_token_option_or_the_environments_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    token = new_job_secret()
    assert WriterOptions.parse({"endpoint": "a:1", "token": token}).security.secret == (
        token.encode()
    )
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(ValueError, match=f"option 'token': no job secret: set {SECRET_ENV}"):
        WriterOptions.parse({"endpoint": "a:1"})
    with pytest.raises(ValueError, match=r"option 'token': .* at least 32"):
        WriterOptions.parse({"endpoint": "a:1", "token": "short"})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "option 'endpoint' is required"),
        ({"endpoint": " , "}, "option 'endpoint' is required"),
        ({"endpoint": "host:0"}, "'host:0' is not host:port"),
        ({"endpoint": ":80"}, "':80' is not host:port"),
        ({"endpoint": "a:1", "badrows": "skip"}, "'badRows' must be one of"),
        ({"endpoint": "a:1", "timeout": "-1"}, "'timeout' must be positive"),
        ({"endpoint": "a:1", "duecolumn": " "}, "'dueColumn' must name a column"),
    ],
)
def test_bad_writer_options_say_what_is_wrong(options: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        WriterOptions.parse(options)


def test_the_read_limit_is_shared_fairly_by_partitions() -> None:
    start = {0: 10, 1: 0}
    ends = {0: 1000, 1: 5, 2: 400}
    assert limit_ends(start, ends, None) == ends
    limited = limit_ends(start, ends, 100)
    assert sum(limited[p] - start.get(p, 0) for p in ends) == 100
    assert limited[1] == 5  # a partition with little data takes all it has
    assert sorted([limited[0] - 10, limited[2]]) == [47, 48]  # the rest is split evenly
    assert limit_ends({0: 7}, {0: 3}, 10) == {0: 7}  # never behind the start


def test_bids_are_a_pure_function_of_their_number() -> None:
    options = BidOptions({"total": "1000", "auctions": "50", "seed": "3"})
    whole = pa.Table.from_batches([bids(options, 0, 1000)])
    halves = pa.Table.from_batches([bids(options, 0, 400), bids(options, 400, 1000)])
    assert whole.equals(halves)
    assert whole.column("seq").to_pylist() == list(range(1000))
    assert (
        0
        <= pa.compute.min(whole["auction"]).as_py()
        <= pa.compute.max(whole["auction"]).as_py()
        < 50
    )
    assert set(whole.column("price").to_pylist()) <= set(range(1, 101))


def test_bid_options_take_a_load_profile_as_json() -> None:
    profile = StepProfile(kind="step", rate=10, to=20, at=5)
    assert BidOptions({"profile": profile_json(profile)}).profile == profile


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "give option 'profile'"),
        ({"total": "many"}, "option 'total' must be a number"),
        ({"total": "5", "auctions": "0"}, "option 'auctions' must be >= 1"),
        ({"total": "5", "maxrecordsperbatch": "0"}, "option 'maxRecordsPerBatch' must be >= 1"),
        ({"profile": '{"kind": "warp"}'}, "option 'profile' is not a load profile"),
    ],
)
def test_bad_bid_options_say_what_is_wrong(options: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BidOptions(options)


def test_streamed_bids_say_when_the_profile_made_them_due() -> None:
    # 10 bids/s for 5 s, then 20/s: bid n is due once n + 1 are, at (n + 1) / 10 s up to bid
    # 49 (due at 5 s), then 5 + (n + 1 - 50) / 20 s; interpolated, to within 10 ms.
    profile = StepProfile(kind="step", rate=10, to=20, at=5)
    options = BidOptions({"profile": profile_json(profile), "total": "200"})
    started = 1_000.0
    due = bids(options, 40, 70, started).column(DUE_COLUMN).to_pylist()
    expected = [(n + 1) / 10 if n < 50 else 5 + (n + 1 - 50) / 20 for n in range(40, 70)]
    assert [d / 1e6 - started for d in due] == pytest.approx(expected, abs=0.01)
    # A batch read has no schedule: no due times, and the same bids otherwise.
    batch = bids(options, 40, 70)
    assert batch.column(DUE_COLUMN).null_count == 30
    assert batch.column("price") == bids(options, 40, 70, started).column("price")


def test_the_writer_estimates_what_is_due_and_not_pushed_from_due_times() -> None:
    # 1,000 rows due over 1 s (1,000/s), the last of them at t = 10 s; at t = 12 s, once the
    # first 600 are pushed: 400 of these rows and about 2,000 due since are not pushed, the
    # oldest being row 600, due at 9.6 s.
    due_us = [int((9.0 + (i + 1) / 1000) * 1e6) for i in range(1000)]
    rows = pa.table({"x": list(range(1000)), "due": due_us})
    waiting, oldest = due_backlog(rows, "due", 600, now=12.0)
    assert waiting == pytest.approx(2400, abs=5)
    assert oldest == pytest.approx(12.0 - 9.601, abs=1e-3)
    # All pushed: what fell due since the last row, as old as that row.
    waiting, oldest = due_backlog(rows, "due", 1000, now=12.0)
    assert waiting == pytest.approx(1998, abs=5) and oldest == 2.0
    # Timestamps do as well as microseconds; rows without a due time count as due.
    stamps = pa.table({"due": pa.array(due_us, pa.timestamp("us", "UTC"))})
    assert due_backlog(stamps, "due", 600, now=12.0) == due_backlog(rows, "due", 600, 12.0)
    unknown = pa.table({"due": pa.nulls(10, pa.int64())})
    assert due_backlog(unknown, "due", 4, now=12.0) == (6, 0.0)


def test_a_due_column_that_is_missing_or_not_a_time_says_so() -> None:
    rows = pa.table({"x": [1, 2], "note": ["a", "b"]})
    with pytest.raises(KeyshiftWriteError, match="names 'due', which the rows do not have"):
        due_backlog(rows, "due", 0, now=1.0)
    with pytest.raises(KeyshiftWriteError, match="must hold epoch microseconds or timestamps"):
        due_backlog(rows, "note", 0, now=1.0)


def test_a_due_column_the_dataframe_lacks_is_refused_when_the_query_starts() -> None:
    options = WriterOptions.parse({"endpoint": "a:1", "duecolumn": "due_us"})
    check_due_column(options, ["seq", "due_us"])
    check_due_column(WriterOptions.parse({"endpoint": "a:1"}), ["seq"])  # no option, no check
    with pytest.raises(ValueError, match=r"names 'due_us', which the DataFrame does not have"):
        check_due_column(options, ["seq", "price"])


def test_each_endpoint_hears_of_its_share_of_the_writers_backlog() -> None:
    # Two endpoints, tasks spread over them: each is told half, so the job's sum is the whole.
    due_us = [int((9.0 + (i + 1) / 1000) * 1e6) for i in range(1000)]
    rows = pa.table({"due": due_us})
    options = {"endpoint": "a:1,b:2", "duecolumn": "due"}
    one = KeyshiftStreamWriter({**options, "endpoint": "a:1"})._backlog(rows, 400, "q", 12.0)
    two = KeyshiftStreamWriter(options)._backlog(rows, 400, "q", 12.0)
    assert one is not None and two is not None
    assert one.rows == pytest.approx(2400, abs=5) and two.rows == one.rows // 2
    assert two.client == "q" and two.oldest_seconds == one.oldest_seconds
    assert KeyshiftStreamWriter({"endpoint": "a:1"})._backlog(rows, 400, "q", 12.0) is None


def test_nexmark_rows_are_the_events_of_a_jobs_nexmark_source() -> None:
    options = NexmarkOptions({"total": "500", "seed": "8", "maxdisorderms": "3"})
    model = nexmark.NexmarkModel(seed=8, max_disorder_us=3000)
    assert nexmark_rows(options, 100, 400) == nexmark.events(model, np.arange(100, 400))
    assert nexmark_rows(options, 0, 1).schema.names == [*nexmark.FIELDS, "event_time"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "give option 'profile'"),
        ({"total": "10", "eventrate": "0"}, "bad NEXMark options: event_rate: Input should be"),
        ({"total": "10", "eventrate": "fast"}, "event_rate: Input should be a valid number"),
        ({"total": "10", "hotbidderratio": "0"}, "hot_bidder_ratio: Input should be greater"),
        ({"total": "-1"}, "option 'total' must be >= 0"),
    ],
)
def test_bad_nexmark_options_say_what_is_wrong(options: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NexmarkOptions(options)


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_a_reader_takes_the_schema_of_the_sink_it_names() -> None:
    two = {"path": "unused", "job": str(EXAMPLES / "user_regions.yaml")}
    users = log_schema({**two, "sink": "users"})
    regions = log_schema({**two, "sink": "regions"})
    assert users.names[:2] == regions.names[:2] == ["partition", "offset"]
    assert users.field("key").type == pa.int64() and regions.field("value").type == pa.float64()
    with pytest.raises(ValueError, match=r"has the sinks \['users', 'regions'\]: name the one"):
        log_schema(two)
    with pytest.raises(ValueError, match="has no sink 'out'"):
        log_schema({**two, "sink": "out"})
    one = log_schema({"path": "unused", "job": str(EXAMPLES / "regions.yaml")})
    assert one.names == regions.names
