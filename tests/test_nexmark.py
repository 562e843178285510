"""The NEXMark generator (keyshift.runtime.nexmark), its source kind in job files, and the
reference engine's SQL over its events (tests/nexmark_reference.py)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from examples.nexmark import bids_pipeline, q3_pipeline, q5_pipeline, q7_pipeline, q11_pipeline
from keyshift.runtime import nexmark
from keyshift.runtime.job import NEXMARK_FIELDS, JobError, load_job, parse_job
from keyshift.runtime.pipeline import Dataflow, source
from keyshift.runtime.records import EVENT_TIME
from tests.nexmark_reference import QUERIES, run_query, source_events, write_events

N = 50_000
REPO = Path(__file__).resolve().parent.parent


def table(model: nexmark.NexmarkModel, numbers: np.ndarray) -> dict[str, list[Any]]:
    return nexmark.events(model, numbers).to_pydict()


def test_fifty_events_are_one_person_three_auctions_and_46_bids() -> None:
    events = table(nexmark.NexmarkModel(), np.arange(N))
    assert Counter(events["kind"]) == {
        "person": N // 50,
        "auction": 3 * N // 50,
        "bid": 46 * N // 50,
    }
    kinds = events["kind"][:50]
    assert kinds[0] == "person" and kinds[1:4] == ["auction"] * 3 and set(kinds[4:]) == {"bid"}


def test_people_and_auctions_are_numbered_in_order_from_1000() -> None:
    events = table(nexmark.NexmarkModel(), np.arange(N))
    people = [i for k, i in zip(events["kind"], events["id"], strict=True) if k == "person"]
    auctions = [i for k, i in zip(events["kind"], events["id"], strict=True) if k == "auction"]
    assert people == list(range(1000, 1000 + N // 50))
    assert auctions == list(range(1000, 1000 + 3 * N // 50))


def test_fields_of_other_kinds_are_zero_or_empty() -> None:
    batch = nexmark.events(nexmark.NexmarkModel(seed=4), np.arange(5000))
    assert batch.schema.names == [*NEXMARK_FIELDS, EVENT_TIME]
    for row in batch.to_pylist():
        person = ("name", "email", "city", "state")
        auction = ("item_name", "initial_bid", "reserve", "expires", "seller", "category")
        bid = ("auction", "bidder", "price")
        own = {"person": person, "auction": auction, "bid": bid}[row["kind"]]
        for field in (*person, *auction, *bid):
            assert bool(row[field]) == (field in own), (row, field)


def test_bids_name_auctions_and_people_that_exist_or_soon_will_and_hot_ones_dominate() -> None:
    events = table(nexmark.NexmarkModel(seed=1), np.arange(200_000))
    rows = zip(events["kind"], events["auction"], events["bidder"], strict=True)
    bids = [(n, a, b) for n, (k, a, b) in enumerate(rows) if k == "bid"]
    for n, auction, bidder in bids:
        assert 1000 <= auction <= 1000 + 3 * (n // 50) + 2 + nexmark.ID_LEAD
        assert 1000 <= bidder <= 1000 + n // 50 + nexmark.ID_LEAD
    # Beam's defaults: half the bids go to a hot auction, 3/4 are by a hot bidder.
    hot_auctions = sum((a - 1000) % 100 == 0 for _, a, _ in bids) / len(bids)
    hot_bidders = sum((b - 1000) % 100 == 1 for _, _, b in bids) / len(bids)
    assert 0.45 < hot_auctions < 0.6
    assert 0.7 < hot_bidders < 0.8
    auctions = [s for k, s in zip(events["kind"], events["seller"], strict=True) if k == "auction"]
    assert 0.7 < sum((s - 1000) % 100 == 0 for s in auctions) / len(auctions) < 0.8


def test_events_are_a_pure_function_of_seed_and_number() -> None:
    model = nexmark.NexmarkModel(seed=9, max_disorder_us=5000)
    whole = nexmark.events(model, np.arange(10_000))
    shuffled = np.random.default_rng(0).permutation(10_000)
    assert nexmark.events(model, shuffled) == whole.take(pa.array(shuffled))
    assert nexmark.events(model, np.arange(10_000)) == whole
    other = nexmark.events(nexmark.NexmarkModel(seed=10, max_disorder_us=5000), np.arange(10_000))
    assert other.column("price") != whole.column("price")


@pytest.mark.parametrize("parallelism", [2, 3])
def test_instances_share_one_stream_whatever_their_number(parallelism: int) -> None:
    one = source_events({"total": 9_999, "seed": 2}, 1)
    many = source_events({"total": 9_999, "seed": 2}, parallelism)
    order = pa.compute.sort_indices(many, [(EVENT_TIME, "ascending"), ("id", "ascending")])
    by_time = pa.compute.sort_indices(one, [(EVENT_TIME, "ascending"), ("id", "ascending")])
    assert many.take(order).equals(one.take(by_time))


def test_event_time_advances_with_the_rate_within_the_disorder_bound() -> None:
    model = nexmark.NexmarkModel(event_rate=1000.0, max_disorder_us=20_000)
    numbers = np.arange(20_000)
    times = nexmark.events(model, numbers).column(EVENT_TIME).to_numpy()
    nominal = model.start_time_us + numbers * 1000
    assert np.all(times <= nominal) and np.all(times >= nominal - 20_000)
    assert np.any(np.diff(times) < 0)  # out of order, but never by more than the bound:
    assert np.all(times >= np.maximum.accumulate(times) - 20_000)
    in_order = nexmark.events(nexmark.NexmarkModel(event_rate=1000.0), numbers)
    assert np.all(np.diff(in_order.column(EVENT_TIME).to_numpy()) == 1000)


@pytest.mark.parametrize(
    ("arguments", "reason"),
    [
        ({"seed": -1}, "seed must be >= 0"),
        ({"event_rate": 0.0}, "event_rate must be > 0"),
        ({"max_disorder_us": -5}, "max_disorder_us must be >= 0"),
        ({"hot_auction_ratio": 0}, "hot_auction_ratio must be >= 1"),
        ({"active_people": 0}, "active_people and in_flight_auctions"),
    ],
)
def test_a_bad_model_is_refused(arguments: dict[str, Any], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        nexmark.NexmarkModel(**arguments)


def test_bad_event_numbers_are_refused() -> None:
    with pytest.raises(ValueError, match="event numbers must be >= 0"):
        nexmark.events(nexmark.NexmarkModel(), np.array([3, -1]))
    with pytest.raises(ValueError, match="instance index 2 is not in"):
        nexmark.event_numbers(2, 2, 0, 10)


def nexmark_job(config: dict[str, Any], **source: Any) -> dict[str, Any]:
    return {
        "name": "nx",
        "graph": [
            {"kind": "source", "name": "events", "config": {"kind": "nexmark", **config}, **source},
            {"kind": "keyed", "name": "per-auction", "input": "events", "key_by": "auction"},
            {"kind": "sink", "name": "out", "input": "per-auction"},
        ],
    }


def test_a_nexmark_source_makes_records_of_the_nexmark_schema() -> None:
    spec = parse_job(nexmark_job({"total": 10, "max_disorder_ms": 5}))
    assert spec.fields == NEXMARK_FIELDS
    assert spec.source.config.kind == "nexmark"


@pytest.mark.parametrize(
    ("config", "source", "reason"),
    [
        ({"event_rate": 0}, {}, "event_rate: Input should be greater than 0"),
        ({"max_disorder_ms": -1}, {}, "max_disorder_ms: Input should be greater than or equal"),
        ({"hot_seller_ratio": 0}, {}, "hot_seller_ratio: Input should be greater than or equal"),
        ({"bids": 3}, {}, "bids: Extra inputs are not permitted"),
        ({}, {"fields": {"key": "int"}}, "a nexmark's records are"),
    ],
)
def test_a_bad_nexmark_source_is_refused_at_load(
    config: dict[str, Any], source: dict[str, Any], reason: str
) -> None:
    with pytest.raises(JobError, match=reason):
        parse_job(nexmark_job(config, **source))


def test_the_older_job_shape_must_declare_the_nexmark_schema() -> None:
    job = {"name": "nx", "source": {"config": {"kind": "nexmark"}}, "keyed": {"key_by": "key"}}
    with pytest.raises(JobError, match="the nexmark source makes records"):
        parse_job(job)


def test_the_reference_sql_answers_every_query(tmp_path: Path) -> None:
    events = source_events({"total": 100_000, "seed": 5, "event_rate": 5000}, 2)
    parquet = write_events(events, tmp_path / "events.parquet")
    answers = {query: run_query(query, parquet) for query in QUERIES}
    bids = events.filter(pa.compute.equal(events.column("kind"), "bid")).to_pydict()
    assert len(answers["q0"]) == len(bids["auction"]) == 92_000
    assert answers["q2"] == sorted(
        (a, p) for a, p in zip(bids["auction"], bids["price"], strict=True) if a % 123 == 0
    )
    assert {row[0] for row in answers["q4"]} == set(range(10, 15))
    assert len({row[0] for row in answers["q7"]}) == 2  # 20 s of events: two 10 s windows
    for query in QUERIES:
        assert answers[query], f"{query} found nothing in 100k events"


def test_the_python_twins_of_q0_q1_q2_q3_q5_q7_and_q11_build_their_job_files() -> None:
    examples = REPO / "examples" / "nexmark"
    for query in bids_pipeline.BID_QUERIES:
        assert bids_pipeline.bid_query(query).build() == load_job(examples / f"{query}.yaml")
    assert q3_pipeline.q3().build() == load_job(examples / "q3.yaml")
    assert q3_pipeline.q3(ttl=True).build() == load_job(examples / "q3_ttl.yaml")
    assert q5_pipeline.q5().build() == load_job(examples / "q5.yaml")
    assert q7_pipeline.q7().build() == load_job(examples / "q7.yaml")
    assert q11_pipeline.q11().build() == load_job(examples / "q11.yaml")
    for query in ("q0", "q1", "q2", "q3", "q3_ttl", "q5_counts", "q8", "early_bids"):
        load_job(examples / f"{query}.yaml")  # every example loads


def test_the_python_api_takes_event_time_settings_and_refuses_bad_ones() -> None:
    def job(event_time: dict[str, Any]) -> Dataflow:
        events = source("events", {"kind": "nexmark", "total": 10}, event_time=event_time)
        return Dataflow("nx", events.key_by("auction").count(name="k").sink_log(name="out"))

    built = job({"max_out_of_orderness_ms": 30, "idle_timeout_ms": 500}).build()
    assert built.source.event_time is not None
    assert built.source.event_time.max_out_of_orderness_ms == 30
    with pytest.raises(JobError, match="'city' is a 'str' field; an event time is an 'int'"):
        job({"field": "city"}).build()
    with pytest.raises(JobError, match="idle_timeout_ms: Input should be greater than 0"):
        job({"idle_timeout_ms": -5}).build()
