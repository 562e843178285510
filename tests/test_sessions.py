"""Session windows (keyshift.runtime.sessions): sessions per key that merge, fire once when the
watermark passes their end, move and restore with their key's group on both backends, take
late records within the allowed lateness and refuse later ones; bad sessions refused at load
(job file, CR, Python API); and a session job through real processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from keyshift.operator.streamingjob import StreamingJobSpec
from keyshift.runtime.checkpoint_store import CheckpointStore
from keyshift.runtime.ingest_client import IngestClient
from keyshift.runtime.job import JobError, WindowOperator, parse_job
from keyshift.runtime.metrics import MetricName
from keyshift.runtime.output_log import OutputLogReader
from keyshift.runtime.pipeline import Dataflow, source
from keyshift.runtime.records import record_schema
from keyshift.runtime.rocksdb_state import RocksProcessState, open_database, prepare_directory
from keyshift.runtime.sessions import SessionFunction, SessionWindows
from keyshift.runtime.state import ProcessState
from keyshift.runtime.state_values import ValueCodec
from tests.conftest import count_job, ingest_address, running_job, wait_for
from tests.test_checkpoints import checkpoint, restored
from tests.test_windows import metric_of, windowed_job

GROUPS = 8
# Users a and b are in key groups 0 and 4 of 8 (as the senders would route them).
GROUP_OF = {"a": 0, "b": 4}


def store(tmp_path: Path, backend: str, function: SessionFunction, owner: str) -> Any:
    if backend == "memory":
        return ProcessState(function, GROUPS, pa.string())
    db = open_database(prepare_directory(tmp_path / owner, owner), 8, 1)
    codec = ValueCodec(allow_pickle=False)
    return RocksProcessState(function, GROUPS, pa.string(), db, codec, False)


def sessions(
    tmp_path: Path,
    backend: str,
    owner: str = "s-0",
    lateness: int = 0,
    aggregate: str | None = "count",
    field: str | None = None,
    **functions: Any,
) -> SessionWindows:
    """Sessions of gap 10 µs per user over a fresh store."""
    reduce, process = functions.get("reduce"), functions.get("process")
    function = SessionFunction(10, lateness, aggregate, field, reduce, process, "user", GROUPS)
    return SessionWindows(
        function, "user", pa.string(), store(tmp_path, backend, function, owner), GROUPS
    )


def rows(*records: tuple[str, int] | tuple[str, int, int]) -> pa.RecordBatch:
    """(user, event time[, price]) records as a keyed stage receives them."""
    schema = record_schema({"user": "str", "price": "int"})
    users = [r[0] for r in records]
    times = [r[1] for r in records]
    prices = [r[2] if len(r) > 2 else 0 for r in records]
    zeros = [0] * len(records)
    groups = [GROUP_OF[u] for u in users]
    return pa.record_batch([users, prices, times, times, zeros, zeros, groups], schema=schema)


def add(
    windows: SessionWindows, watermark: int | None, *records: Any
) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """Records in at `watermark`: the updated results and the too-late records."""
    ready = np.ones(GROUPS, dtype=bool)
    updated, late = windows.absorb(rows(*records), windows.thresholds(watermark, ready))
    late_rows = [] if late is None else [(r["user"], r["event_time"], r["window_start"])
                                         for r in late.to_pylist()]  # fmt: skip
    return results(updated), late_rows


def results(out: pa.RecordBatch | None) -> list[tuple[Any, ...]]:
    columns = ("key", "window_start", "window_end", "value", "n")
    return [] if out is None else [tuple(row[c] for c in columns) for row in out.to_pylist()]


def keys(windows: SessionWindows) -> int:
    """Keys with sessions in the store."""
    store: Any = windows.state
    return int(store.key_count)


def fire(windows: SessionWindows, watermark: int, owned: np.ndarray | None = None) -> list[Any]:
    return results(windows.fire(watermark, owned if owned is not None else np.ones(8, bool)))


@pytest.mark.parametrize("backend", ["memory", "rocksdb"])
def test_records_less_than_the_gap_apart_are_one_session_and_a_bridge_merges_two(
    tmp_path: Path, backend: str
) -> None:
    """Gap 10: a at 0 and 5 are one session, [0, 15), a at 30 and 35 another; a at 20 is
    exactly the gap before 30, so a third, [20, 30); then 12 bridges [0, 15) and [20, 30)."""
    windows = sessions(tmp_path, backend)
    assert add(windows, None, ("a", 0), ("a", 5), ("a", 30), ("a", 35), ("b", 100)) == ([], [])
    assert add(windows, None, ("a", 20)) == ([], [])  # [20, 30) touches [30, 45): separate
    assert fire(windows, 14) == []  # a's first session ends at 15: 14 is before its end
    assert add(windows, 14, ("a", 12)) == ([], [])  # [0, 15) + [12, 22) + [20, 30) -> [0, 30)
    assert fire(windows, 30) == [("a", 0, 30, 4, 4)]
    assert fire(windows, 30) == [], "a session fired twice"
    assert fire(windows, 200) == [("a", 30, 45, 2, 2), ("b", 100, 110, 1, 1)]
    assert keys(windows) == 0, "fired sessions without lateness leave the store"
    if backend == "memory":  # the next incremental checkpoint deletes them (RocksDB's: native)
        store: Any = windows.state
        assert store.changes(range(GROUPS)).deleted == {0: ["a"], 4: ["b"]}


@pytest.mark.parametrize("backend", ["memory", "rocksdb"])
def test_a_record_too_late_for_its_merged_session_is_refused_one_in_an_open_session_is_not(
    tmp_path: Path, backend: str
) -> None:
    windows = sessions(tmp_path, backend)
    add(windows, None, ("a", 0), ("a", 8), ("a", 16))  # [0, 26), open at 20
    assert add(windows, 20, ("a", 1)) == ([], [])  # old, but its session is open: taken
    assert add(windows, 20, ("b", 5)) == ([], [("b", 5, 5)])  # [5, 15) ended before 20
    assert fire(windows, 26) == [("a", 0, 26, 4, 4)]
    assert add(windows, 26, ("a", 14)) == ([], [("a", 14, 14)])  # a's session fired and went
    assert keys(windows) == 0


@pytest.mark.parametrize("backend", ["memory", "rocksdb"])
def test_within_the_lateness_a_fired_session_is_updated_and_merged_and_leaves_after_it(
    tmp_path: Path, backend: str
) -> None:
    """Allowed lateness 50: a fired session takes a late record and sends its updated result
    at once; a late record that bridges it with a later open session merges them (an open
    session again, fired when the watermark passes its end); one that makes a fired session
    longer sends it with its new bounds; after end + 50 it leaves."""
    windows = sessions(tmp_path, backend, lateness=50, aggregate="sum", field="price")
    add(windows, None, ("a", 0, 1), ("a", 5, 2), ("a", 23, 4))  # [0, 15) and [23, 33)
    assert fire(windows, 20) == [("a", 0, 15, 3.0, 2)]
    assert add(windows, 20, ("a", 3, 10)) == ([("a", 0, 15, 13.0, 3)], [])
    assert add(windows, 20, ("a", 14, 20)) == ([], [])  # bridges them: [0, 33), open
    assert fire(windows, 33) == [("a", 0, 33, 37.0, 5)]
    assert add(windows, 80, ("a", 30, 100)) == ([("a", 0, 40, 137.0, 6)], [])
    assert fire(windows, 89) == [] and keys(windows) == 1
    assert add(windows, 90, ("a", 1, 1)) == ([], [("a", 1, 0)])  # 40 + 50 <= 90: too late
    assert fire(windows, 90) == [] and keys(windows) == 0


@pytest.mark.parametrize("backend", ["memory", "rocksdb"])
@pytest.mark.parametrize("kind", ["reduce", "process"])
def test_a_sessions_user_function_gets_its_records_merged_parts_earliest_first(
    tmp_path: Path, backend: str, kind: str
) -> None:
    functions = {"reduce": keep} if kind == "reduce" else {"process": prices}
    windows = sessions(tmp_path, backend, aggregate=None, field=None, **functions)
    add(windows, None, ("a", 18, 3), ("a", 0, 1), ("a", 25, 4))  # [18, 35) and [0, 10)
    add(windows, None, ("a", 9, 2))  # bridges them: [0, 10)'s first, then [18, 35)'s
    (fired,) = fire(windows, 100)
    assert fired[:3] == ("a", 0, 35) and fired[4] == 4
    expected = [1, 2, 3, 4] if kind == "reduce" else [[1, 0], [2, 9], [3, 18], [4, 25]]
    assert json.loads(fired[3]) == expected


def keep(acc: list[int] | None, record: dict[str, Any]) -> list[int]:
    return [*(acc or []), record["price"]]


def prices(records: list[dict[str, Any]]) -> list[list[int]]:
    """What `process` sees: the records' fields and event time (no runtime columns)."""
    assert all(set(r) == {"user", "price", "event_time"} for r in records), records
    return [[r["price"], r["event_time"]] for r in records]


