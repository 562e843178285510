"""The jobs of examples/nexmark/q8.yaml (NEXMark Q8: people who open an auction in the 10 s
window they register in, a window join), examples/nexmark/q8_sources.yaml (the same query with
people and auctions from two sources) and examples/nexmark/early_bids.yaml (bids within 2 s
of their auction's opening, an interval join), built with the Python API's joins
(`KeyedStream.window_join`, `KeyedStream.interval_join`).

Run it to print a job file, then run that file:

    python -m examples.nexmark.q8_pipeline > q8.yaml              # from the repository root
    python -m examples.nexmark.q8_pipeline sources > q8_sources.yaml
    python -m examples.nexmark.q8_pipeline early_bids > early_bids.yaml
    keyshift run q8.yaml --duration 30
"""

from __future__ import annotations

import sys

from examples.nexmark import queries
from examples.nexmark.events import timed_events
from keyshift.runtime.pipeline import Dataflow


def q8() -> Dataflow:
    """events (nexmark) -> persons, auctions (filters) -> q8 (a window join of 10 s) -> out."""
    events = timed_events()
    persons = events.filter(queries.is_person, name="persons").key_by("id")
    auctions = events.filter(queries.is_auction, name="auctions").key_by("seller")
    joined = persons.window_join(auctions, 10000, queries.q8, name="q8", parallelism=2)
    return Dataflow("nexmark-q8", joined.sink_log("out/nexmark-q8", format="jsonl", name="out"))


def q8_sources() -> Dataflow:
    """people, sellers (two nexmark sources) -> persons, auctions (a filter on each) -> q8 (a
    window join of 10 s) -> out: each side of the join comes from a source of its own."""
    persons = timed_events("people").filter(queries.is_person, name="persons").key_by("id")
    auctions = timed_events("sellers").filter(queries.is_auction, name="auctions")
    joined = persons.window_join(
        auctions.key_by("seller"), 10000, queries.q8, name="q8", parallelism=2
    )
    out = joined.sink_log("out/nexmark-q8-sources", format="jsonl", name="out")
    return Dataflow("nexmark-q8-sources", out)


def early_bids() -> Dataflow:
    """events (nexmark) -> auctions, bids (filters) -> early-bids (an interval join: bids
    within [auction.ts, auction.ts + 2 s]) -> out."""
    events = timed_events()
    auctions = events.filter(queries.is_auction, name="auctions").key_by("id")
    bids = events.filter(queries.is_bid, name="bids").key_by("auction")
    joined = auctions.interval_join(
        bids, 0, 2000, queries.early_bid, name="early-bids", parallelism=2
    )
    out = joined.sink_log("out/nexmark-early-bids", format="jsonl", name="out")
    return Dataflow("nexmark-early-bids", out)


if __name__ == "__main__":
    jobs = {"early_bids": early_bids, "sources": q8_sources}
    job = jobs[sys.argv[1]]() if sys.argv[1:] else q8()
    print(job.to_yaml(), end="")
