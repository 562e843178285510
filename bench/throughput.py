"""Throughput benchmark: a keyed running count over the real gRPC hop.

1,000,000 distinct keys, Zipf 1.0, one generator instance -> one keyed instance -> a discarding
sink, as fast as the pipeline takes. Prints records/s through the keyed instance over a steady
window, and, measured in the same run, a plain single-process Python dict loop over the same
records, with the ratio of the two. `--state-backend rocksdb` keeps the keyed state in RocksDB
instead of memory. Run: `make bench` or `.venv/bin/python bench/throughput.py`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from keyshift.operator.local_host import LocalJob
from keyshift.runtime.generator import KeyGenerator
from keyshift.runtime.job import GeneratorSource, parse_job

TARGET = 1_500_000


def job(batch: int, state: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": "bench-throughput",
        "source": {
            "parallelism": 1,
            "config": {"kind": "generator", "keys": 1_000_000, "distribution": "zipf",
                       "zipf_exponent": 1.0, "seed": 1},
        },
        "keyed": {"name": "counts", "parallelism": 1, "operator": {"function": "count"},
                  "state": state},
        "sink": {"config": {"kind": "log", "format": "none"}},
        "batching": {"max_records": batch, "linger_ms": 20, "credits": 4},
    }  # fmt: skip


def snapshot(local: LocalJob) -> dict[str, dict[str, float]]:
    """Each stage's first instance's counters, as the coordinator last heard them."""
    return {s["name"]: s["instances"][0]["stats"] for s in local.status()["stages"]}


def ratio(before: dict[str, float], after: dict[str, float], key: str) -> float:
    return (after.get(key, 0) - before.get(key, 0)) / (after["time"] - before["time"])


def start_flowing(local: LocalJob) -> None:
    """Start the job and wait until records reach the keyed instance."""
    local.start()
    deadline = time.monotonic() + 60
    while local.status()["phase"] != "running" or not snapshot(local)["counts"].get("records_in"):
        if time.monotonic() > deadline:
            raise RuntimeError("no records reached the keyed instance within 60 s")
        time.sleep(0.2)


def steady_window(
    spec_data: dict[str, Any], warmup: float, window: float, tmp: Path
) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """Run the job in `tmp` and return every stage's counters before and after the window."""
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(spec_data))
    with LocalJob(parse_job(spec_data), path, log_dir=tmp / "logs") as local:
        start_flowing(local)
        time.sleep(warmup)
        before = snapshot(local)
        time.sleep(window)
        return before, snapshot(local)


def measure_pipeline(batch: int, warmup: float, window: float, backend: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        state = {"backend": backend} if backend == "memory" else {"backend": backend, "path": tmp}
        before, after = steady_window(job(batch, state), warmup, window, Path(tmp))
    return {
        "records_per_s": ratio(before["counts"], after["counts"], "records_in"),
        "keyed_busy": ratio(before["counts"], after["counts"], "busy"),
        "keyed_idle": ratio(before["counts"], after["counts"], "idle"),
        "source_busy": ratio(before["source"], after["source"], "busy"),
        "source_backpressured": ratio(before["source"], after["source"], "backpressured"),
        "state_keys": after["counts"].get("state_keys", 0),
    }


def measure_dict_loop(records: int) -> float:
    """The same records counted one at a time in a plain dict, in this process."""
    config = GeneratorSource(keys=1_000_000, distribution="zipf", zipf_exponent=1.0, seed=1)
    keys = KeyGenerator(config, 0).records(0, records)[0].tolist()
    counts: dict[int, int] = {}
    get = counts.get
    start = time.perf_counter()
    for key in keys:
        counts[key] = get(key, 0) + 1
    return records / (time.perf_counter() - start)


def publish(result: dict[str, Any], json_path: Path | None) -> None:
    """Print a benchmark's result, and write it to `json_path` when one is given."""
    text = json.dumps(result, indent=2)
    print(text)
    if json_path:
        json_path.write_text(text + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=65536, help="records per batch")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds before measuring")
    parser.add_argument("--window", type=float, default=20.0, help="seconds measured")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--state-backend", choices=["memory", "rocksdb"], default="memory")
    args = parser.parse_args()
    pipeline = measure_pipeline(args.batch, args.warmup, args.window, args.state_backend)
    baseline = measure_dict_loop(5_000_000)
    result = {
        "keyed_records_per_s": round(pipeline["records_per_s"]),
        "dict_loop_records_per_s": round(baseline),
        "ratio_to_dict_loop": round(pipeline["records_per_s"] / baseline, 3),
        "target_records_per_s": TARGET,
        "target_met": pipeline["records_per_s"] >= TARGET,
        "keyed_busy_ratio": round(pipeline["keyed_busy"], 3),
        "keyed_idle_ratio": round(pipeline["keyed_idle"], 3),
        "source_busy_ratio": round(pipeline["source_busy"], 3),
        "source_backpressured_ratio": round(pipeline["source_backpressured"], 3),
        "state_keys": pipeline["state_keys"],
        "batch": args.batch,
        "window_s": args.window,
        "state_backend": args.state_backend,
    }
    publish(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
