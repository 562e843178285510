"""Keyed functions for examples/autoscale.yaml: an operator bound by a remote service.

`enrich` stands for an operator that looks each record up in another service (a feature store,
a user database) in round trips of 64 records, 2 ms each. Its capacity per instance is
therefore ~25-30k records/s whatever the CPU, which lets the autoscaling demo show real
scale-out on a two-core laptop; DS2 measures it as it would a CPU-bound operator.
"""

from __future__ import annotations

import time
from typing import Any

ROUND_TRIP_RECORDS = 64
ROUND_TRIP_SECONDS = 0.002

_pending = 0


def round_trip(seconds: float = ROUND_TRIP_SECONDS) -> None:
    """Account for one record's share of a lookup: every 64th record waits for a round trip."""
    global _pending
    _pending += 1
    if _pending == ROUND_TRIP_RECORDS:
        _pending = 0
        time.sleep(seconds)


def enrich(state: Any, record: dict[str, Any]) -> tuple[Any, Any]:
    """Count a user's clicks and sum their values; emit the running totals."""
    round_trip()
    count, total = state or (0, 0.0)
    count, total = count + 1, total + record["value"]
    return (count, total), count