@pytest.mark.parametrize("backend", ["memory", "rocksdb"])
def test_sessions_move_with_their_group_and_fire_once_at_the_new_owner(
    tmp_path: Path, backend: str
) -> None:
    """Group 4 moves (its state snapshotted and restored elsewhere, as a migration chunk or a
    checkpoint carries it): the old owner fires none of its sessions once it is not owned, the
    new one fires them once after `rebuild`, and a fired, retained session (allowed lateness)
    is known as fired there, as is one that fired at the old owner: never fired again, while
    the new owner's own watermark is lower (told the old one by `hand_over`)."""
    old = sessions(tmp_path, backend, "s-0", lateness=100)
    add(old, None, ("a", 0), ("b", 0), ("b", 30))
    assert fire(old, 12) == [("a", 0, 10, 1, 1), ("b", 0, 10, 1, 1)]
    owned = np.ones(GROUPS, dtype=bool)
    owned[4] = False
    new = sessions(tmp_path, backend, "s-1", lateness=100)
    moved: Any = old.state
    new_store: Any = new.state
    new_store.restore(moved.snapshot_groups([4]))
    moved.drop_groups([4])
    assert fire(old, 100, owned) == [], "the old owner fired a group it no longer owns"
    new.hand_over(np.array([4]), 12)
    new.rebuild([4], None)
    assert fire(new, 5) == []
    assert add(new, 5, ("b", 1)) == ([("b", 0, 11, 2, 2)], [])  # fired there: updated at once
    assert fire(new, 40) == [("b", 30, 40, 1, 1)]
    assert fire(new, 500) == [] and keys(new) == 0


