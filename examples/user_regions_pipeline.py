"""The job of examples/user_regions.yaml, built with the Python API (`keyshift.runtime.pipeline`):
one keyed stage read by a sink and by a second keyed stage, which has a sink of its own.

Run it to print the job file, then run that file:

    python -m examples.user_regions_pipeline > user_regions.yaml      # from the repository root
    keyshift run user_regions.yaml --duration 20
"""

from __future__ import annotations

from keyshift.runtime.pipeline import Dataflow, source


def user_regions() -> Dataflow:
    """Clicks per user into the sink `users`, and the busiest user's clicks per region into
    the sink `regions`: clicks -> per-user (count) -> users, and per-user -> to-region (map)
    -> per-region (max) -> regions."""
    clicks = source(
        "clicks",
        {
            "kind": "generator",
            "keys": 10000,
            "distribution": "zipf",
            "seed": 7,
            "profile": {"kind": "constant", "rate": 10000},
        },
        parallelism=1,
    )
    per_user = clicks.key_by("key").count(name="per-user", parallelism=2)
    per_region = (
        per_user.map(
            "examples.regions:to_region",
            fields={"region": "int", "clicks": "int"},
            name="to-region",
        )
        .key_by("region")
        .aggregate("max", "clicks", name="per-region")
    )
    return Dataflow(
        "user-regions",
        per_user.sink_log("out/user-regions/users", format="jsonl", partitions=2, name="users"),
        per_region.sink_log("out/user-regions/regions", format="jsonl", name="regions"),
    )


if __name__ == "__main__":
    print(user_regions().to_yaml(), end="")
