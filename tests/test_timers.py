"""Timers in process functions (keyshift.runtime.timers): the timer store on the memory and
RocksDB backends (registered, fired once, deleted, moved, checkpointed as keyed state), bad
timers counted and refused, the job file, CR and Python API declaring them; and a live job
whose event-time timers emit bids per auction per period, equal to plain Python's count over
the same events, each period fired exactly once: to the end, under live rescales with every
strategy, and through a kill -9 of a keyed instance with checkpoints on."""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from examples.nexmark import queries
from keyshift.operator.streamingjob import StreamingJob
from keyshift.runtime.job import JobError, ProcessOperator, parse_job
from keyshift.runtime.keyspace import key_groups
from keyshift.runtime.output_log import OutputLogReader
from keyshift.runtime.pipeline import Dataflow, Pipeline, source
from keyshift.runtime.rocksdb_state import RocksProcessState, open_database, prepare_directory
from keyshift.runtime.state import KEY_COL, ProcessState
from keyshift.runtime.state_values import ValueCodec
from keyshift.runtime.timers import EVENT, PROCESSING, KeyedTimers, TimerService
from keyshift.runtime.watermarks import WatermarkTracker
from tests import job_fns
from tests.conftest import STATE_BACKENDS, count_job, running_job, state_settings, wait_for
from tests.nexmark_reference import run_query, source_events, write_events
from tests.test_crd import example as crd_example
from tests.test_crd import schema_errors
from tests.test_nexmark_queries import (
    SOURCE,
    SOURCES,
    STRATEGY_PAIRS,
    example,
    rescaling_mid_stream,
    run_query_job,
)
from tests.test_recovery import recover_through
from tests.test_state import G, group_of, make_batch

Store = ProcessState | RocksProcessState


def timed(event_time: bool = True) -> KeyedTimers:
    return KeyedTimers(
        job_fns.count_until_period_end, job_fns.emit_period, "key", pa.int64(), event_time
    )


