"""Joins of two inputs (keyshift.runtime.joins): the window join and the interval join over the
memory and RocksDB process stores (pairs sent once, at the window's end or as the second record
arrives; a side's records dropped by their timers; late records told apart), the joins a job
file, a StreamingJob and the Python API declare, and every bad join refused before anything
starts, naming the stage. The live runs (Q8 and the early-bids interval join against DuckDB,
under live rescales and kill -9) are tests/test_nexmark_queries.py's."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import yaml

from examples.nexmark import queries
from examples.nexmark.q8_pipeline import early_bids, q8, q8_sources
from keyshift.operator.streamingjob import StreamingJob
from keyshift.runtime.job import (
    FieldType,
    IntervalJoinOperator,
    JobError,
    WindowJoinOperator,
    load_job,
    parse_job,
)
from keyshift.runtime.joins import IntervalJoin, WindowJoin, pairs, wrap
from keyshift.runtime.keyspace import key_groups
from keyshift.runtime.pipeline import Dataflow, source
from keyshift.runtime.records import GROUP, record_schema
from keyshift.runtime.rocksdb_state import RocksProcessState, open_database, prepare_directory
from keyshift.runtime.state import ProcessState
from keyshift.runtime.state_values import ValueCodec
from keyshift.runtime.timers import EVENT, KeyedTimers
from keyshift.runtime.windows import GroupFloors
from tests.test_crd import example as crd_example
from tests.test_state import G

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "nexmark"
LEFT: dict[str, FieldType] = {"id": "int", "name": "str"}
RIGHT: dict[str, FieldType] = {"seller": "int", "price": "int"}
ALL = np.ones(G, dtype=bool)


def side(which: int, rows: list[tuple[int, Any, int]]) -> pa.RecordBatch:
    """(key, other field, event time) rows of a side as its sender wraps them."""
    fields = LEFT if which == 0 else RIGHT
    key, other = list(fields)
    keys = pa.array([r[0] for r in rows], pa.int64())
    batch = pa.RecordBatch.from_pydict(
        {
            key: keys,
            other: pa.array([r[1] for r in rows], pa.string() if other == "name" else pa.int64()),
            "event_time": pa.array([r[2] for r in rows], pa.int64()),
            "ingest_time": pa.array([0] * len(rows), pa.int64()),
            "source": pa.array([0] * len(rows), pa.int32()),
            "seq": pa.array(range(len(rows)), pa.int64()),
            GROUP: pa.array(key_groups(keys, G), pa.int32()),
        },
        schema=record_schema(fields),
    )
    return wrap(batch, which, key, fields)


@pytest.fixture(params=["memory", "rocksdb"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A factory of a join's process store and timers, on the backend of the parameter."""
    made: list[Any] = []

    def make(join: WindowJoin | IntervalJoin) -> tuple[Any, KeyedTimers]:
        timers = KeyedTimers(join, join.on_timer, "key", pa.int64(), event_time=True)
        codec = ValueCodec(allow_pickle=False)
        if request.param == "memory":
            return ProcessState(timers, G, pa.int64(), codec), timers
        db = open_database(prepare_directory(tmp_path / "j-0", "j-0"), 8, 1)
        made.append(db)
        return RocksProcessState(timers, G, pa.int64(), db, codec, track_changes=False), timers

    yield make
    for db in made:
        db.close()


def sent(rows: list[dict[str, Any]]) -> list[tuple[Any, int, Any]]:
    """(key, event time, value) of each pair a join sent."""
    made = [(r["key"], r["event_time"], json.loads(r["value"])) for r in pairs(rows)]
    return sorted(made, key=json.dumps)


def window_join(size_ms: float, function: str | None = None) -> WindowJoin:
    op = {"kind": "window_join", "window": {"kind": "tumbling", "size_ms": size_ms}}
    given = {} if function is None else {"function": function}
    return WindowJoin(WindowJoinOperator.model_validate(op | given))


