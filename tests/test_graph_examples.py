"""examples/pages.yaml (a job written as a graph) and its Python twin examples/pages_pipeline.py
build one job, and that job runs through real processes to the output an independent
computation over the same generated records gives."""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import yaml

from examples import pages
from examples.pages_pipeline import pages as pages_pipeline
from keyshift.runtime.job import load_job, parse_job
from tests.conftest import BATCHING
from tests.test_end_to_end import final_values, generated, run_to_end

REPO = Path(__file__).resolve().parent.parent
TOTAL = 40_000


def test_the_python_twin_builds_the_job_file() -> None:
    expected = load_job(REPO / "examples" / "pages.yaml")
    assert pages_pipeline().build() == expected
    run = subprocess.run(
        [sys.executable, "-m", "examples.pages_pipeline"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert parse_job(yaml.safe_load(run.stdout)) == expected


def bounded(job: dict[str, Any], out: Path) -> dict[str, Any]:
    """The example with a finite source and its output in `out`, otherwise unchanged (the
    stages are changed in place)."""
    stages = {stage["name"]: stage for stage in job["graph"]}
    config = stages["clicks"]["config"]
    config.pop("profile")
    config["total"] = TOTAL
    stages["out"]["config"]["path"] = str(out)
    return job | {"batching": dict(BATCHING)}


@pytest.mark.live
@pytest.mark.parametrize("origin", ["yaml", "python"])
def test_the_example_graph_equals_independent_truth(tmp_path: Path, origin: str) -> None:
    if origin == "yaml":
        job = yaml.safe_load((REPO / "examples" / "pages.yaml").read_text())
    else:
        job = pages_pipeline().to_dict()
    out = tmp_path / "out"
    run_to_end(tmp_path, bounded(job, out))

    source = next(s for s in job["graph"] if s["name"] == "clicks")["config"]
    truth: dict[int, float] = defaultdict(float)
    for _, _, key, value in generated(source, parallelism=1):
        view = pages.to_view({"key": key, "value": value})
        if pages.lasted(view):
            truth[view["page"]] += view["seconds"]
    got = final_values(out)
    assert got.keys() == truth.keys()
    for page, seconds in truth.items():
        assert got[page] == pytest.approx(seconds, rel=1e-9), page
