"""The job of examples/nexmark/q3.yaml (NEXMark Q3, an incremental join of people and their
auctions), built with the Python API's graph steps (`keyshift.runtime.pipeline.source` and
`Dataflow`). The other query jobs are built the same way.

Run it to print the job file, then run that file:

    python -m examples.nexmark.q3_pipeline > q3.yaml      # from the repository root
    python -m examples.nexmark.q3_pipeline --ttl > q3_ttl.yaml   # Q3 with a state TTL
    keyshift run q3.yaml --duration 20
"""

from __future__ import annotations

import sys
from typing import Any

from examples.nexmark import queries
from keyshift.runtime.pipeline import Dataflow, source


def q3(ttl: bool = False) -> Dataflow:
    """events (nexmark) -> wanted (filter) -> by-person (map) -> q3 (process) -> out; with
    `ttl`, examples/nexmark/q3_ttl.yaml's: the join's state expires by event-time timers."""
    config: dict[str, Any] = {
        "kind": "nexmark",
        "seed": 1,
        "event_rate": 10000,
        "profile": {"kind": "constant", "rate": 20000},
    }
    event_time = None
    if ttl:
        config["max_disorder_ms"] = 50
        event_time = {"max_out_of_orderness_ms": 50, "idle_timeout_ms": 1000}
    events = source("events", config, parallelism=1, event_time=event_time)
    by_person = (
        events.filter(queries.is_q3_input, name="wanted")
        .map(
            queries.q3_by_person,
            fields={
                "person": "int",
                "auction": "int",
                "name": "str",
                "city": "str",
                "state": "str",
            },
            name="by-person",
        )
        .key_by("person")
    )
    if ttl:
        joined = by_person.process(
            queries.q3_ttl, on_timer=queries.q3_expire, name="q3", parallelism=2
        )
    else:
        joined = by_person.process(queries.q3, name="q3", parallelism=2)
    name = "nexmark-q3-ttl" if ttl else "nexmark-q3"
    return Dataflow(name, joined.sink_log(f"out/{name}", format="jsonl", name="out"))


if __name__ == "__main__":
    print(q3(ttl="--ttl" in sys.argv).to_yaml(), end="")
