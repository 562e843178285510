"""The job of examples/regions.yaml, built with the Python API (`keyshift.runtime.pipeline`):
two keyed stages, the second keyed by a field the map between them makes.

Run it to print the job file, then run that file:

    python -m examples.regions_pipeline > regions.yaml      # from the repository root
    keyshift run regions.yaml --duration 20
"""

from __future__ import annotations

from keyshift.runtime.pipeline import Dataflow, source


def regions() -> Dataflow:
    """The busiest user's clicks per region: clicks -> per-user (count) -> to-region (map) ->
    per-region (max) -> out."""
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
    per_region = (
        clicks.key_by("key")
        .count(name="per-user", parallelism=2)
        .map(
            "examples.regions:to_region",
            fields={"region": "int", "clicks": "int"},
            name="to-region",
        )
        .key_by("region")
        .aggregate("max", "clicks", name="per-region", parallelism=2)
    )
    return Dataflow("regions", per_region.sink_log("out/regions", format="jsonl", name="out"))


if __name__ == "__main__":
    print(regions().to_yaml(), end="")
