"""The job of examples/nexmark/q3.yaml (NEXMark Q3, an incremental join of people and their
auctions), built with the Python API's graph steps (`keyshift.runtime.pipeline.source` and
`Dataflow`). The other query jobs are built the same way.

Run it to print the job file, then run that file:

    python -m examples.nexmark.q3_pipeline > q3.yaml      # from the repository root
    keyshift run q3.yaml --duration 20
"""

from __future__ import annotations

from examples.nexmark import queries
from keyshift.runtime.pipeline import Dataflow, source


def q3() -> Dataflow:
    """events (nexmark) -> wanted (filter) -> by-person (map) -> q3 (process) -> out."""
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
    joined = (
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
        .process(queries.q3, name="q3", parallelism=2)
    )
    return Dataflow("nexmark-q3", joined.sink_log("out/nexmark-q3", format="jsonl", name="out"))


if __name__ == "__main__":
    print(q3().to_yaml(), end="")
