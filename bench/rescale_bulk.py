"""Bulk state transfer benchmark: a live hot-first rescale 1 -> 2 of a large keyed count, on the
RocksDB and on the memory state backend, under load.

One generator instance (uniform keys, so that the state grows to `--keys` keys quickly, or
`--distribution sequential`: each key once, so a fill of `--keys` records builds them all) -> a
keyed `count` (or, with `--padded`, a count beside a 4 KiB pad per key,
`tests.job_fns:padded_count`: wide state, so a few GB take a million keys) -> one sink (no
output log: the sink only measures latency). The source runs a
step profile: `--fill-rate` records/s for `--fill` seconds, which builds the state, then
`--rate` records/s, the load during the rescale (with sequential keys the run first waits until
the state holds every key). After the fill and `--settle` seconds, a
steady window of `--steady` seconds, then a live hot-first rescale 1 -> 2 (this script plays
the host, as bench/rescale.py does, whose probe and rescale helpers it reuses), then
`--steady` seconds more and a drain.

Reported per backend and round: state keys and MB at the rescale's start (the keyed
instance's own estimate: RocksDB's live data size plus memtables, or the memory store's
arrays), bytes moved (state chunks on the wire: SST files for RocksDB, Arrow IPC for memory,
plus fetch replies), the rescale's duration, MB/s over the whole rescale and from the moment
the new instance had started, MB/s at each end as the instances report it (bytes / the time
each end spent moving), and the sink's p50/p99/max latency in the steady window and in the
rescale window [start, end + 1 s]. Target (issue #18): state moves at >= 100 MB/s; issue #17
asks for >= 2 GB of RocksDB state.

Run: `.venv/bin/python bench/rescale_bulk.py` (about 4 minutes with the defaults). Writes
bench/reports/rescale_bulk.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rescale import (
    TARGET_MB_PER_S,
    WINDOW_TAIL,
    Probe,
    ScheduleLag,
    job,
    keyed_stats,
    rescale,
    say,
    start_job,
    wait_flowing,
    window_stats,
)

from keyshift.operator.local_host import COORDINATOR_SERVICE
from keyshift.runtime.transport import JsonClient

BACKENDS = ("rocksdb", "memory")
DRAIN_TIMEOUT = 120.0
FILL_TIMEOUT = 1800.0


def bulk_job(backend: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    spec = job(args.keys, args.rate, None, distribution=args.distribution)
    spec["name"] = "bench-bulk"
    if args.padded:
        spec["keyed"]["operator"] = {"kind": "process", "function": "tests.job_fns:padded_count"}
    spec["source"]["config"]["profile"] = {
        "kind": "step",
        "rate": args.fill_rate,
        "to": args.rate,
        "at": args.fill,
    }
    if backend == "rocksdb":
        spec["keyed"]["state"] = {
            "backend": "rocksdb",
            "path": str(work / "state"),
            "block_cache_mb": args.block_cache_mb,
            "write_buffer_mb": 64,
        }
    return spec


def run_backend(backend: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"bulk-{backend}-", dir=root))
    with start_job(bulk_job(backend, args, work), work) as local:
        local.start()
        began = time.time()
        probe = Probe(local, began)
        wait_flowing(probe)
        if args.distribution == "sequential":
            # Every key is built once its record is in, however long the fill takes here.
            probe.until(
                lambda s: sum(i.get("state_keys", 0) for i in keyed_stats(s).values()) >= args.keys,
                FILL_TIMEOUT,
                f"{args.keys:,} keys in the state",
            )
        probe.run_for(max(0.0, args.fill + args.settle - (time.time() - began)))
        steady_start = time.time()
        probe.run_for(args.steady)
        steady_end = time.time()
        state = keyed_stats(probe.status)[0]
        say(
            f"{backend}: {state.get('state_keys', 0):,} keys, "
            f"{state.get('state_bytes', 0) / 1e6:,.0f} MB of state; rescaling 1 -> 2"
        )
        client = JsonClient(local.address, COORDINATOR_SERVICE, local.security)
        try:
            options = {"chunk_keys": args.chunk_keys} if args.chunk_keys else None
            moved = rescale(probe, client, 2, "hot-first", options)
        finally:
            client.close()
        probe.run_for(args.steady)
        lag = ScheduleLag(probe, args.rate, (steady_start, steady_end), time.time())
        result = moved.pop("result")
        report = {
            "backend": backend,
            "load_average_at_rescale": [round(x, 2) for x in os.getloadavg()],
            **moved,
            "mb_per_s_by_end": result.get("mb_per_s"),
            "steady": window_stats(probe, lag, steady_start, steady_end),
            "rescale_window": window_stats(
                probe, lag, began + moved["start"], began + moved["end"] + WINDOW_TAIL
            ),
        }
        local.drain()
        probe.until(lambda s: s["phase"] == "finished", DRAIN_TIMEOUT, "the drain")
        return report


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--keys", type=int, default=4_000_000, help="distinct keys")
    parser.add_argument(
        "--distribution",
        choices=["uniform", "sequential"],
        default="uniform",
        help="sequential: each key once per --keys records (a fill of --keys records builds them"
        " all)",
    )
    parser.add_argument("--fill-rate", type=float, default=400_000, help="records/s while filling")
    parser.add_argument("--fill", type=float, default=30.0, help="seconds of filling")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds after the fill")
    parser.add_argument("--rate", type=float, default=50_000, help="records/s from then on")
    parser.add_argument("--steady", type=float, default=10.0, help="steady window seconds")
    parser.add_argument("--block-cache-mb", type=int, default=256)
    parser.add_argument("--padded", action="store_true", help="4 KiB of state per key")
    parser.add_argument(
        "--chunk-keys", type=int, help="keys per state chunk (hot-first's default: 32,768)"
    )
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma list")
    parser.add_argument("--rounds", type=int, default=1, help="runs per backend, alternated")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "reports")
    args = parser.parse_args()
    if args.padded:
        # The job names tests.job_fns, which this process imports to check the job (appended:
        # the repository's folders must not shadow the standard library's `operator`); the
        # instances find it from the repository root, where this is run.
        sys.path.append(str(Path(__file__).resolve().parents[1]))
    backends = [b for b in args.backends.split(",") if b]
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        parser.error(f"unknown backends {sorted(unknown)}; choose from {BACKENDS}")
    reports: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-bulk-") as root:
        for round_ in range(args.rounds):
            for backend in backends:
                report = run_backend(backend, args, Path(root))
                report["round"] = round_ + 1
                reports.append(report)
                steady, window = report["steady"], report["rescale_window"]
                say(
                    f"{backend} round {round_ + 1}: {report['state_mb_at_start']:,.0f} MB "
                    f"({report['state_keys_at_start']:,} keys), moved {report['mb_moved']} MB "
                    f"in {report['duration_s']} s = {report['mb_per_s']} MB/s "
                    f"({report['mb_per_s_after_instances_start']} MB/s after the instance "
                    f"started; by end {report['mb_per_s_by_end']}); steady p99 "
                    f"{steady['p99_ms']} ms; rescale p99 {window['p99_ms']} / max "
                    f"{window['max_ms']} ms; {report['phase']}"
                )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "rescale_bulk.json"
    settings = {k: v for k, v in vars(args).items() if k != "out_dir"}
    out.write_text(json.dumps({"settings": settings, "runs": reports}, indent=1, default=str))
    met = all(r["mb_per_s"] and r["mb_per_s"] >= TARGET_MB_PER_S for r in reports)
    say(f"target >= {TARGET_MB_PER_S:.0f} MB/s over the rescale: {'met' if met else 'not met'}")
    say(f"wrote {out}")
    return 0 if all(r["phase"] == "done" for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