def test_a_window_join_sends_each_windows_pairs_once_at_its_end(make_store: Any) -> None:
    join = window_join(0.01)  # windows of 10 µs
    store, timers = make_store(join)
    out, _ = store.apply(side(0, [(1, "ann", 1), (1, "bo", 5), (2, "cy", 2)]), "key")
    out += store.apply(side(1, [(1, 100, 3), (1, 200, 12), (3, 300, 4)]), "key")[0]
    assert out == []  # nothing before the window's end
    assert timers.fire(store, EVENT, 9, ALL) == []
    first = timers.fire(store, EVENT, 10, ALL)
    ann, bo = {"id": 1, "name": "ann", "event_time": 1}, {"id": 1, "name": "bo", "event_time": 5}
    bid = {"seller": 1, "price": 100, "event_time": 3}
    assert sent(first) == [(1, 9, [ann, bid]), (1, 9, [bo, bid])]
    assert store.get(2) is None and store.get(3) is None  # one side only: forgotten unmatched
    assert timers.fire(store, EVENT, 10, ALL) == []  # fired once
    assert sent(timers.fire(store, EVENT, 20, ALL)) == []  # [10, 20) had a right side only
    assert store.get(1) is None
    assert join.late(np.array([9, 10, 19]), 10).tolist() == [True, False, False]


def test_a_window_joins_function_shapes_or_drops_each_pair(make_store: Any) -> None:
    store, timers = make_store(window_join(10_000, "tests.test_joins:priced_over_150"))
    store.apply(side(0, [(1, "ann", 1)]), "key")
    store.apply(side(1, [(1, 100, 2), (1, 200, 3)]), "key")
    assert [v for _, _, v in sent(timers.fire(store, EVENT, 10_000_000, ALL))] == [["ann", 200]]


def priced_over_150(left: dict[str, Any], right: dict[str, Any]) -> list[Any] | None:
    return [left["name"], right["price"]] if right["price"] > 150 else None


def test_an_interval_join_sends_a_pair_as_its_second_record_arrives(make_store: Any) -> None:
    op = IntervalJoinOperator.model_validate(
        {"kind": "interval_join", "lower_ms": -2, "upper_ms": 3}
    )
    join = IntervalJoin(op)
    store, timers = make_store(join)
    assert store.apply(side(0, [(1, "ann", 10_000)]), "key")[0] == []
    rights = [(1, 8, 8_000), (1, 7, 7_999), (1, 13, 13_000), (1, 14, 13_001), (2, 9, 10_000)]
    out, _ = store.apply(side(1, rights), "key")
    ann = {"id": 1, "name": "ann", "event_time": 10_000}
    assert [(k, t, v[1]["price"]) for k, t, v in sent(out)] == [(1, 10_000, 8), (1, 13_000, 13)]
    assert all(v[0] == ann for _, _, v in sent(out))
    # A left record meets the rights kept: those that can still match one (their time - lower).
    out, _ = store.apply(side(0, [(1, "bo", 11_000)]), "key")
    assert sorted(v[1]["price"] for _, _, v in sent(out)) == [13, 14]

    def kept() -> list[list[int]]:
        return [[t for t, _ in records] for records in store.get(1)[0]]

    # Each record leaves once the watermark passes the last time a partner could have (a
    # right one's time - lower, a left one's time + upper): no pair is sent by a timer.
    assert timers.fire(store, EVENT, 10_000, ALL) == []
    assert kept() == [[10_000, 11_000], [8_000, 13_000, 13_001]]
    assert timers.fire(store, EVENT, 13_001, ALL) == []
    assert kept() == [[11_000], [13_000, 13_001]]
    timers.at(20_000)  # the stage's watermark, as it fires the timers it has reached
    timers.fire(store, EVENT, 20_000, ALL)
    assert store.get(1) is None and store.get(2) is None
    assert join.late(np.array([9, 10, 11]), 10).tolist() == [True, False, False]
    # A watermark past several of a key's timers drops all it made useless at the first: the
    # key (records and timers) is gone, and its other timers do nothing.
    store.apply(side(0, [(5, "cy", 30_000)]), "key")
    store.apply(side(1, [(5, 1, 28_000), (5, 2, 27_000)]), "key")
    assert len(store.get(5)[1]) == 3
    timers.at(40_000)
    assert timers.fire(store, EVENT, 40_000, ALL) == [] and store.get(5) is None


