"""The live view's rates and latency from coordinator status snapshots."""

from __future__ import annotations

from typing import Any

from keyshift.operator.live_view import RateTracker
from keyshift.runtime.metrics import LATENCY_BUCKETS


def status(sink_buckets: list[list[int]], records: int) -> dict[str, Any]:
    def instance(buckets: list[int]) -> dict[str, Any]:
        stats = {"records_in": records, "records_out": records, "busy": 0.0}
        return {"stats": {**stats, "latency_buckets": buckets}}

    return {
        "stages": [
            {"name": "source", "parallelism": 1, "instances": [instance([])]},
            {"name": "sink", "parallelism": 2, "instances": [instance(b) for b in sink_buckets]},
        ]
    }


def test_latency_counts_only_the_instances_that_reported_a_histogram() -> None:
    full = [0] * (len(LATENCY_BUCKETS) + 1)
    full[3] = 10  # all in (0.005, 0.01]
    tracker = RateTracker()
    # The second sink instance has just registered: no histogram in its stats yet.
    tracker.add(status([full, []], 10), now=0.0)
    assert tracker.latency() == (None, None)  # one snapshot: no window yet
    p50, _ = tracker.latency(overall=True)
    assert p50 is not None and 0.005 < p50 <= 0.01
    tracker.add(status([full, full], 20), now=1.0)
    assert tracker.latency(overall=True)[1] is not None
