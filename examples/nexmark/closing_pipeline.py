"""The jobs of examples/nexmark/q4.yaml and q6.yaml (NEXMark Q4 and Q6: auctions closed by
event-time timers, then closing prices averaged per category or per seller), built with the
Python API's graph steps (`keyshift.runtime.pipeline.source` and `Dataflow`).

Run it to print a job file, then run that file:

    python -m examples.nexmark.closing_pipeline q4 > q4.yaml   # from the repository root
    python -m examples.nexmark.closing_pipeline q6 > q6.yaml
    keyshift run q4.yaml --duration 30
"""

from __future__ import annotations

import sys
from typing import Literal

from examples.nexmark import closing
from examples.nexmark.events import timed_events
from keyshift.runtime.pipeline import Dataflow, Stream


def closed_auctions() -> Stream:
    """events (nexmark) -> wanted (filter) -> by-auction (map) -> close (the winning bid of
    each auction, by a timer at its `expires`) -> closed (map): Q4's and Q6's first stage."""
    events = timed_events()
    return (
        events.filter(closing.is_auction_or_bid, name="wanted")
        .map(closing.by_auction, fields=closing.AUCTION_OR_BID_FIELDS, name="by-auction")
        .key_by("auction")
        .process(closing.winning_bid, on_timer=closing.close_auction, name="close", parallelism=2)
        .map(closing.closed, fields=closing.CLOSED_FIELDS, name="closed")
    )


def closing_query(query: Literal["q4", "q6"]) -> Dataflow:
    """Q4: the running mean of the closing prices per category (`q4`); Q6: per seller, the
    mean of its last 10 at each closing (`q6`); then out."""
    if query == "q4":
        averages = (
            closed_auctions()
            .key_by("category")
            .aggregate("mean", "price", name="q4", parallelism=2)
        )
    else:
        averages = (
            closed_auctions()
            .key_by("seller")
            .process(closing.last_closed, on_timer=closing.average_last, name="q6", parallelism=2)
        )
    name = f"nexmark-{query}"
    return Dataflow(name, averages.sink_log(f"out/{name}", format="jsonl", name="out"))


if __name__ == "__main__":
    print(closing_query("q6" if "q6" in sys.argv else "q4").to_yaml(), end="")
