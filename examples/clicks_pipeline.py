"""The job of examples/clicks.yaml, built with the Python API (`keyshift.runtime.pipeline`).

Run it to print the job file, then run that file:

    python examples/clicks_pipeline.py > clicks.yaml
    keyshift run clicks.yaml --duration 20
"""

from __future__ import annotations

from keyshift.runtime.pipeline import Pipeline


def clicks() -> Pipeline:
    """A keyed running count of clicks per user: 1 generator -> 2 keyed -> a JSON-lines log."""
    return (
        Pipeline("clicks", max_key_groups=4096)
        .generator(
            keys=100_000,
            distribution="zipf",
            zipf_exponent=1.0,
            seed=7,
            profile={"kind": "step", "rate": 20000, "to": 60000, "at": 10},
            parallelism=1,
        )
        .fields(key="int", value="float")
        .key_by("key")
        .count(parallelism=2, name="counts")
        .sink_log("out/clicks", format="jsonl", parallelism=1)
        .batching(max_records=8192, linger_ms=5, credits=8)
    )


if __name__ == "__main__":
    print(clicks().to_yaml(), end="")
