"""bench/nexmark.py runs end to end in seconds (Q3 at full speed, then its latency through
one live hot-first rescale; the numbers are not judged here), and refuses bad arguments before
it starts anything."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench" / "nexmark.py"


def run_bench(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH), *args],
        cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


@pytest.mark.live
def test_the_nexmark_bench_runs_end_to_end(tmp_path: Path) -> None:
    done = run_bench(
        # Q3's join emits as its matches come: a windowed query (Q8) may fire no window within
        # a short steady window on a loaded machine, and give no latency to measure.
        "--queries", "q3", "--latency-queries", "q3", "--strategies", "hot-first",
        "--warmup", "1", "--window", "2", "--steady", "3", "--rounds", "1",
        "--out-dir", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "nexmark.json").read_text())
    assert set(result["throughput"]) == {"q3"}
    for query in result["throughput"].values():
        assert query["events_per_s"] > 0
        assert query["usage_last_round"]["events/0"]["busy"] > 0
    (run,) = result["latency"]
    assert (run["query"], run["stage"], run["strategy"]) == ("q3", "q3", "hot-first")
    assert run["rescale"]["phase"] == "done"
    assert run["steady"]["latency_samples"] > 0 and run["rescale"]["latency_samples"] > 0
    assert run["p99_ratio"] is not None
    assert result["generator_alone_events_per_s"] > 0
    assert (tmp_path / "nexmark.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--queries", "q0,q9"], "unknown queries ['q9']"),
        (["--strategies", "lazy"], "unknown strategies ['lazy']"),
        (["--queries", "q0", "--latency-queries", "q5"], "latency queries ['q5'] need"),
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["--window", "0"], "--window and --steady > 0"),
        (["--baseline", "no-such-rev"], "--baseline 'no-such-rev' is not a commit"),
    ],
)
def test_bad_arguments_are_refused_with_a_reason(
    tmp_path: Path, args: list[str], says: str
) -> None:
    done = run_bench(*args, "--out-dir", str(tmp_path / "out"), timeout=60)
    assert done.returncode == 2
    assert says in done.stderr
    assert not (tmp_path / "out").exists()