def test_sessions_checkpoint_incrementally_and_a_restore_fires_the_unfired_ones_once(
    tmp_path: Path,
) -> None:
    """Memory store (RocksDB's checkpoints are native: Q11's kill -9 test): a checkpoint, then
    a fire (a session deleted) and a record: the second checkpoint holds the change and the
    deletion; restored into a fresh instance told the checkpoint's watermark, the sessions
    fire as they would have, the fired one never again."""
    checkpoints = CheckpointStore(str(tmp_path / "checkpoints"))
    windows = sessions(tmp_path, "memory")
    add(windows, None, ("a", 0), ("a", 30), ("b", 5))
    first, _ = checkpoint(checkpoints, windows.state, 1, None)
    assert fire(windows, 12) == [("a", 0, 10, 1, 1)]
    add(windows, 12, ("b", 13))  # [5, 15) -> [5, 23)
    meta, _ = checkpoint(checkpoints, windows.state, 2, first)
    again = sessions(tmp_path, "memory", "s-1")
    restored(checkpoints, meta, again.state)
    again.hand_over(np.arange(GROUPS), 12)
    again.rebuild(range(GROUPS), 12)
    assert fire(again, 12) == []
    assert fire(again, 100) == [("b", 5, 23, 2, 2), ("a", 30, 40, 1, 1)]


# -- the job's settings -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("window", "reason"),
    [
        ({"kind": "session", "gap_ms": 0}, "gap_ms: Input should be greater than or equal to 0.0"),
        ({"kind": "session", "gap_ms": -5}, "gap_ms: Input should be greater than or equal"),
        ({"kind": "session", "gap_ms": 0.0001}, "greater than or equal to 0.001"),
        ({"kind": "session", "gap_ms": "long"}, "gap_ms: Input should be a valid number"),
        ({"kind": "session"}, "gap_ms: Field required"),
        ({"kind": "session", "gap_ms": 5, "slide_ms": 5},
         "a session window has a gap_ms and no slide_ms"),
        ({"kind": "session", "gap_ms": 5, "size_ms": 5},
         "a session window has a gap_ms and no size_ms"),
        ({"kind": "tumbling", "size_ms": 5, "gap_ms": 5}, "gap_ms: Extra inputs are not permitted"),
    ],
)  # fmt: skip
def test_bad_session_windows_are_refused_at_load(window: dict[str, Any], reason: str) -> None:
    with pytest.raises(JobError, match=reason):
        parse_job(windowed_job(window, {}))