# -- declared, and refused before anything starts -------------------------------------------


def join_job(**change: Any) -> dict[str, Any]:
    """A small window join job as a job file has it; `change` replaces the join stage's
    entries (None drops one); `event_time=None` takes the source's event time away."""
    event_time = change.pop("event_time", {})
    events: dict[str, Any] = {"name": "events", "kind": "source",
                              "config": {"kind": "nexmark", "total": 10}}  # fmt: skip
    if event_time is not None:
        events["event_time"] = event_time
    joined = {
        "name": "j",
        "kind": "keyed",
        "inputs": ["persons", "auctions"],
        "key_by": ["id", "seller"],
        "operator": {"kind": "window_join", "window": {"kind": "tumbling", "size_ms": 10}},
    }
    joined = {k: v for k, v in (joined | change).items() if v is not None}
    graph: list[dict[str, Any]] = [
            events,
            {"name": "persons", "kind": "filter", "input": "events",
             "function": "examples.nexmark.queries:is_person"},
            {"name": "auctions", "kind": "filter", "input": "events",
             "function": "examples.nexmark.queries:is_auction"},
            {"name": "names", "kind": "map", "input": "persons",
             "function": "examples.nexmark.queries:q3_by_person",
             "fields": {"person": "int", "auction": "int", "name": "str", "city": "str",
                        "state": "str"}},
            joined,
            {"name": "out", "kind": "sink", "input": "j"},
    ]  # fmt: skip
    # The filters and map the join does not read go (a stage without an output is refused).
    while True:
        read = {name for stage in graph for name in stage.get("inputs", [stage.get("input")])}
        kept = [s for s in graph if s["kind"] in ("source", "sink") or s["name"] in read]
        if kept == graph:
            return {"name": "join", "graph": graph}
        graph = kept


INTERVAL = {"kind": "interval_join", "lower_ms": 5, "upper_ms": -5}
BAD_JOINS: dict[str, tuple[dict[str, Any], str]] = {
    "a key field missing on a side": (
        {"key_by": ["id", "bogus"]},
        "stage 'j' .keyed.: key_by 'bogus' is not a field of its input 'auctions'",
    ),
    "different key types": (
        {"key_by": ["name", "seller"]},
        "stage 'j' .keyed.: its keys have different types .'persons'.name is str, "
        "'auctions'.seller is int.",
    ),
    "a key that is no key": (
        {"key_by": ["id", "kind"], "inputs": ["auctions", "persons"]},
        "'auctions'.id is int, 'persons'.kind is str",
    ),
    "no event time": ({"event_time": None}, "stage 'j': a join needs event time"),
    "lower above upper": ({"operator": INTERVAL}, r"lower_ms \(5.0\) must not exceed upper_ms"),
    "a window of no size": (
        {"operator": {"kind": "window_join", "window": {"kind": "tumbling", "size_ms": 0}}},
        "size_ms: Input should be greater than 0",
    ),
    "a sliding window": (
        {"operator": {"kind": "window_join", "window": {"kind": "sliding", "size_ms": 10}}},
        "window.kind: Input should be 'tumbling'",
    ),
    "one input": ({"inputs": None, "input": "persons", "key_by": "id"}, "a join reads two inputs"),
    "three inputs": (
        {"inputs": ["persons", "auctions", "names"], "key_by": ["id", "seller", "person"]},
        "stage 'j' .keyed.: a join reads two inputs .`inputs: .left, right.`., got 3",
    ),
    "a key per input short": (
        {"key_by": ["id"]},
        "stage 'j' .keyed.: key_by names one key field per input, got .'id'.",
    ),
    "a key list on a plain keyed stage": (
        {"operator": {"kind": "aggregate"}},
        "key_by names one field .got .'id', 'seller'..; a list, one per input, is a join's",
    ),
    "a pair function of the wrong shape": (
        {
            "operator": {
                "kind": "interval_join",
                "lower_ms": 0,
                "upper_ms": 1,
                "function": "examples.nexmark.queries:is_bid",
            }
        },
        "has the signature .record.*two arguments",
    ),
    "a late setting on a join": (
        {
            "operator": {
                "kind": "window_join",
                "window": {"kind": "tumbling", "size_ms": 10},
                "allowed_lateness_ms": 5,
            }
        },
        "allowed_lateness_ms is a window's setting: the 'window_join' operator",
    ),
}

