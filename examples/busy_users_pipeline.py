"""The job of examples/busy_users.yaml, built with the Python API (`keyshift.runtime.pipeline`):
a filter between the keyed stage and the sink.

Run it to print the job file, then run that file:

    python -m examples.busy_users_pipeline > busy_users.yaml      # from the repository root
    keyshift run busy_users.yaml --duration 20
"""

from __future__ import annotations

from keyshift.runtime.pipeline import Dataflow, source


def busy_users() -> Dataflow:
    """The click counts of users with 10 clicks or more: clicks -> per-user (count) -> busy
    (filter) -> out."""
    clicks = source(
        "clicks",
        {
            "kind": "generator",
            "keys": 10000,
            "distribution": "zipf",
            "seed": 5,
            "profile": {"kind": "constant", "rate": 10000},
        },
        parallelism=1,
    )
    busy = (
        clicks.key_by("key")
        .count(name="per-user", parallelism=2)
        .filter("examples.busy_users:busy", name="busy")
    )
    return Dataflow("busy-users", busy.sink_log("out/busy-users", format="jsonl", name="out"))


if __name__ == "__main__":
    print(busy_users().to_yaml(), end="")