@pytest.fixture(params=["memory", "rocksdb"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A factory of process stores over given timers, on the backend of the parameter."""
    made: list[Any] = []

    def make(timers: KeyedTimers, owner: str = "k-0") -> Store:
        codec = ValueCodec(allow_pickle=False)
        if request.param == "memory":
            return ProcessState(timers, G, pa.int64(), codec)
        db = open_database(prepare_directory(tmp_path / owner, owner), 8, 1)
        made.append(db)
        return RocksProcessState(timers, G, pa.int64(), db, codec, track_changes=True)

    yield make
    for db in made:
        db.close()


P = job_fns.PERIOD_US
ALL = np.ones(G, dtype=bool)


def fired(rows: list[dict[str, Any]]) -> list[tuple[Any, list[Any]]]:
    return sorted((row[KEY_COL], row["value"]) for row in rows)


def test_event_timers_fire_once_when_due_and_leave_the_keys_value(make_store: Any) -> None:
    timers = timed()
    store = make_store(timers)
    events = [1, P + 1, 2, 2 * P + 5]
    outputs, _ = store.apply(make_batch([7, 7, 8, 7], [0.0] * 4, event_times=events), "key")
    assert outputs == []  # counting only: the outputs come from the timers
    assert store.get(7) == [{P: 1, 2 * P: 1, 3 * P: 1}, [P, 2 * P, 3 * P], []]
    assert timers.fire(store, EVENT, P - 1, ALL) == []  # not due yet
    assert fired(timers.fire(store, EVENT, 2 * P, ALL)) == [
        (7, [P, 1, "event"]), (7, [2 * P, 1, "event"]), (8, [P, 1, "event"])
    ]  # fmt: skip
    assert store.get(7) == [{3 * P: 1}, [3 * P], []]
    assert store.get(8) is None  # neither state nor timers left: the key is gone
    assert timers.fire(store, EVENT, 2 * P, ALL) == []  # fired once
    # A stale index entry (the timer fired already) does nothing.
    timers.queue.add(EVENT, P, 7, group_of(7))
    assert timers.fire(store, EVENT, 2 * P, ALL) == []
    row = timers.fire(store, EVENT, 10 * P, ALL)[0]
    assert (row["event_time"], row["source"], row["seq"]) == (3 * P, -1, 3 * P)


def test_a_deleted_timer_never_fires_and_a_registered_one_is_idempotent() -> None:
    def register_twice_delete_once(state: Any, record: dict[str, Any], timers: Any) -> Any:
        timers.register_processing_time_timer(100)
        timers.register_processing_time_timer(100)
        timers.register_processing_time_timer(200)
        timers.delete_processing_time_timer(100)
        timers.delete_event_time_timer(5)  # there is none: nothing happens
        return "s", None

    timers = KeyedTimers(register_twice_delete_once, job_fns.emit_period, "key", pa.int64(), False)
    store = ProcessState(timers, G, pa.int64())
    store.apply(make_batch([1], [0.0]), "key")
    assert store.get(1) == ["s", [], [200]]
    calls: list[tuple[Any, ...]] = []

    def on_timer(state: Any, key: Any, timestamp: int, kind: str, service: Any) -> Any:
        calls.append((state, key, timestamp, kind, service.processing_time_timers()))
        return state, "fired"

    timers.on_timer = on_timer
    assert timers.fire(store, PROCESSING, 150, ALL) == []
    assert [r["value"] for r in timers.fire(store, PROCESSING, 250, ALL)] == ["fired"]
    assert calls == [("s", 1, 200, "processing", ())]


def test_timers_move_with_their_group_and_fire_at_the_new_owner_only(make_store: Any) -> None:
    old_timers, new_timers = timed(), timed()
    old, new = make_store(old_timers, "k-0"), make_store(new_timers, "k-1")
    keys = list(range(40))
    old.apply(make_batch(keys, [0.0] * 40, event_times=[5] * 40), "key")
    moving = sorted({group_of(k) for k in keys[:20]})
    new.restore(old.snapshot_groups(moving))
    old.drop_groups(moving)
    new_timers.index(new.snapshot_groups(moving), new.codec)
    owned_old = ALL.copy()
    owned_old[moving] = False
    at_old = {r[KEY_COL] for r in old_timers.fire(old, EVENT, P, owned_old)}
    at_new = {r[KEY_COL] for r in new_timers.fire(new, EVENT, P, ~owned_old)}
    assert at_old.isdisjoint(at_new) and at_old | at_new == set(keys)
    assert {group_of(k) for k in at_new} == set(moving)


def test_a_fired_timer_is_a_change_for_the_next_incremental_checkpoint(make_store: Any) -> None:
    timers = timed()
    store = make_store(timers)
    store.apply(make_batch([3, 4, 4], [0.0] * 3, event_times=[1, 1, P + 1]), "key")
    store.clear_changes()
    timers.fire(store, EVENT, P, ALL)
    groups = [group_of(3), group_of(4)]
    changes = store.changes(groups)
    # Key 3 has nothing left: a tombstone; key 4 fired one of its two timers: an upsert.
    deleted = [k for keys in changes.deleted.values() for k in keys]
    assert len(deleted) == 1 and changes.upserts.num_rows == 1
    restored = ProcessState(timed(), G, pa.int64())
    restored.restore(changes.upserts)
    assert restored.get(4) == [{2 * P: 1}, [2 * P], []]


@pytest.mark.parametrize(
    ("timestamp", "reason"),
    [("soon", "integer epoch µs"), (1.5, "integer epoch µs"), (True, "integer epoch µs"),
     (1 << 63, "out of range")],
)  # fmt: skip
def test_a_bad_timestamp_is_refused_and_counted_not_raised(timestamp: Any, reason: str) -> None:
    service = TimerService(event_time=True)
    service.register_event_time_timer(timestamp)
    service.register_processing_time_timer(timestamp)
    assert service.event_time_timers() == service.processing_time_timers() == ()
    assert len(service.invalid) == 2 and reason in service.invalid[0]


def test_an_event_time_timer_without_event_time_is_refused_and_the_function_goes_on() -> None:
    timers = timed(event_time=False)
    store = ProcessState(timers, G, pa.int64())
    store.apply(make_batch([1, 1], [0.0, 0.0]), "key")
    assert store.get(1) == [{P: 2}, [], []]  # counted, but no timer
    refused = timers.take_invalid()
    assert len(refused) == 2 and "no event time" in refused[0]
    assert timers.take_invalid() == []


@pytest.mark.live
def test_event_time_timers_on_a_stage_without_event_time_are_counted_not_a_crash(
    tmp_path: Path,
) -> None:
    total = 2000
    job = count_job(
        source={"config": {"kind": "generator", "keys": 50, "seed": 4, "total": total}},
        keyed={
            "parallelism": 1,
            "operator": {
                "kind": "process",
                "function": "tests.job_fns:count_until_period_end",
                "on_timer": "tests.job_fns:emit_period",
            },
        },
        sink={"config": {"kind": "log", "path": str(tmp_path / "out")}},
    )
    with running_job(tmp_path, job) as local:
        wait_for(lambda: local.status()["phase"] == "finished", 60, "the job to finish")
        (keyed,) = local.status()["stages"][1]["instances"]
        assert keyed["stats"]["invalid"] == total
    log = (tmp_path / "logs" / "counts-0.log").read_text()
    assert "timer registrations refused" in log and "no event time" in log


@pytest.mark.live
def test_processing_time_timers_fire_once_by_the_wall_clock(tmp_path: Path) -> None:
    """Each key's first record sets a processing-time timer 100 ms ahead: every key's fires,
    once, while the records go on (the job is drained once all have)."""
    keys = 20
    out = tmp_path / "out"
    job = count_job(
        source={"config": {"kind": "generator", "keys": keys, "distribution": "sequential",
                           "profile": {"kind": "constant", "rate": 400}}},
        keyed={"operator": {"kind": "process", "function": "tests.job_fns:fire_once_soon",
                            "on_timer": "tests.job_fns:fired_now"}},
        sink={"config": {"kind": "log", "path": str(out)}},
    )  # fmt: skip

    def out_records(local: Any) -> int:
        keyed = local.status()["stages"][1]["instances"]
        return sum(int(i["stats"].get("records_out", 0)) for i in keyed)

    with running_job(tmp_path, job) as local:
        wait_for(lambda: out_records(local) >= keys, 60, "every key's timer to fire")
        local.drain()
        wait_for(lambda: local.status()["phase"] == "finished", 60, "the job to end")
    values = [json.loads(v) for v in OutputLogReader(out).read_all().column("value").to_pylist()]
    assert sorted(values) == [[key, "processing"] for key in range(keys)]


# -- declaring timers: job file, CR, Python API ------------------------------------------------


def process_job(**operator: Any) -> dict[str, Any]:
    return {
        "name": "t",
        "source": {"config": {"kind": "generator", "keys": 10}},
        "keyed": {"key_by": "key", "operator": {"kind": "process", **operator}},
        "sink": {"config": {"kind": "log", "path": "out"}},
        "fields": {"key": "int", "value": "float"},
    }


def test_a_process_operator_names_its_on_timer_function() -> None:
    spec = parse_job(
        process_job(
            function="tests.job_fns:count_until_period_end", on_timer="tests.job_fns:emit_period"
        )
    )
    op = spec.keyed.operator
    assert isinstance(op, ProcessOperator) and op.on_timer == "tests.job_fns:emit_period"


@pytest.mark.parametrize(
    ("operator", "reason"),
    [
        ({"function": "tests.job_fns:track", "on_timer": "tests.job_fns:emit_period"},
         "three arguments \\(state, record, timers\\)"),
        ({"function": "tests.job_fns:count_until_period_end", "on_timer": "tests.job_fns:track"},
         "five arguments \\(state, key, timestamp, kind, timers\\)"),
        ({"function": "tests.job_fns:count_until_period_end"}, "two arguments"),
        ({"function": "tests.job_fns:count_until_period_end", "on_timer": "tests.job_fns:nothing"},
         "no attribute"),
        ({"function": "tests.job_fns:count_until_period_end", "on_timer": "no-colon"},
         "module:function"),
    ],
)  # fmt: skip
def test_timer_functions_that_cannot_be_called_so_are_refused_at_load(
    operator: dict[str, Any], reason: str
) -> None:
    with pytest.raises(JobError, match=reason):
        parse_job(process_job(**operator))


def test_a_streamingjob_declares_on_timer_and_its_schema_checks_the_form() -> None:
    """The CR embeds the job: its schema takes on_timer, the operator checks its form (the
    functions live in the image, so they are not imported)."""
    obj = crd_example()
    obj["spec"]["job"] = process_job(function="app.fns:count", on_timer="app.fns:emit")
    assert schema_errors(obj) == []
    parsed = StreamingJob.model_validate(obj)
    op = parsed.spec.job_spec().keyed.operator
    assert isinstance(op, ProcessOperator) and op.on_timer == "app.fns:emit"
    obj["spec"]["job"] = process_job(function="app.fns:count", on_timer="emit")
    problems = StreamingJob.model_validate(obj).spec.problems()
    assert len(problems) == 1 and "module:function" in problems[0]
    obj["spec"]["job"]["keyed"]["operator"]["on_timer"] = 7
    assert any("on_timer" in e for e in schema_errors(obj))


def test_the_python_apis_declare_on_timer() -> None:
    pipeline = (
        Pipeline("t")
        .generator(keys=10)
        .key_by("key")
        .process(job_fns.count_until_period_end, on_timer=job_fns.emit_period)
        .sink_log("out")
    )
    op = pipeline.build().keyed.operator
    assert isinstance(op, ProcessOperator) and op.on_timer == "tests.job_fns:emit_period"
    flow = source("events", {"kind": "generator", "keys": 10})
    keyed = flow.key_by("key").process(
        job_fns.count_until_period_end, on_timer=job_fns.emit_period, name="k"
    )
    spec = Dataflow("t", keyed.sink_log(name="out")).build()
    (step,) = spec.keyed_stages()
    assert isinstance(step.stage.operator, ProcessOperator)
    assert step.stage.operator.on_timer == "tests.job_fns:emit_period"
    with pytest.raises(JobError, match="lambda"):
        flow.key_by("key").process(job_fns.count_until_period_end, on_timer=lambda *a: a)


# -- Q3 as a join with a state TTL (examples/nexmark/q3_ttl.yaml) -----------------------------


def test_q3s_join_with_a_state_ttl_forgets_both_sides_and_answers_what_duckdb_answers(
    tmp_path: Path,
) -> None:
    """The join's functions over SOURCE's events in arrival order (out of order by up to
    50 ms), a batch at a time, with event-time timers fired at a watermark 50 ms behind, in
    this process: the answer is DuckDB's, smaller than Q3's without a TTL (the TTL matters);
    the state holds a fraction of the people at any time, and none once the input ends."""
    events = source_events(SOURCE, 1)
    wanted = [queries.q3_by_person(r) | {"event_time": r["event_time"]}
              for r in events.to_pylist() if queries.is_q3_input(r)]  # fmt: skip
    timers = KeyedTimers(queries.q3_ttl, queries.q3_expire, "person", pa.int64(), True)
    store = ProcessState(timers, G, pa.int64())
    people = pa.array([r["person"] for r in wanted], pa.int64())
    for record, group in zip(wanted, key_groups(people, G).tolist(), strict=True):
        record.update(ingest_time=0, source=0, seq=0, _group=group)
    outputs: list[dict[str, Any]] = []
    held = []
    for start in range(0, len(wanted), 50):
        chunk = wanted[start : start + 50]
        rows, _ = store.apply(pa.RecordBatch.from_pylist(chunk), "person")
        outputs += rows
        watermark = max(r["event_time"] for r in chunk) - 50_000
        outputs += timers.fire(store, EVENT, watermark, ALL)
        held.append(store.key_count)
    outputs += timers.fire(store, EVENT, WatermarkTracker.FINAL, ALL)
    assert store.key_count == 0
    got = sorted(tuple(match) for row in outputs if row["value"] for match in row["value"])
    parquet = write_events(events, tmp_path / "events.parquet")
    expected = run_query("q3_ttl", parquet)
    assert got == expected and 0 < len(expected) < len(run_query("q3", parquet))
    persons = len({r["person"] for r in wanted})
    assert max(held) < persons / 3, (max(held), persons)


# -- live: bids per auction per period, fired by event-time timers -----------------------------


def timer_job(out: Path, **source_settings: Any) -> dict[str, Any]:
    """examples/nexmark/q5_counts.yaml with its window replaced by the timed process
    function: each auction's bids per period, emitted by an event-time timer."""
    job = example("q5_counts", out, **source_settings)
    for stage in job["graph"]:
        if stage["name"] == "q5":
            stage["operator"] = {
                "kind": "process",
                "function": "tests.job_fns:count_until_period_end",
                "on_timer": "tests.job_fns:emit_period",
            }
    return job


def check_each_period_fired_once(
    out: Path, emitted: list[int] | None, config: dict[str, Any] = SOURCE
) -> None:
    """The output is, row for row, each auction's bids per period counted in plain Python
    over the same events: nothing missing, nothing fired twice."""
    table = OutputLogReader(out).read_all()
    values = [json.loads(v) for v in table.column("value").to_pylist()]
    got = Counter(
        (key, end, count)
        for key, (end, count, kind) in zip(table.column("key").to_pylist(), values, strict=True)
        if kind == "event"
    )
    twice = [row for row, n in got.items() if n > 1]
    assert not twice, f"{len(twice)} periods fired more than once, e.g. {twice[:3]}"
    events = source_events(config, SOURCES, emitted).to_pydict()
    truth = Counter(
        (auction, (t // P + 1) * P)
        for kind, auction, t in zip(
            events["kind"], events["auction"], events["event_time"], strict=True
        )
        if kind == "bid"
    )
    expected = sorted((key, end, count) for (key, end), count in truth.items())
    assert len(expected) > 100, "too few periods: the test would prove little"
    assert sorted(got) == expected
    assert len(got) == table.num_rows


@pytest.mark.live
def test_event_time_timers_fire_each_period_once_as_python_counts(tmp_path: Path) -> None:
    out = tmp_path / "out"
    emitted = run_query_job(tmp_path, timer_job(out, total=20_000), lambda local, client: None)
    check_each_period_fired_once(out, emitted)


@pytest.mark.slow
@pytest.mark.live
@pytest.mark.parametrize("strategies", STRATEGY_PAIRS, ids="+".join)
def test_timers_fire_once_under_live_rescales(tmp_path: Path, strategies: tuple[str, ...]) -> None:
    """The timed stage goes 2 -> 3 -> 1 while events flow (out by one strategy of the pair, in
    by the other): its keys' timers move with their groups, and each fires once, at the owner
    that has the group when it is due."""
    out = tmp_path / "out"
    job = timer_job(out, total=None, profile={"rate": 8000})
    during = rescaling_mid_stream([("q5", 3), ("q5", 1)], strategies, flow=2000)
    emitted = run_query_job(tmp_path, job, during, drain=True)
    check_each_period_fired_once(out, emitted)


@pytest.mark.slow
@pytest.mark.live
@pytest.mark.parametrize("backend", STATE_BACKENDS)
def test_timers_fire_once_through_kill_minus_9_of_a_keyed_instance(
    tmp_path: Path, backend: str
) -> None:
    """Checkpoints every 0.5 s; a keyed instance is killed: the job restarts from its latest
    checkpoint, whose keys hold their unfired timers, and each period is output once."""
    out = tmp_path / "out"
    total = {"total": 30_000}
    job = timer_job(out, **total, profile={"rate": 5000})
    for stage in job["graph"]:
        if stage["name"] == "q5":
            stage["state"] = state_settings(backend, tmp_path)
    recover_through(tmp_path, job, lambda run: os.kill(run.pid_of("q5", 1), signal.SIGKILL))
    check_each_period_fired_once(out, None, SOURCE | total)