IMPORTED = {"a pair function of the wrong shape"}


@pytest.mark.parametrize("case", sorted(BAD_JOINS))
def test_a_bad_join_is_refused_in_a_job_file_and_a_streamingjob(tmp_path: Path, case: str) -> None:
    change, reason = BAD_JOINS[case]
    job = join_job(**change)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    with pytest.raises(JobError, match=reason):
        load_job(path)
    obj = crd_example()
    obj["spec"]["job"] = job
    problems = StreamingJob.model_validate(obj).spec.problems()
    if case in IMPORTED:
        # The operator checks the form of the functions in the job's image, not their shape.
        assert problems == []
    else:
        assert any(re.search(reason, p) for p in problems), problems


def test_a_join_in_a_job_of_the_older_shape_is_refused() -> None:
    interval = {"kind": "interval_join", "lower_ms": 0, "upper_ms": 5}
    job = {
        "name": "old",
        "source": {"config": {"kind": "nexmark", "total": 10}, "event_time": {}},
        "fields": dict(parse_job(join_job()).fields),
        "keyed": {"name": "j", "key_by": "id", "operator": interval},
    }
    with pytest.raises(JobError, match=r"stage 'j' .keyed.: a join reads two inputs"):
        parse_job(job)


def test_a_join_job_reads_each_side_with_its_schema_and_key() -> None:
    spec = parse_job(join_job(inputs=["names", "auctions"], key_by=["person", "seller"]))
    step = spec.keyed_step("j")
    assert step.fields == {"key": "int", "side": "int", "record": "str"}
    assert [(s.key_by, list(s.fields)) for s in step.sides] == [
        ("person", ["person", "auction", "name", "city", "state"]),
        ("seller", list(spec.fields)),
    ]
    # Both ways start at the source: two routes into the join, one per side, on its streams.
    assert [(r.target, r.side, len(r.transforms)) for r in spec.source_routes()] == [
        ("j", 0, 2),
        ("j", 1, 1),
    ]
    assert step.inputs == ("events",)


def test_a_join_of_a_keyed_stage_and_the_source_has_a_side_on_each_senders_route() -> None:
    """Two senders (the source's instances, a keyed stage's): each routes its side."""
    job = join_job(inputs=["bids", "auctions"], key_by=["key", "seller"])
    job["graph"][1:1] = [
        {"name": "only-bids", "kind": "filter", "input": "events",
         "function": "examples.nexmark.queries:is_bid"},
        {"name": "bids", "kind": "keyed", "input": "only-bids", "key_by": "auction",
         "operator": {"kind": "aggregate", "function": "count"}},
    ]  # fmt: skip
    spec = parse_job(job)
    step = spec.keyed_step("j")
    assert step.inputs == ("events", "bids")
    keys = [(s.key_by, s.fields[s.key_by]) for s in step.sides]
    assert keys == [("key", "int"), ("seller", "int")]
    (to_join,) = spec.keyed_step("bids").outputs
    assert (to_join.target, to_join.side) == ("j", 0)
    assert {(r.target, r.side) for r in spec.source_routes()} == {("bids", None), ("j", 1)}


