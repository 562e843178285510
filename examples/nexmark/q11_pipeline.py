"""The job of examples/nexmark/q11.yaml (NEXMark Q11: the bids of each bidder per session, a
session ending 10 s after the bidder's last bid), built with the Python API's graph steps
(`keyshift.runtime.pipeline.source`, `KeyedStream.window` with a session window, `Dataflow`).

Run it to print the job file, then run that file:

    python -m examples.nexmark.q11_pipeline > q11.yaml      # from the repository root
    keyshift run q11.yaml --duration 30
"""

from __future__ import annotations

from examples.nexmark import queries
from examples.nexmark.events import timed_events
from keyshift.runtime.pipeline import Dataflow


def q11() -> Dataflow:
    """events (nexmark) -> bids (filter) -> q11 (bids per bidder and session) -> out."""
    sessions = (
        timed_events()
        .filter(queries.is_bid, name="bids")
        .key_by("bidder")
        .window({"kind": "session", "gap_ms": 10000}, "count", name="q11", parallelism=2)
        .sink_log("out/nexmark-q11", format="jsonl", name="out")
    )
    return Dataflow("nexmark-q11", sessions)


if __name__ == "__main__":
    print(q11().to_yaml(), end="")
