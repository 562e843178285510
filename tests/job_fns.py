"""Module-level functions that test jobs name as `tests.job_fns:NAME` (instances import them)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pyarrow as pa


def track(state: Any, record: dict[str, Any]) -> tuple[Any, Any]:
    """Count a key's records and emit (count, source, seq): proves exactly-once and order."""
    count = (state or 0) + 1
    return count, [count, record["source"], record["seq"]]


def slow_sink(batch: pa.RecordBatch) -> None:
    """A deliberately slow sink: 0.2 s per batch, whatever its size."""
    time.sleep(0.2)


def every_seventh_broken(record: dict[str, Any]) -> dict[str, Any]:
    """Passes records through, but breaks every 7th in a different way (schema test)."""
    seq = record["seq"]
    if seq % 21 == 0:
        return {"key": "not-an-int", "value": record["value"]}
    if seq % 21 == 7:
        return {"value": record["value"]}
    if seq % 21 == 14:
        raise ValueError("boom")
    return {"key": record["key"], "value": record["value"]}


def is_broken(seq: int) -> bool:
    return seq % 7 == 0


_since_round_trip = 0


def slow_track(state: Any, record: dict[str, Any]) -> tuple[Any, Any]:
    """`track` behind a slow service: 10 ms per 64 records caps an instance near 6k records/s,
    so an autoscaling test sees real overload without burning the machine's two cores."""
    global _since_round_trip
    _since_round_trip += 1
    if _since_round_trip == 64:
        _since_round_trip = 0
        time.sleep(0.010)
    return track(state, record)


@dataclass
class Tally:
    """A state value only pickle can carry (not plain data)."""

    count: int


def tally(state: Tally | None, record: dict[str, Any]) -> tuple[Any, Any]:
    """`track` with its count in a `Tally`: its state moves and is checkpointed as a pickle."""
    tally = state or Tally(0)
    tally.count += 1
    return tally, [tally.count, record["source"], record["seq"]]


def track_until_seq_3000(state: Any, record: dict[str, Any]) -> tuple[Any, Any]:
    """`track`, but fails on record 3000 of source 0: every run of the job fails there, a
    restart from a checkpoint included (it replays the record)."""
    if record["source"] == 0 and record["seq"] == 3000:
        raise RuntimeError("record 3000 of source 0 cannot be taken")
    return track(state, record)