def test_the_examples_python_twins_build_their_job_files() -> None:
    assert q8().build() == load_job(EXAMPLES / "q8.yaml")
    assert early_bids().build() == load_job(EXAMPLES / "early_bids.yaml")
    assert q8_sources().build() == load_job(EXAMPLES / "q8_sources.yaml")


def joined(how: Callable[[Any, Any], Any], event_time: dict[str, Any] | None = None) -> Dataflow:
    events = source("events", {"kind": "nexmark", "total": 10}, event_time=event_time)
    persons = events.filter(queries.is_person, name="persons").key_by("id")
    auctions = events.filter(queries.is_auction, name="auctions").key_by("seller")
    return Dataflow("j", how(persons, auctions).sink_log(name="out"))


def test_the_python_api_builds_joins_and_refuses_bad_ones() -> None:
    window = joined(lambda a, b: a.window_join(b, 5, queries.q8, name="j"), {}).build()
    op = window.keyed_step("j").stage.operator
    assert isinstance(op, WindowJoinOperator) and op.size_us() == 5000
    assert op.function == "examples.nexmark.queries:q8"
    interval = joined(lambda a, b: a.interval_join(b, -1, 2, name="j"), {}).build()
    op = interval.keyed_step("j").stage.operator
    assert isinstance(op, IntervalJoinOperator) and op.bounds_us() == (-1000, 2000)
    with pytest.raises(JobError, match="stage 'j': a join needs event time"):
        joined(lambda a, b: a.window_join(b, 5, name="j")).build()
    with pytest.raises(JobError, match=r"lower_ms .2.0. must not exceed upper_ms"):
        joined(lambda a, b: a.interval_join(b, 2, 1, name="j"), {}).build()
    with pytest.raises(JobError, match="size_ms: Input should be greater than 0"):
        joined(lambda a, b: a.window_join(b, -5, name="j"), {}).build()
    with pytest.raises(JobError, match=r"window_join.. joins another keyed stream"):
        joined(lambda a, b: a.window_join(b.stream, 5), {})
    with pytest.raises(JobError, match="a union on a side"):
        joined(lambda a, b: a.stream.union(b.stream).key_by("id").window_join(b, 5), {})
    with pytest.raises(JobError, match="a lambda cannot be imported"):
        joined(lambda a, b: a.window_join(b, 5, lambda left, right: 1), {})
    with pytest.raises(JobError, match="key_by 'nope' is not a field of its input 'auctions'"):
        joined(lambda a, b: a.window_join(b.stream.key_by("nope"), 5, name="j"), {}).build()


def test_a_record_late_at_the_instance_its_group_came_from_is_late_for_the_join_here() -> None:
    """A move or a restore hands a group over with its old instance's watermark: what was
    complete there (a fired window, dropped partners) is complete here, below the new
    instance's own watermark too."""
    handed = GroupFloors(G)
    groups = np.array([0, 1])
    handed.hand_over(np.array([1]), 20)  # group 1's old owner was at 20
    window = window_join(0.01)  # windows of 10 µs
    interval = IntervalJoin(
        IntervalJoinOperator.model_validate({"kind": "interval_join", "lower_ms": 0, "upper_ms": 1})
    )
    times = np.array([15, 15])
    assert window.late(times, handed.threshold(12, groups)).tolist() == [False, True]
    assert interval.late(times, handed.threshold(12, groups)).tolist() == [False, True]
    assert interval.late(times, handed.threshold(None, groups)).tolist() == [False, True]
    assert window.late(times, handed.threshold(30, groups)).tolist() == [True, True]
