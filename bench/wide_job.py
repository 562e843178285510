"""Wide-job benchmark: a job wider than gRPC's old 64-thread pools, and what each instance costs.

One generator instance (a constant rate) -> a keyed `count` of `--keyed` instances (80 by
default) -> one sink writing Parquet, run by the local host (keyshift.operator.local_host.LocalJob)
on loopback. Every keyed instance holds a command stream on the coordinator and a data stream into
the sink, so the coordinator and the sink each serve more long-lived streams than the old fixed
pool of 64 threads had. Measured:

- seconds from starting the processes until every instance has registered (phase `running`);
- each instance process's memory once the job runs: RSS, and USS (the memory only that process
  holds: what one more instance adds, since the shared libraries' pages are shared between them)
  and PSS (its share of everything), from /proc via psutil; the coordinator's apart;
- after `--run` seconds of records, seconds from the drain request until the job has finished;
- that the output counts every record the source emitted exactly once (Σ n == emitted).

Run: `.venv/bin/python bench/wide_job.py` (`--keyed 40` for a job that fits the old pools).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

from keyshift.operator.local_host import LocalJob
from keyshift.runtime.job import parse_job
from keyshift.runtime.output_log import OutputLogReader

MB = 1 << 20


def job(keyed: int, rate: float, out: Path) -> dict[str, Any]:
    return {
        "name": "wide",
        "source": {
            "parallelism": 1,
            "config": {
                "kind": "generator",
                "keys": 20_000,
                "distribution": "zipf",
                "profile": {"kind": "constant", "rate": rate},
            },
        },
        "keyed": {"name": "counts", "parallelism": keyed},
        "sink": {"config": {"kind": "log", "path": str(out), "format": "parquet"}},
        "batching": {"max_records": 2048, "linger_ms": 20, "credits": 4},
    }


def wait_phase(local: LocalJob, phases: set[str], timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        local.check_children(expect_exit=False)
        status = local.status()
        if status["phase"] in phases:
            return status
        if status["phase"] == "failed" or time.monotonic() > deadline:
            raise SystemExit(f"job is {status['phase']}, not {phases}: {status['errors']}")
        time.sleep(0.2)


def memory(pid: int) -> dict[str, float]:
    info = psutil.Process(pid).memory_full_info()
    return {"rss": info.rss / MB, "uss": info.uss / MB, "pss": info.pss / MB}


def summary(values: list[float]) -> dict[str, float]:
    return {
        "mean": round(statistics.fmean(values), 1),
        "min": round(min(values), 1),
        "max": round(max(values), 1),
        "total": round(sum(values), 1),
    }


def measure(keyed: int, rate: float, run: float, register_timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-wide-") as tmp:
        out = Path(tmp) / "out"
        data = job(keyed, rate, out)
        path = Path(tmp) / "job.yaml"
        path.write_text(yaml.safe_dump(data))
        started = time.monotonic()
        with LocalJob(
            parse_job(data), path, log_dir=Path(tmp) / "logs", register_timeout=register_timeout
        ) as local:
            local.start()
            wait_phase(local, {"running"}, register_timeout)
            registered = time.monotonic() - started
            time.sleep(run)
            instances = [memory(child.pid) for child in local.instances.values()]
            coordinator = local.coordinator
            assert coordinator is not None
            coordinator_memory = memory(coordinator.pid)
            drain_started = time.monotonic()
            local.drain()
            status = wait_phase(local, {"finished"}, 120.0)
            drained = time.monotonic() - drain_started
        emitted = sum(
            int(i["stats"]["emitted"]) for s in status["stages"] if s["name"] == "source"
            for i in s["instances"]
        )  # fmt: skip
        counted = sum(OutputLogReader(out).read_all().column("n").to_pylist())
    return {
        "instances": len(instances),
        "keyed": keyed,
        "seconds_to_register": round(registered, 1),
        "seconds_to_drain": round(drained, 1),
        "instance_rss_mb": summary([m["rss"] for m in instances]),
        "instance_uss_mb": summary([m["uss"] for m in instances]),
        "instance_pss_mb": summary([m["pss"] for m in instances]),
        "coordinator_mb": {k: round(v, 1) for k, v in coordinator_memory.items()},
        "records_emitted": emitted,
        "records_counted": counted,
        "exactly_once": emitted == counted,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keyed", type=int, default=80, help="keyed instances")
    parser.add_argument("--rate", type=float, default=20_000, help="source records/s")
    parser.add_argument("--run", type=float, default=10.0, help="seconds of records")
    parser.add_argument("--register-timeout", type=float, default=180.0)
    args = parser.parse_args()
    result = measure(args.keyed, args.rate, args.run, args.register_timeout)
    print(json.dumps(result, indent=2))
    return 0 if result["exactly_once"] else 1


if __name__ == "__main__":
    sys.exit(main())
