"""The job of examples/nexmark/q5.yaml (NEXMark Q5: the auction(s) with the most bids per
sliding window, two keyed stages of event-time windows, the second with a reduce function),
built with the Python API's graph steps (`keyshift.runtime.pipeline.source`,
`KeyedStream.window` and `Dataflow`).

Run it to print the job file, then run that file:

    python -m examples.nexmark.q5_pipeline > q5.yaml      # from the repository root
    keyshift run q5.yaml --duration 30
"""

from __future__ import annotations

from examples.nexmark import queries
from examples.nexmark.events import timed_events
from keyshift.runtime.pipeline import Dataflow


def q5() -> Dataflow:
    """events (nexmark) -> bids (filter) -> q5 (bids per auction and sliding window) ->
    q5-hot (the highest count per window and its auctions) -> out."""
    events = timed_events()
    counts = (
        events.filter(queries.is_bid, name="bids")
        .key_by("auction")
        .window(
            {"kind": "sliding", "size_ms": 10000, "slide_ms": 2000},
            "count",
            name="q5",
            parallelism=2,
        )
    )
    hot = (
        counts.key_by("window_start")
        .window({"kind": "tumbling", "size_ms": 2000}, reduce=queries.q5_hottest, name="q5-hot")
        .sink_log("out/nexmark-q5", format="jsonl", name="out")
    )
    return Dataflow("nexmark-q5", hot)


if __name__ == "__main__":
    print(q5().to_yaml(), end="")
