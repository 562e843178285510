"""The jobs of examples/nexmark/q0.yaml, q1.yaml and q2.yaml (NEXMark's per-bid queries:
pass-through, currency conversion, selection), built with the Python API's graph steps
(`keyshift.runtime.pipeline.source` and `Dataflow`): each a filter of the bids, keyed by
auction, and a process function per bid.

Run it with a query's name to print its job file, then run that file:

    python -m examples.nexmark.bids_pipeline q1 > q1.yaml      # from the repository root
    keyshift run q1.yaml --duration 20
"""

from __future__ import annotations

import sys

from examples.nexmark import queries
from keyshift.runtime.pipeline import Dataflow, UserFunction, source

# query -> (its filter's name, the filter, the process function)
BID_QUERIES: dict[str, tuple[str, UserFunction, UserFunction]] = {
    "q0": ("bids", queries.is_bid, queries.q0),
    "q1": ("bids", queries.is_bid, queries.q1),
    "q2": ("selected", queries.is_q2_bid, queries.q2),
}


def bid_query(query: str) -> Dataflow:
    """events (nexmark) -> the query's filter -> `query` (process, keyed by auction) -> out."""
    step, keep, fn = BID_QUERIES[query]
    events = source(
        "events",
        {
            "kind": "nexmark",
            "seed": 1,
            "event_rate": 10000,
            "profile": {"kind": "constant", "rate": 20000},
        },
        parallelism=1,
    )
    answered = (
        events.filter(keep, name=step)
        .key_by("auction")
        .process(fn, name=query, parallelism=2)
        .sink_log(f"out/nexmark-{query}", format="jsonl", name="out")
    )
    return Dataflow(f"nexmark-{query}", answered)


if __name__ == "__main__":
    print(bid_query(sys.argv[1] if len(sys.argv) > 1 else "q0").to_yaml(), end="")
