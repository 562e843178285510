"""Memory and throughput of a keyed instance on RocksDB as its state grows.

The pipeline of bench/throughput.py (one generator -> one keyed count -> a discarding sink, as
fast as it goes), with `--keys` distinct keys drawn uniformly (or in order,
`--distribution sequential`: each key once per `--keys` records) and the keyed state in RocksDB
(`--block-cache-mb`, `--write-buffer-mb`), or in memory (`--state-backend memory`), for
`--records` records. Every `--every` seconds it reads the keyed instance's resident memory
from /proc (VmRSS) and the state's keys and bytes, and prints one JSON line; at the end, a
summary: the RSS once records first flow (the per-process base the operator's pod sizing
adds the cache and write buffers to, see operator/state_memory.py), the peak RSS, the state's
size at the end against the peak RSS, and records/s over the last half of the run.

Run: `.venv/bin/python bench/state_memory.py --keys 1000000 --records 20000000`.
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
from throughput import job, snapshot, start_flowing

from keyshift.operator.local_host import LocalJob
from keyshift.runtime.job import parse_job


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def keyed_pid(local: LocalJob) -> int:
    stages = local.status()["stages"]
    return int(stages[1]["instances"][0]["pid"])


def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-state-memory-") as tmp:
        state: dict[str, Any] = {"backend": args.state_backend}
        if args.state_backend == "rocksdb":
            state.update(
                path=str(Path(tmp) / "state"),
                block_cache_mb=args.block_cache_mb,
                write_buffer_mb=args.write_buffer_mb,
            )
        spec_data = job(args.batch, state)
        # No total: a job that ends would take its keyed process (and its RSS) with it.
        spec_data["source"]["config"].update(keys=args.keys, distribution=args.distribution)
        path = Path(tmp) / "job.yaml"
        path.write_text(yaml.safe_dump(spec_data))
        samples: list[dict[str, Any]] = []
        with LocalJob(parse_job(spec_data), path, log_dir=Path(tmp) / "logs") as local:
            start_flowing(local)
            pid = keyed_pid(local)
            t0 = time.monotonic()
            while True:
                counts = snapshot(local)["counts"]
                sample = {
                    "t": round(time.monotonic() - t0, 1),
                    "records": int(counts.get("records_in", 0)),
                    "state_keys": int(counts.get("state_keys", 0)),
                    "state_mb": round(counts.get("state_bytes", 0) / 2**20, 1),
                    "rss_mb": round(rss_mb(pid), 1),
                }
                samples.append(sample)
                print(json.dumps(sample), flush=True)
                if sample["records"] >= args.records:
                    break
                time.sleep(args.every)
    half = samples[len(samples) // 2]
    last = samples[-1]
    rate = (last["records"] - half["records"]) / max(last["t"] - half["t"], 1e-9)
    peak = max(s["rss_mb"] for s in samples)
    return {
        "state_backend": args.state_backend,
        "keys_drawn_from": args.keys,
        "distribution": args.distribution,
        "records": last["records"],
        "block_cache_mb": args.block_cache_mb,
        "write_buffer_mb": args.write_buffer_mb,
        "base_rss_mb": samples[0]["rss_mb"],
        "peak_rss_mb": peak,
        "final_state_keys": last["state_keys"],
        "final_state_mb": last["state_mb"],
        "state_to_peak_rss": round(last["state_mb"] / peak, 2),
        "records_per_s_second_half": round(rate),
        "seconds": last["t"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--records", type=int, default=20_000_000)
    parser.add_argument("--distribution", choices=["uniform", "sequential"], default="uniform")
    parser.add_argument("--state-backend", choices=["memory", "rocksdb"], default="rocksdb")
    parser.add_argument("--block-cache-mb", type=int, default=64)
    parser.add_argument("--write-buffer-mb", type=int, default=16)
    parser.add_argument("--batch", type=int, default=65536)
    parser.add_argument("--every", type=float, default=2.0, help="seconds between samples")
    result = run(parser.parse_args())
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
