"""Hand-over from checkpoints (Rhino) against a direct transfer: a live rescale 1 -> 2 of a
checkpointed keyed count of ~1 M keys under load, each side in the same run, alternated,
`--rounds` times each.

One generator instance (uniform keys: a fill of `--fill` seconds at `--fill-rate` records/s
builds ~`--keys` keys) -> a keyed `count` (memory state by default, `--backend rocksdb`) -> one
sink that only measures latency; checkpoints every `--interval` seconds into a local directory.
After the fill and `--settle` seconds, a steady window of `--steady` seconds; then the script
waits for the next checkpoint to complete and `--after` seconds more (the changes since the
checkpoint are what a hand-over moves at switch time: `--rate` x `--after` records' keys), and
rescales 1 -> 2 hot-first with `handover: 1` or `handover: 0` (this script plays the host, as
bench/rescale.py does, whose probe and rescale helpers it reuses); `--steady` seconds more and
a drain.

Reported per run: the state at the rescale, the bytes the switch moved (the new owner's bytes in
at switch time: chunks and fetch replies), the bytes preloaded from the checkpoint, the time from
the request to complete, and the sink's p50/p99/max latency in the steady window and in the
rescale window [request, end + 1 s]. Target (issue #18): the bytes moved at switch time with
hand-over <= 1/10 of the state moved (the bytes the direct transfer moved, mean over its runs).

Run: `.venv/bin/python bench/handover.py` (about 3 minutes with the defaults). Writes
bench/reports/handover.json.
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

from rescale import (
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

TARGET_SWITCH_SHARE = 0.1
DRAIN_TIMEOUT = 120.0
CHECKPOINT_TIMEOUT = 120.0


def handover_job(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    spec = job(args.keys, args.rate, None, distribution="uniform")
    spec["name"] = "bench-handover"
    spec["source"]["config"]["profile"] = {
        "kind": "step",
        "rate": args.fill_rate,
        "to": args.rate,
        "at": args.fill,
    }
    spec["checkpoints"] = {"interval": args.interval, "storage": str(work / "checkpoints")}
    if args.backend == "rocksdb":
        spec["keyed"]["state"] = {
            "backend": "rocksdb",
            "path": str(work / "state"),
            "block_cache_mb": 256,
            "write_buffer_mb": 64,
        }
    return spec


def completed(status: dict[str, Any]) -> int:
    return int((status.get("checkpoints") or {}).get("completed", 0))


def run_once(handover: bool, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    side = "handover" if handover else "direct"
    work = Path(tempfile.mkdtemp(prefix=f"handover-{side}-", dir=root))
    with start_job(handover_job(args, work), work) as local:
        local.start()
        began = time.time()
        probe = Probe(local, began)
        wait_flowing(probe)
        probe.run_for(max(0.0, args.fill + args.settle - (time.time() - began)))
        steady_start = time.time()
        probe.run_for(args.steady)
        steady_end = time.time()
        done = completed(probe.status)
        probe.until(lambda s: completed(s) > done, CHECKPOINT_TIMEOUT, "a checkpoint")
        probe.run_for(args.after)
        state = keyed_stats(probe.status)[0]
        say(
            f"{side}: {state.get('state_keys', 0):,} keys, "
            f"{state.get('state_bytes', 0) / 1e6:,.0f} MB of state; rescaling 1 -> 2"
        )
        client = JsonClient(local.address, COORDINATOR_SERVICE, local.security)
        try:
            moved = rescale(probe, client, 2, "hot-first", {"handover": 1 if handover else 0})
        finally:
            client.close()
        probe.run_for(args.steady)
        lag = ScheduleLag(probe, args.rate, (steady_start, steady_end), time.time())
        result = moved.pop("result")
        report = {
            "side": side,
            **moved,
            "handover": result.get("handover"),
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
    parser.add_argument("--keys", type=int, default=1_000_000, help="distinct keys")
    parser.add_argument("--fill-rate", type=float, default=400_000, help="records/s while filling")
    parser.add_argument("--fill", type=float, default=8.0, help="seconds of filling")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds after the fill")
    parser.add_argument("--rate", type=float, default=20_000, help="records/s from then on")
    parser.add_argument("--steady", type=float, default=5.0, help="steady window seconds")
    parser.add_argument("--interval", type=float, default=4.0, help="checkpoint interval (s)")
    parser.add_argument(
        "--after", type=float, default=2.0, help="seconds from a checkpoint to the rescale"
    )
    parser.add_argument("--backend", choices=["memory", "rocksdb"], default="memory")
    parser.add_argument("--rounds", type=int, default=2, help="runs per side, alternated")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "reports")
    args = parser.parse_args()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-handover-") as root:
        for round_ in range(args.rounds):
            for handover in (True, False):
                report = run_once(handover, args, Path(root))
                report["round"] = round_ + 1
                runs.append(report)
                window, ho = report["rescale_window"], report["handover"] or {}
                say(
                    f"{report['side']} round {round_ + 1}: {report['state_keys_at_start']:,} "
                    f"keys; switch moved {report['mb_moved']} MB (preloaded "
                    f"{ho.get('preloaded_bytes', 0) / 1e6:.1f} MB in "
                    f"{ho.get('preload_seconds', 0)} s); request to complete "
                    f"{report['duration_s']} s; steady p99 {report['steady']['p99_ms']} ms, "
                    f"rescale p99 {window['p99_ms']} / max {window['max_ms']} ms; "
                    f"fallback {ho.get('fallback')}; {report['phase']}"
                )
    direct = [r["bytes_moved"] for r in runs if r["side"] == "direct"]
    switch = [r["bytes_moved"] for r in runs if r["side"] == "handover"]
    share = max(switch) / statistics.mean(direct) if direct and switch else None
    met = share is not None and share <= TARGET_SWITCH_SHARE
    summary = {"switch_share_worst": share, "target": TARGET_SWITCH_SHARE, "met": met}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "handover.json"
    settings = {k: v for k, v in vars(args).items() if k != "out_dir"}
    out.write_text(json.dumps({"settings": settings, "summary": summary, "runs": runs}, indent=1))
    say(
        f"bytes at switch with hand-over / bytes a direct transfer moved: worst "
        f"{share if share is None else round(share, 4)} (target <= {TARGET_SWITCH_SHARE}): "
        f"{'met' if met else 'not met'}"
    )
    say(f"wrote {out}")
    return 0 if all(r["phase"] == "done" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
