"""The job of examples/pages.yaml, built with the Python API's graph steps
(`keyshift.runtime.pipeline.source` and `Dataflow`).

Run it to print the job file, then run that file:

    python -m examples.pages_pipeline > pages.yaml      # from the repository root
    keyshift run pages.yaml --duration 20

The map and filter are named by "module:function" (they live in examples/pages.py), which the
job's processes import from the repository root; a module-level function object works too.
"""

from __future__ import annotations

from keyshift.runtime.pipeline import Dataflow, source


def pages() -> Dataflow:
    """Seconds viewed per page: clicks -> views (map) -> long-views (filter) -> per-page -> out."""
    clicks = source(
        "clicks",
        {
            "kind": "generator",
            "keys": 10000,
            "seed": 3,
            "profile": {"kind": "constant", "rate": 20000},
        },
        parallelism=1,
    )
    per_page = (
        clicks.map(
            "examples.pages:to_view",
            fields={"user": "int", "page": "int", "seconds": "float"},
            name="views",
        )
        .filter("examples.pages:lasted", name="long-views")
        .key_by("page")
        .aggregate("sum", "seconds", name="per-page", parallelism=2)
    )
    return Dataflow("pages", per_page.sink_log("out/pages", format="jsonl", name="out"))


if __name__ == "__main__":
    print(pages().to_yaml(), end="")
