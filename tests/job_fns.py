"""Module-level functions that test jobs name as `tests.job_fns:NAME` (instances import them)."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

import pyarrow as pa


def track(state: Any, record: dict[str, Any]) -> tuple[Any, Any]:
    """Count a key's records and emit (count, source, seq): proves exactly-once and order."""
    count = (state or 0) + 1
    return count, [count, record["source"], record["seq"]]


def odd_key(record: dict[str, Any]) -> bool:
    """Filter before a sink: a keyed stage's updates of odd keys only."""
    return bool(record["key"] % 2)


def wrapped(record: dict[str, Any]) -> dict[str, Any]:
    """Map before a sink: the update kept, its value (a `track` output) wrapped in an object."""
    return {**record, "value": json.dumps({"tracked": json.loads(record["value"])})}


def slow_sink(batch: pa.RecordBatch) -> None:
    """A deliberately slow sink: 0.2 s per batch, whatever its size."""
    time.sleep(0.2)


SINK_COST = 0.0015  # seconds a record at `costly_sink`: near 670 records/s per instance


def costly_sink(batch: pa.RecordBatch) -> None:
    """A sink behind a slow service: SINK_COST a record, waited (busy time that does not burn
    the machine's cores), so the sink is what limits a job of a few thousand records/s."""
    time.sleep(batch.num_rows * SINK_COST)


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


def nest(state: Any, record: dict[str, Any]) -> tuple[Any, Any]:
    """Count a key's records and emit (count, the update it came from): after a chain of keyed
    stages, each output carries its whole path, so every stage's exactly-once is checkable."""
    count = (state or 0) + 1
    return count, [count, json.loads(record["value"])]


REGIONS = 61
ZONES = 5


def _region(stage: str, record: dict[str, Any]) -> dict[str, Any]:
    update = [stage, record["key"], json.loads(record["value"])]
    return {"key": record["key"] % REGIONS, "value": json.dumps(update)}


def to_region(record: dict[str, Any]) -> dict[str, Any]:
    """A user's update goes on keyed by the user's region, carrying the user."""
    return _region("users", record)


def odd_to_region(record: dict[str, Any]) -> dict[str, Any]:
    """`to_region` for the updates of the stage that counts odd keys."""
    return _region("odds", record)


def to_zone(record: dict[str, Any]) -> dict[str, Any]:
    """A region's update goes on keyed by the region's zone."""
    return {"key": record["key"] % ZONES, "value": record["value"]}


def by_user(record: dict[str, Any]) -> dict[str, Any]:
    """`to_region` that keeps the user as the key: the next stage has as many keys as users."""
    return {"key": record["key"], "value": to_region(record)["value"]}


def track_until_seq_3000(state: Any, record: dict[str, Any]) -> tuple[Any, Any]:
    """`track`, but fails on record 3000 of source 0: every run of the job fails there, a
    restart from a checkpoint included (it replays the record)."""
    if record["source"] == 0 and record["seq"] == 3000:
        raise RuntimeError("record 3000 of source 0 cannot be taken")
    return track(state, record)


PAD_BYTES = 4096


def key_pad(key: int) -> bytes:
    """`PAD_BYTES` of a key's own, as random as a hash: no compression shrinks them."""
    return hashlib.shake_128(key.to_bytes(8, "little", signed=True)).digest(PAD_BYTES)


def padded_count(state: Any, record: dict[str, Any]) -> tuple[Any, Any]:
    """Count a key's records beside a pad of `PAD_BYTES` derived from the key: wide state per
    key (as a feature vector or a session would be), whose bytes are checked on every record,
    so a value damaged by a move or a restore shows: the count is emitted negated then."""
    pad = key_pad(record["key"])
    count, kept = state if state is not None else (0, pad)
    return [count + 1, pad], count + 1 if kept == pad else -(count + 1)


# The two load phases of the DS2 graph test (tests/test_autoscaling_live.py) and benchmark
# (bench/ds2_graph.py): the first PHASE_SEQ records of the source are phase 1, the rest phase 2.
# A record's cost, in seconds, at each keyed stage of the chain in each phase: `second` costs
# more in phase 2, so the bottleneck moves from `first` to it. The cost is a wait (a slow
# service, as `slow_track`), so it counts as busy time without burning the machine's cores.
PHASE_SEQ = 15_000
COSTS = {"first": (0.001, 0.001), "second": (0.0002, 0.00165)}
_owed = 0.0


def _pay(stage: str, record: dict[str, Any]) -> None:
    """Wait for this record's cost, in waits of 5 ms at least (a sleep per record would cost
    more than the record)."""
    global _owed
    _owed += COSTS[stage][0 if record["seq"] < PHASE_SEQ else 1]
    if _owed >= 0.005:
        time.sleep(_owed)
        _owed = 0.0


def costly_first(state: Any, record: dict[str, Any]) -> tuple[Any, Any]:
    """`track` at the first stage's cost for the record's phase."""
    _pay("first", record)
    return track(state, record)


def costly_second(state: Any, record: dict[str, Any]) -> tuple[Any, Any]:
    """`nest` at the second stage's cost for the record's phase."""
    _pay("second", record)
    return nest(state, record)


# Timers (keyshift.runtime.timers): bids per auction per PERIOD_US of event time, each count
# emitted once by an event-time timer when the watermark passes its period's end.
PERIOD_US = 2_000_000


def count_until_period_end(
    state: dict[int, int] | None, record: dict[str, Any], timers: Any
) -> tuple[Any, Any]:
    """Count the record in its period and have the period's end fire a timer (registering
    one that exists already changes nothing)."""
    end = (record["event_time"] // PERIOD_US + 1) * PERIOD_US
    counts = state or {}
    counts[end] = counts.get(end, 0) + 1
    timers.register_event_time_timer(end)
    return counts, None


def emit_period(
    state: dict[int, int], key: Any, timestamp: int, kind: str, timers: Any
) -> tuple[Any, Any]:
    """The period that ended: emit (its end, its count, the timer's kind) and forget it."""
    count = state.pop(timestamp)
    return state or None, [timestamp, count, kind]


def fire_once_soon(state: Any, record: dict[str, Any], timers: Any) -> tuple[Any, Any]:
    """A key's first record sets a processing-time timer 100 ms ahead; the others nothing."""
    if state is None:
        timers.register_processing_time_timer(timers.current_processing_time + 100_000)
        return "waiting", None
    return state, None


def fired_now(state: Any, key: Any, timestamp: int, kind: str, timers: Any) -> tuple[Any, Any]:
    """Emit (key, kind) and remember that the key's timer fired."""
    return "fired", [key, kind]


class RefusedBid(ValueError):
    """What `refuse_big_bids` raises: a user's window function failing on a record."""


def refuse_big_bids(top: Any, bid: dict[str, Any]) -> Any:
    """A window reduce that raises on a bid above 10,000 (NEXMark's prices reach millions)."""
    if bid["price"] > 10_000:
        raise RefusedBid(f"bid {bid['price']} on auction {bid['auction']} refused")
    return bid["price"] if top is None else max(top, bid["price"])


def forget_refund_times(record: dict[str, Any]) -> dict[str, Any]:
    """A map that loses the event time (`at`) of a refund (negative clicks): a bad event time
    made by a user's function."""
    return {**record, "at": None} if record["clicks"] < 0 else record
