"""DS2 on a live graph: how it follows a load step on a chain of two keyed stages.

The job of tests/test_autoscaling_live.py's moving-bottleneck test (`moving_bottleneck`, with a
25 s phase 2), run with `keyshift run` and the embedded metrics source (the instances scraped
directly): generator -> `first` (track) ->
`second` (nest) -> log sink, each keyed stage at one instance. Per-record costs
(tests/job_fns.py: COSTS, a wait counted as busy time) make `first` the bottleneck in phase 1
(900 records/s) and `second` in phase 2 (1,100 records/s, from the source's PHASE_SEQ-th
record on). Autoscaler: interval 1 s, metrics window 5 s, warm-up 4 s, activation 3 ticks.

Reported per run, from the run's decisions log and its rescale lines:

- decisions to converge: after the job starts and after the step, the most rescales any keyed
  stage made in that phase (target <= 2, as in the DS2 paper);
- time from the step to every stage at its final parallelism: from the first tick that saw the
  step (the source's offered rate at phase 2's; up to one interval after it) to the end of the
  last rescale decided after it (its decision's time plus the durations of the rescales that
  tick started, run one after another);
- reversals: rescales of a stage opposite to its previous one in the same phase (target 0);
- the final parallelism of each stage, and the machine's load average before and after;
- in the JSON report, each rescale's decision (its reason, with the rates it used).

Run: `.venv/bin/python bench/ds2_graph.py [--runs N]` (about a minute a run). Writes
bench/reports/ds2_graph.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the job's functions live in tests/job_fns.py

from tests.test_autoscaling_live import PHASE_RATES, moving_bottleneck  # noqa: E402

PHASE_2_SECONDS = 25
KEYED = ("first", "second")
RESCALE_LINE = re.compile(r"rescale \d+ of (\S+) (\d+)->(\d+) \(\S+\): done after ([\d.]+) s")


def run_once(workdir: Path) -> dict[str, Any]:
    path = workdir / "job.yaml"
    path.write_text(yaml.safe_dump(moving_bottleneck(workdir / "out", None, PHASE_2_SECONDS)))
    logs = workdir / "logs"
    load_before = os.getloadavg()
    done = subprocess.run(
        [str(REPO / ".venv/bin/keyshift"), "run", str(path), "--no-view", "--log-dir", str(logs)],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"keyshift run failed:\n{done.stdout}\n{done.stderr}")
    lines = (logs / "decisions.jsonl").read_text().splitlines()
    decisions = [d for line in lines if "stage" in (d := json.loads(line))]
    durations = [
        (m[1], int(m[2]), int(m[3]), float(m[4])) for m in RESCALE_LINE.finditer(done.stdout)
    ]
    return score(decisions, durations) | {
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
    }


def score(
    decisions: list[dict[str, Any]], durations: list[tuple[str, int, int, float]]
) -> dict[str, Any]:
    start = decisions[0]["at"]
    step = next(
        d["at"] for d in decisions
        if d["stage"] == "clicks" and d["inputs"].get("offered_rate", 0) >= PHASE_RATES[1]
    )  # fmt: skip
    acted = [d for d in decisions if d["action"] != "hold" and d["stage"] in KEYED]
    phases = {
        "start": [d for d in acted if d["at"] < step],
        "step": [d for d in acted if d["at"] >= step],
    }
    result: dict[str, Any] = {"step_after_start_s": round(step - start, 1)}
    for phase, made in phases.items():
        per_stage = {s: [(d["from"], d["to"]) for d in made if d["stage"] == s] for s in KEYED}
        result[f"decisions_{phase}"] = max(len(v) for v in per_stage.values())
        result[f"reversals_{phase}"] = sum(
            (a[1] > a[0]) != (b[1] > b[0])
            for v in per_stage.values()
            for a, b in itertools.pairwise(v)
        )
        result[f"rescales_{phase}"] = per_stage
    after = phases["step"]
    if after:
        last = max(d["at"] for d in after)
        moves = [(d["stage"], d["from"], d["to"]) for d in after if d["at"] == last]
        took = sum(next(s for st, a, b, s in durations if (st, a, b) == m) for m in moves)
        result["step_to_final_s"] = round(last + took - step, 1)
    final = {s: 1 for s in KEYED} | {d["stage"]: d["to"] for d in acted}
    result["final"] = final
    # What each rescale was decided on, to explain a run whose result differs.
    result["acted"] = [
        {"after_start_s": round(d["at"] - start, 1), "reason": d["reason"]} for d in acted
    ]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    runs = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="ds2-graph-") as tmp:
            runs.append(run_once(Path(tmp)))
        print(f"run {i + 1}: {json.dumps(runs[-1])}", flush=True)
    report = REPO / "bench" / "reports" / "ds2_graph.json"
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps(runs, indent=2))
    header = "| run | decisions (start · step) | step → final | reversals | final | load avg |"
    print(header)
    print("|---|---|---|---|---|---|")
    for i, r in enumerate(runs, 1):
        final = ", ".join(f"{s} {n}" for s, n in r["final"].items())
        print(f"| {i} | {r['decisions_start']} · {r['decisions_step']} | "
              f"{r.get('step_to_final_s', '—')} s | {r['reversals_start'] + r['reversals_step']} | "
              f"{final} | {r['load_before'][0]} / {r['load_after'][0]} |")  # fmt: skip


if __name__ == "__main__":
    main()
