"""Chain throughput: records/s through each keyed stage of a 3-keyed-stage chain.

In one run, alternated `--rounds` times: (a) bench/throughput.py's single-stage pipeline
(generator -> keyed count -> discarding sink) and (b) a chain of three keyed counts, one
instance each: generator -> `counts` -> `second` -> `third` -> discarding sink, keyed by
`--key-by` (default key, value: the first stage's count, key), same source, batching and window.
For every keyed stage it prints records/s into it over the steady window and as a fraction of
(a)'s median (target: each >= 80 %), and its busy ratio with records/s per busy second (its
rate were it busy all the time), also as a fraction of (a)'s.

A count emits one update per key a batch changed, so a stage downstream of a count only gets
what the one before it emits: the raw rates of the chain's later stages are bounded by their
input, and the rates per busy second are what compares their capacity with (a)'s.
Run: `make bench-chain` or `.venv/bin/python bench/chain_throughput.py`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from throughput import job, publish, ratio, steady_window

TARGET = 0.8
SOURCE = "source"
# The chain's keyed stages; the first is named as the single stage so that
# throughput.start_flowing waits on it.
CHAIN = ("counts", "second", "third")
FIELDS = ("key", "value", "n", "version")  # what a count emits, each an int
COUNT = {"kind": "aggregate", "function": "count"}


def chain_job(batch: int, keys: list[str]) -> dict[str, Any]:
    """The single-stage job's source, batching and sink around three keyed counts."""
    single = job(batch, {"backend": "memory"})
    graph: list[dict[str, Any]] = [{"name": SOURCE, "kind": "source"} | single["source"]]
    upstream = SOURCE
    for name, key in zip(CHAIN, keys, strict=True):
        graph.append({"name": name, "kind": "keyed", "input": upstream, "parallelism": 1,
                      "key_by": key, "operator": COUNT})  # fmt: skip
        upstream = name
    graph.append({"name": "sink", "kind": "sink", "input": upstream} | single["sink"])
    return {"name": "bench-chain", "graph": graph, "batching": single["batching"]}


def measure(
    spec_data: dict[str, Any], stages: list[str], warmup: float, window: float
) -> dict[str, dict[str, float]]:
    """Each keyed stage's records/s in and busy ratio over the steady window."""
    with tempfile.TemporaryDirectory() as tmp:
        before, after = steady_window(spec_data, warmup, window, Path(tmp))
    return {
        s: {
            "records_per_s": ratio(before[s], after[s], "records_in"),
            "busy": ratio(before[s], after[s], "busy"),
        }
        for s in stages
    }


def per_busy_second(stage: dict[str, float]) -> float:
    return stage["records_per_s"] / stage["busy"] if stage["busy"] else 0.0


def summarize(
    singles: list[dict[str, float]], chains: list[dict[str, dict[str, float]]], keys: list[str]
) -> dict[str, Any]:
    """Medians over the rounds; each chain stage against the single stage's."""
    rate = statistics.median(s["records_per_s"] for s in singles)
    capacity = statistics.median(per_busy_second(s) for s in singles)
    stages: dict[str, Any] = {}
    for name, key in zip(CHAIN, keys, strict=True):
        runs = [c[name] for c in chains]
        stage_rate = statistics.median(r["records_per_s"] for r in runs)
        stage_capacity = statistics.median(per_busy_second(r) for r in runs)
        stages[name] = {
            "key_by": key,
            "records_per_s": round(stage_rate),
            "fraction_of_single": round(stage_rate / rate, 3),
            "target_met": stage_rate / rate >= TARGET,
            "busy_ratio": round(statistics.median(r["busy"] for r in runs), 3),
            "records_per_busy_s": round(stage_capacity),
            "per_busy_s_fraction_of_single": round(stage_capacity / capacity, 3),
        }
    return {
        "single_records_per_s": round(rate),
        "single_busy_ratio": round(statistics.median(s["busy"] for s in singles), 3),
        "single_records_per_busy_s": round(capacity),
        "single_rounds_records_per_s": [round(s["records_per_s"]) for s in singles],
        "chain": stages,
        "chain_rounds_records_per_s": [
            {n: round(c[n]["records_per_s"]) for n in CHAIN} for c in chains
        ],
        "target_fraction": TARGET,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=65536, help="records per batch")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds before measuring")
    parser.add_argument("--window", type=float, default=20.0, help="seconds measured")
    parser.add_argument("--rounds", type=int, default=2, help="times each side is run")
    parser.add_argument(
        "--key-by", default="key,value,key", help="the three stages' key fields, comma-separated"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.rounds < 1 or args.window <= 0 or args.warmup < 0 or args.batch < 1:
        parser.error("--rounds and --batch must be >= 1, --window > 0, --warmup >= 0")
    keys = args.key_by.split(",")
    if len(keys) != len(CHAIN) or not set(keys) <= set(FIELDS):
        parser.error(f"--key-by takes {len(CHAIN)} fields of {', '.join(FIELDS)}")
    load_before = os.getloadavg()
    single_job = job(args.batch, {"backend": "memory"})
    chain = chain_job(args.batch, keys)
    singles, chains = [], []
    for _ in range(args.rounds):
        singles.append(measure(single_job, ["counts"], args.warmup, args.window)["counts"])
        chains.append(measure(chain, list(CHAIN), args.warmup, args.window))
    result = summarize(singles, chains, keys) | {
        "batch": args.batch,
        "window_s": args.window,
        "rounds": args.rounds,
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
    }
    publish(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
