"""The Spark connectors' pure parts, without a Spark session: option parsing, the read limit's
split over partitions, and bids as a pure function of their number."""

from __future__ import annotations

import pyarrow as pa
import pytest

from keyshift.runtime.auth import Security
from keyshift.runtime.job import StepProfile
from keyshift.runtime.job_secret import SECRET_ENV, new_job_secret
from keyshift.spark.bids import BidOptions, bids, profile_json
from keyshift.spark.ingest_writer import WriterOptions
from keyshift.spark.log_reader import limit_ends


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
