"""Join throughput: NEXMark events/s through Q8 (a window join) and the early-bids interval join,
against Q7 (an event-time window with a reduce) in the same run.

Each query is its example job (examples/nexmark/) with the source at full speed (no profile,
no total), one instance per stage and a discarding sink; rounds alternate the queries. Over a
steady window after a warm-up it prints events/s out of the source (what the query takes in:
its filters run chained in the source), records/s into the keyed stage and that stage's busy
ratio; medians over the rounds, and each join's events/s as a fraction of Q7's. Issue #16's
target: a join query >= 250,000 events/s through one instance per stage.

Run from the repository root (the jobs import examples/): `.venv/bin/python bench/joins.py`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from throughput import publish, ratio, snapshot

from keyshift.operator.local_host import LocalJob
from keyshift.runtime.job import parse_job

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the queries' functions: examples/nexmark/queries.py
TARGET = 250_000
QUERIES = {"q7": "q7", "q8": "q8", "early_bids": "early-bids"}  # job file -> keyed stage


def job(query: str) -> dict[str, Any]:
    """The query's example at full speed, one instance per stage, its output discarded."""
    data: dict[str, Any] = yaml.safe_load(
        (REPO / "examples" / "nexmark" / f"{query}.yaml").read_text()
    )
    for stage in data["graph"]:
        stage["parallelism"] = 1
        if stage["kind"] == "source":
            stage["config"].pop("profile", None)
        if stage["kind"] == "sink":
            stage["config"] = {"kind": "log", "format": "none"}
    return data


def measure(query: str, warmup: float, window: float) -> dict[str, float]:
    data, keyed = job(query), QUERIES[query]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.yaml"
        path.write_text(yaml.safe_dump(data))
        with LocalJob(parse_job(data), path, log_dir=Path(tmp) / "logs") as local:
            local.start()
            deadline = time.monotonic() + 60
            while local.status()["phase"] != "running" or not snapshot(local)[keyed].get(
                "records_in"
            ):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{query}: no records reached {keyed} within 60 s")
                time.sleep(0.2)
            time.sleep(warmup)
            before = snapshot(local)
            time.sleep(window)
            after = snapshot(local)
    return {
        "events_per_s": ratio(before["events"], after["events"], "emitted"),
        "keyed_records_per_s": ratio(before[keyed], after[keyed], "records_in"),
        "keyed_busy": ratio(before[keyed], after[keyed], "busy"),
        "source_busy": ratio(before["events"], after["events"], "busy"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds before measuring")
    parser.add_argument("--window", type=float, default=10.0, help="seconds measured")
    parser.add_argument("--rounds", type=int, default=2, help="times each query is run")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.rounds < 1 or args.window <= 0 or args.warmup < 0:
        parser.error("--rounds must be >= 1, --window > 0, --warmup >= 0")
    load_before = os.getloadavg()
    runs: dict[str, list[dict[str, float]]] = {q: [] for q in QUERIES}
    for _ in range(args.rounds):
        for query in QUERIES:
            runs[query].append(measure(query, args.warmup, args.window))
    medians = {
        q: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]}
        for q, rs in runs.items()
    }
    q7 = medians["q7"]["events_per_s"]
    rates = {q: [round(r["events_per_s"]) for r in rs] for q, rs in runs.items()}
    result = {
        "queries": medians,
        "rounds_events_per_s": rates,
        "fraction_of_q7": {q: round(m["events_per_s"] / q7, 3) for q, m in medians.items()},
        "target_events_per_s": TARGET,
        "target_met": {q: medians[q]["events_per_s"] >= TARGET for q in ("q8", "early_bids")},
        # The machine is shared: its load average (1 min) before and after the run.
        "load": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "rounds": args.rounds,
        "window_s": args.window,
    }
    publish(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