def test_a_session_window_needs_event_time_and_a_field_for_its_aggregate() -> None:
    with pytest.raises(JobError, match="a window needs event time"):
        parse_job(windowed_job({"kind": "session", "gap_ms": 5}, None))
    with pytest.raises(JobError, match=r"the aggregate .sum. needs a field"):
        parse_job(windowed_job({"kind": "session", "gap_ms": 5}, {}, function="sum"))
    spec = parse_job(windowed_job({"kind": "session", "gap_ms": 2.5}, {}))
    operator = spec.keyed_step("k").stage.operator
    assert isinstance(operator, WindowOperator) and operator.session
    assert operator.gap_us() == 2500
    with pytest.raises(ValueError, match="a session window has a gap, no size or slide"):
        operator.size_and_slide_us()


def test_a_streamingjob_refuses_a_bad_session_window() -> None:
    job = windowed_job({"kind": "session", "gap_ms": 5, "slide_ms": 1}, {})
    with pytest.raises(JobError, match="a session window has a gap_ms and no slide_ms"):
        StreamingJobSpec.model_validate({"job": job}).job_spec()
    good = windowed_job({"kind": "session", "gap_ms": 5}, {}, reduce="images_module:fold")
    StreamingJobSpec.model_validate({"job": good}).job_spec()


def test_the_python_api_builds_session_windows_and_refuses_bad_ones() -> None:
    def job(window: dict[str, Any], **operator: Any) -> Dataflow:
        events = source("events", {"kind": "nexmark", "total": 10}, event_time={})
        per_bidder = events.key_by("bidder").window(window, name="k", **operator)
        return Dataflow("w", per_bidder.sink_log(name="out"))

    built = job({"kind": "session", "gap_ms": 10_000}, reduce=keep).build()
    operator = built.keyed_step("k").stage.operator
    assert isinstance(operator, WindowOperator) and operator.gap_us() == 10_000_000
    with pytest.raises(JobError, match="gap_ms: Input should be greater than or equal"):
        job({"kind": "session", "gap_ms": -1}).build()
    with pytest.raises(JobError, match="a session window has a gap_ms and no slide_ms"):
        job({"kind": "session", "gap_ms": 5, "slide_ms": 5}).build()


# -- through real processes -------------------------------------------------------------------


@pytest.mark.live
def test_sessions_fire_on_the_watermark_update_within_the_lateness_and_log_later_records(
    tmp_path: Path,
) -> None:
    """Gap 1 s, allowed lateness 2 s, on RocksDB: user a's pushes at 0 and 0.5 s are a
    session; one at 3 s passes its end (it fires, 2); one at 1 s (late, within the lateness)
    updates it (3, now [0, 2 s)); one at 10 s ends the lateness; one at 0.2 s is too late:
    counted and logged with its session's start, not applied."""
    out, late = tmp_path / "out", tmp_path / "late"
    job = count_job(
        fields={"user": "str", "clicks": "int", "at": "int"},
        source={"config": {"kind": "ingest"},
                "event_time": {"field": "at", "max_out_of_orderness_ms": 0}},
        keyed={"name": "per-user", "parallelism": 1, "key_by": "user",
               "state": {"backend": "rocksdb", "path": str(tmp_path / "state")},
               "operator": {"kind": "window", "window": {"kind": "session", "gap_ms": 1000},
                            "allowed_lateness_ms": 2000}},
        sink={"config": {"kind": "log", "path": str(out)}},
        late_records={"path": str(late)},
    )  # fmt: skip
    second, start = 1_000_000, 1_700_000_000_000_000
    pushes = [0, second // 2, 3 * second, second, 10 * second, second // 5]
    with running_job(tmp_path, job) as local:
        wait_for(lambda: local.status()["phase"] == "running", 120, "the job to run")

        with IngestClient(
            wait_for(lambda: ingest_address(local), 30, "the ingest endpoint")
        ) as client:
            for n, at in enumerate(pushes):
                table = pa.table({"user": ["a"], "clicks": [1], "at": [start + at]})
                assert client.push(table, batch_id=f"b{n}").accepted == 1
        wait_for(lambda: metric_of(local, 1, MetricName.LATE_RECORDS) == 1, 30, "a late record")
        local.drain()
        wait_for(lambda: local.status()["phase"] == "finished", 30, "the job to drain")
    table = OutputLogReader(out).read_all()
    columns = ("window_start", "window_end", "n")
    got = sorted(zip(*(table.column(c).to_pylist() for c in columns), strict=True))
    assert got == [(start, start + 3 * second // 2, 2), (start, start + 2 * second, 3),
                   (start + 3 * second, start + 4 * second, 1),
                   (start + 10 * second, start + 11 * second, 1)]  # fmt: skip
    logged = OutputLogReader(late / "per-user").read_all()
    assert logged.column("at").to_pylist() == [start + second // 5]
    assert logged.column("window_start").to_pylist() == [start + second // 5]
