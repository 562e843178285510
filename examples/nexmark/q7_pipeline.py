"""The job of examples/nexmark/q7.yaml (NEXMark Q7: the highest bid per tumbling window of
10 s, an event-time window with a reduce function), built with the Python API's graph steps
(`keyshift.runtime.pipeline.source`, `KeyedStream.window` and `Dataflow`).

Run it to print the job file, then run that file:

    python -m examples.nexmark.q7_pipeline > q7.yaml      # from the repository root
    keyshift run q7.yaml --duration 30
"""

from __future__ import annotations

from examples.nexmark import queries
from examples.nexmark.events import timed_events
from keyshift.runtime.job import FieldType
from keyshift.runtime.pipeline import Dataflow


def q7() -> Dataflow:
    """events (nexmark) -> bids (filter) -> by-window (map) -> q7 (the highest bids per
    window) -> out."""
    events = timed_events()
    fields: dict[str, FieldType] = {
        "window": "int",
        "auction": "int",
        "bidder": "int",
        "price": "int",
    }
    highest = (
        events.filter(queries.is_bid, name="bids")
        .map(queries.q7_by_window, fields=fields, name="by-window")
        .key_by("window")
        .window(
            {"kind": "tumbling", "size_ms": 10000},
            reduce=queries.q7_highest,
            name="q7",
            parallelism=2,
        )
        .sink_log("out/nexmark-q7", format="jsonl", name="out")
    )
    return Dataflow("nexmark-q7", highest)


if __name__ == "__main__":
    print(q7().to_yaml(), end="")
