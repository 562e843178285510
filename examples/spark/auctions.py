"""The keyed function of examples/spark/bids.yaml: per auction, its bids and their total price.

Like examples/lookups.py it looks each bid up in another service (the auction's reserve price,
say) in round trips of 64 bids, here 6 ms each, so one instance serves ~8-10k bids/s on any
machine and the demo's load of up to 20k bids/s needs DS2 to scale out.
"""

from __future__ import annotations

from typing import Any

from examples.lookups import round_trip

ROUND_TRIP_SECONDS = 0.006


def bid(state: Any, record: dict[str, Any]) -> tuple[Any, Any]:
    """Count the auction's bids and sum their prices; emit both after each bid."""
    round_trip(ROUND_TRIP_SECONDS)
    bids, total = state or (0, 0)
    bids, total = bids + 1, total + record["price"]
    return (bids, total), {"bids": bids, "total": total}
