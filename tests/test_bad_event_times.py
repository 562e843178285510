"""Records whose event time is missing, null or not a timestamp at run time, through real
processes: rows pushed to an ingest endpoint (Arrow and JSON; a bad event-time field, a null
`event_time` in a source with event time) and records a chained map makes with a bad event-time
field are never applied and never crash a stage: counted in keyshift_invalid_records_total
with reason `event_time` and written to the job's late-records log, under the source stage,
one row (reason, record as JSON) each; the good records around them go on into their windows.
Past the source an event time cannot be bad any more: a window or a timer reads the column the
source filled (from the field, the pushed column, or the ingest time), never null."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from keyshift.runtime.ingest_client import IngestClient, IngestReply
from keyshift.runtime.job import LateRecordsLog
from keyshift.runtime.late_records import BadEventTimesWriter
from keyshift.runtime.metrics import MetricName
from keyshift.runtime.output_log import OutputLogReader
from tests.conftest import count_job, ingest_address, running_job, wait_for

START = 1_700_000_000_000_000  # a multiple of the windows' size
SECOND = 1_000_000


def window_job(tmp_path: Path, event_time: dict[str, Any], **source: Any) -> dict[str, Any]:
    """Clicks per user and tumbling second, from an ingest source, with a late-records log."""
    return count_job(
        fields={"user": "str", "clicks": "int", "at": "int"},
        source={"config": {"kind": "ingest"}, "event_time": event_time, **source},
        keyed={"name": "per-user", "parallelism": 1, "key_by": "user",
               "operator": {"kind": "window", "window": {"kind": "tumbling", "size_ms": 1000},
                            "function": "sum", "field": "clicks"}},
        sink={"config": {"kind": "log", "path": str(tmp_path / "out")}},
        late_records={"path": str(tmp_path / "late")},
    )  # fmt: skip


def bad_event_times(local: Any) -> float:
    """The source's invalid records with reason `event_time`."""
    (instance,) = local.status()["stages"][0]["instances"]
    if not instance.get("metrics"):
        return 0.0
    text = urllib.request.urlopen(f"http://{instance['metrics']}/metrics").read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(MetricName.INVALID_RECORDS + "{") and 'reason="event_time"' in line
    )


def run_pushes(
    tmp_path: Path, job: dict[str, Any], pushes: list[Any], bad: int
) -> tuple[list[IngestReply], list[tuple[str, Any]], list[tuple[Any, ...]]]:
    """Push each of `pushes`, wait for `bad` bad event times, drain: the replies, the logged
    (reason, record) rows of the source stage, and the windows' (user, start, clicks)."""
    with running_job(tmp_path, job) as local:
        wait_for(lambda: local.status()["phase"] == "running", 120, "the job to run")
        source = local.status()["stages"][0]

        with IngestClient(
            wait_for(lambda: ingest_address(local), 30, "the ingest endpoint")
        ) as client:
            replies = [client.push(rows, batch_id=f"b{n}") for n, rows in enumerate(pushes)]
        wait_for(lambda: bad_event_times(local) == bad, 30, f"{bad} bad event times counted")
        local.drain()
        wait_for(lambda: local.status()["phase"] == "finished", 30, "the job to drain")
    logged = OutputLogReader(tmp_path / "late" / source["name"]).read_all()
    rows = list(
        zip(
            logged.column("reason").to_pylist(),
            [json.loads(r) for r in logged.column("record").to_pylist()],
            strict=True,
        )
    )
    out = OutputLogReader(tmp_path / "out").read_all()
    windows = sorted(
        zip(*(out.column(c).to_pylist() for c in ("key", "window_start", "value")), strict=True)
    )
    return replies, rows, windows


@pytest.mark.live
def test_bad_event_time_fields_from_ingest_and_from_a_map_are_counted_and_logged(
    tmp_path: Path,
) -> None:
    """Event times from the field `at`: an Arrow row with a null `at`, a JSON row whose `at` is
    text, and a refund whose `at` the chained map loses are each counted and logged with their
    reason; the rows around them are summed into their windows."""
    job = window_job(
        tmp_path,
        {"field": "at", "max_out_of_orderness_ms": 0},
        transforms=[{"map": "tests.job_fns:forget_refund_times"}],
    )
    arrow = pa.table({"user": ["a", "a", "b"], "clicks": [1, 2, 4],
                      "at": pa.array([START, None, START + 1], pa.int64())})  # fmt: skip
    json_rows = [{"user": "a", "clicks": 8, "at": "soon"}, {"user": "b", "clicks": 16, "at": START}]
    refund = pa.table({"user": ["a", "b"], "clicks": [-32, 64], "at": [START, START + SECOND]})
    replies, logged, windows = run_pushes(tmp_path, job, [arrow, json_rows, refund], bad=3)
    assert [(r.accepted, r.rejected) for r in replies] == [(2, 1), (1, 1), (2, 0)]
    assert replies[0].reasons == ("missing field 'at'",)
    assert logged == [
        ("missing field 'at'", {"user": "a", "clicks": 2, "at": None}),
        ("field 'at' should be int, got str", {"user": "a", "clicks": 8, "at": "soon"}),
        ("missing field 'at'", {"user": "a", "clicks": -32, "at": None}),
    ]
    assert windows == [("a", START, 1.0), ("b", START, 20.0), ("b", START + SECOND, 64.0)]


@pytest.mark.live
def test_a_null_event_time_in_a_source_with_event_time_is_counted_and_logged(
    tmp_path: Path,
) -> None:
    """Event time from the pushed `event_time` column: a null there is a bad event time (not
    the ingest time, which would put the row in a window it may not belong to), in Arrow and
    in JSON; a push without the column still takes the ingest time."""
    job = window_job(tmp_path, {"max_out_of_orderness_ms": 0})
    arrow = pa.table({"user": ["a", "b"], "clicks": [1, 2], "at": [0, 0],
                      "event_time": pa.array([START, None], pa.int64())})  # fmt: skip
    json_rows = [{"user": "a", "clicks": 4, "at": 0, "event_time": None},
                 {"user": "b", "clicks": 8, "at": 0, "event_time": START + 1}]  # fmt: skip
    replies, logged, windows = run_pushes(tmp_path, job, [arrow, json_rows], bad=2)
    assert [(r.accepted, r.rejected) for r in replies] == [(1, 1), (1, 1)]
    null = "field 'event_time' is null (in a source with event time)"
    assert logged == [
        (null, {"user": "b", "clicks": 2, "at": 0, "event_time": None}),
        (null, {"user": "a", "clicks": 4, "at": 0, "event_time": None}),
    ]
    assert windows == [("a", START, 1.0), ("b", START, 8.0)]


def test_the_log_keeps_any_bad_record_as_json_text(tmp_path: Path) -> None:
    """Whatever a bad record holds (bytes, NaN, a lone surrogate; no mapping at all), it is
    written: values JSON cannot hold as their repr."""
    writer = BadEventTimesWriter(LateRecordsLog(path=str(tmp_path)), "events", 2)
    records: list[Any] = [{"at": b"\x00", "x": float("nan")}, {"at": "\ud800"}, "row 3"]
    writer.write(records, ["a", "b", "c"])
    writer.close()
    logged = OutputLogReader(tmp_path / "events").read_all()
    assert logged.column("reason").to_pylist() == ["a", "b", "c"]
    assert [json.loads(r) for r in logged.column("record").to_pylist()][1:] == [
        {"at": "\ud800"},
        "row 3",
    ]
    assert json.loads(logged.column("record")[0].as_py())["at"] == "b'\\x00'"
