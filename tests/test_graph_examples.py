"""examples/pages.yaml (a job written as a graph), examples/regions.yaml (two keyed stages),
examples/busy_users.yaml (a filter before the sink) and examples/user_regions.yaml (two sinks)
and their Python twins examples/pages_pipeline.py, examples/regions_pipeline.py,
examples/busy_users_pipeline.py and examples/user_regions_pipeline.py build one job each, and
each job runs through real processes to the output an independent computation over the same
generated records gives (each sink's, for the job of two)."""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from examples import busy_users, pages, regions
from examples.busy_users_pipeline import busy_users as busy_users_pipeline
from examples.pages_pipeline import pages as pages_pipeline
from examples.regions_pipeline import regions as regions_pipeline
from examples.user_regions_pipeline import user_regions as user_regions_pipeline
from keyshift.runtime.job import load_job, parse_job
from keyshift.runtime.pipeline import Dataflow
from tests import pipeline_fns
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


def run_example(tmp_path: Path, name: str, twin: Callable[[], Dataflow], origin: str) -> Path:
    """Run examples/`name`.yaml, or its Python twin, bounded; its output log."""
    if origin == "yaml":
        job = yaml.safe_load((REPO / "examples" / f"{name}.yaml").read_text())
    else:
        job = twin().to_dict()
    out = tmp_path / "out"
    run_to_end(tmp_path, bounded(job, out))
    return out


def clicks_per_user(job_file: str) -> dict[int, int]:
    """The clicks of each user an example's source makes (bounded: `TOTAL` of them)."""
    job = yaml.safe_load((REPO / "examples" / job_file).read_text())
    made = next(s for s in job["graph"] if s["name"] == "clicks")["config"]
    source = {k: v for k, v in made.items() if k != "profile"} | {"total": TOTAL}
    clicks: dict[int, int] = defaultdict(int)
    for _, _, key, _ in generated(source, parallelism=1):
        clicks[key] += 1
    return clicks


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


def test_the_two_keyed_stage_twin_builds_its_job_file() -> None:
    expected = load_job(REPO / "examples" / "regions.yaml")
    assert regions_pipeline().build() == expected
    assert [s.stage.name for s in expected.keyed_stages()] == ["per-user", "per-region"]


@pytest.mark.live
@pytest.mark.parametrize("origin", ["yaml", "python"])
def test_the_two_keyed_stage_example_equals_independent_truth(tmp_path: Path, origin: str) -> None:
    """The busiest user's clicks per region, after every click went through both stages."""
    out = run_example(tmp_path, "regions", regions_pipeline, origin)
    clicks = clicks_per_user("regions.yaml")
    truth: dict[int, int] = defaultdict(int)
    for user, count in clicks.items():
        region = regions.to_region({"key": user, "value": count})["region"]
        truth[region] = max(truth[region], count)
    assert final_values(out) == truth


def test_the_two_sink_twin_builds_its_job_file() -> None:
    expected = load_job(REPO / "examples" / "user_regions.yaml")
    assert user_regions_pipeline().build() == expected
    assert [s.name for s in expected.sinks()] == ["users", "regions"]
    assert {s.name: expected.sink_inputs(s.name) for s in expected.sinks()} == {
        "users": ("per-user",),
        "regions": ("per-region",),
    }


@pytest.mark.live
@pytest.mark.parametrize("origin", ["yaml", "python"])
def test_the_two_sink_example_writes_each_sinks_truth(tmp_path: Path, origin: str) -> None:
    """The sink `users` has every user's click count; the sink `regions` the busiest user's
    clicks per region, each in its own log."""
    if origin == "yaml":
        job = yaml.safe_load((REPO / "examples" / "user_regions.yaml").read_text())
    else:
        job = user_regions_pipeline().to_dict()
    stages = {stage["name"]: stage for stage in job["graph"]}
    stages["clicks"]["config"].pop("profile")
    stages["clicks"]["config"]["total"] = TOTAL
    for sink in ("users", "regions"):
        stages[sink]["config"]["path"] = str(tmp_path / sink)
    run_to_end(tmp_path, job | {"batching": dict(BATCHING)})
    clicks = clicks_per_user("user_regions.yaml")
    truth: dict[int, int] = defaultdict(int)
    for user, count in clicks.items():
        region = regions.to_region({"key": user, "value": count})["region"]
        truth[region] = max(truth[region], count)
    assert final_values(tmp_path / "users") == clicks
    assert final_values(tmp_path / "regions") == truth


def test_the_filter_before_the_sink_twin_builds_its_job_file() -> None:
    expected = load_job(REPO / "examples" / "busy_users.yaml")
    assert busy_users_pipeline().build() == expected
    (step,) = expected.keyed_stages()
    assert [r.target for r in step.outputs] == ["out"]


@pytest.mark.live
@pytest.mark.parametrize("origin", ["yaml", "python"])
def test_the_filter_before_the_sink_example_equals_independent_truth(
    tmp_path: Path, origin: str
) -> None:
    """Every busy user's click count, and no other user's."""
    out = run_example(tmp_path, "busy_users", busy_users_pipeline, origin)
    clicks = clicks_per_user("busy_users.yaml")
    truth = {user: n for user, n in clicks.items() if busy_users.busy({"value": n})}
    assert truth and len(truth) < len(clicks)
    assert final_values(out) == truth


@pytest.mark.live
def test_a_flat_map_before_a_keyed_stage_runs_chained_in_the_source(tmp_path: Path) -> None:
    """clicks -> twice (flat_map: none, or two records) -> per-key (count) -> out."""
    config = {"kind": "generator", "keys": 500, "seed": 9, "total": 20_000}
    out = tmp_path / "out"
    job = {
        "name": "twice",
        "graph": [
            {"name": "clicks", "kind": "source", "config": config},
            {"name": "twice", "kind": "flat_map", "input": "clicks",
             "function": "tests.pipeline_fns:twice"},
            {"name": "per-key", "kind": "keyed", "input": "twice", "key_by": "key",
             "parallelism": 2},
            {"name": "out", "kind": "sink", "input": "per-key",
             "config": {"kind": "log", "path": str(out), "format": "jsonl"}},
        ],
        "batching": dict(BATCHING),
    }  # fmt: skip
    run_to_end(tmp_path, job)
    truth: dict[int, int] = defaultdict(int)
    for _, _, key, value in generated(config, parallelism=1):
        for made in pipeline_fns.twice({"key": key, "value": value}):
            truth[made["key"]] += 1
    assert final_values(out) == truth
