"""Checkpoint benchmark: throughput with checkpoints every 10 s and every 1 s, as a ratio to no
checkpoints; the size of incremental checkpoints against full ones; recovery time from
`kill -9` of the keyed instance to the first output after the restore, at 1M keys, local
against global.

The pipeline of bench/throughput.py (one generator, 1,000,000 keys, Zipf 1.0 -> one keyed count
-> a discarding sink, as fast as it goes) runs without checkpoints, with a checkpoint every
10 s, with one every 1 s (to a local directory), the three alternated, `--rounds` times each.
Each run measures records/s through the keyed instance over the same steady window; a ratio
is the mean of a side's runs over the mean of the runs without checkpoints. The keyed
instance's last checkpoint says how long its loop spent on the snapshot, against the whole
checkpoint (the upload runs beside the loop). The sizes come
from the checkpoints' metadata: bytes each checkpoint wrote (its new shards) against bytes of
all the shards it names (what a full checkpoint, or a recovery, reads).

Recovery: the same pipeline (uniform keys) with a checkpoint every 2 s, a 400k records/s source
and a Parquet output log, run by
the local host (keyshift.operator.local_host.run_job, as `keyshift run` does); once the state
holds ~1M keys (950k) and a checkpoint has completed, the keyed instance gets SIGKILL. Measured: the
seconds from the kill until the job runs again (restarted from the checkpoint), until the
sink writes its first record after the restore, and until a reader sees it (the output is
published at the next completed checkpoint); and the recovery time the job itself recorded
(from the failure its coordinator noticed to running again). The recovery runs in three
modes, alternated, `--recovery-rounds` times each: `global` (`recovery: global`: the host
restarts every process), `local` (the lost instance started again alone, the source and the
sink rewound in place) and `local+standby` (the same with `standby: 1`, so the replacement is
a process started already).

`--state-backend rocksdb` runs every part on RocksDB state, whose checkpoints are native (a
checkpoint uploads the SST files the previous one did not store); `--no-recovery` leaves the
recovery part out.

Run: `make bench-checkpoints` or `.venv/bin/python bench/checkpoints.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml
from throughput import job, ratio, snapshot, start_flowing

from keyshift.operator.local_host import LocalJob, RunError, run_job
from keyshift.runtime.checkpoint_store import CheckpointStore
from keyshift.runtime.job import parse_job
from keyshift.runtime.output_log import OutputLogReader

TARGET_RATIO_AT_10S = 0.9
TARGET_RECOVERY_S = 2.0  # from kill -9 to the first output after it
RECOVERY_MODES = ("global", "local", "local+standby")


def state_settings(backend: str, tmp: str) -> dict[str, Any]:
    if backend == "memory":
        return {"backend": backend}
    return {"backend": backend, "path": str(Path(tmp) / "state")}


def measure(interval: float | None, warmup: float, window: float, backend: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-checkpoints-") as tmp:
        spec_data = job(65536, state_settings(backend, tmp))
        storage = Path(tmp) / "checkpoints"
        if interval is not None:
            spec_data["checkpoints"] = {"interval": interval, "storage": str(storage),
                                        "retain": 1000}  # fmt: skip
        path = Path(tmp) / "job.yaml"
        path.write_text(yaml.safe_dump(spec_data))
        with LocalJob(parse_job(spec_data), path, log_dir=Path(tmp) / "logs") as local:
            start_flowing(local)
            time.sleep(warmup)
            before = snapshot(local)
            time.sleep(window)
            after = snapshot(local)
            checkpoints = local.status().get("checkpoints")
            # The keyed instance's stats hold this mapping beside its counters.
            last: dict[str, Any] = after["counts"].get("checkpoint") or {}  # type: ignore[assignment]
        result: dict[str, Any] = {
            "records_per_s": ratio(before["counts"], after["counts"], "records_in"),
            "state_keys": after["counts"].get("state_keys", 0),
        }
        if interval is not None:
            store = CheckpointStore(str(storage))
            metas = [store.load(c) for c in store.completed()]
            full = [m.size() for m in metas]
            result.update(
                completed=len(metas),
                failed=(checkpoints or {}).get("failed"),
                first_written_mb=round(metas[0].written / 1e6, 1) if metas else None,
                later_written_mb=[round(m.written / 1e6, 1) for m in metas[1:6]],
                last_full_mb=round(full[-1] / 1e6, 1) if full else None,
                last_duration_s=round(
                    (checkpoints or {}).get("last_completed", {}).get("seconds", 0.0), 2
                ),
                # The keyed instance's side of its last checkpoint: the snapshot in its loop,
                # and the whole (the upload ran beside the loop).
                keyed_snapshot_s=last.get("snapshot_seconds"),
                keyed_total_s=last.get("seconds"),
            )
    return result


def measure_recovery(rate: float, backend: str, mode: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
        spec_data = job(16384, state_settings(backend, tmp))
        spec_data["recovery"] = mode.split("+")[0]
        spec_data["keyed"]["standby"] = 1 if mode.endswith("+standby") else 0
        # Uniform keys: the state reaches ~1M keys within seconds (a Zipf tail takes minutes).
        spec_data["source"]["config"].update(distribution="uniform", profile={"rate": rate})
        spec_data["sink"] = {
            "config": {
                "kind": "log",
                "path": str(Path(tmp) / "out"),
                "format": "parquet",
                "segment_records": 200_000,
            }
        }
        spec_data["checkpoints"] = {"interval": 2, "storage": str(Path(tmp) / "checkpoints")}
        path = Path(tmp) / "job.yaml"
        path.write_text(yaml.safe_dump(spec_data))
        stop = threading.Event()
        with LocalJob(parse_job(spec_data), path, log_dir=Path(tmp) / "logs") as local:
            local.start()
            runner = threading.Thread(target=lambda: _run(local, stop), daemon=True)
            runner.start()
            status = _wait(
                local,
                lambda s: (
                    _keyed(s).get("state_keys", 0) >= 950_000
                    and (s.get("checkpoints") or {}).get("completed", 0) >= 1
                ),
                300,
            )
            keys = _keyed(status)["state_keys"]
            before = (status["checkpoints"] or {})["last_completed"]
            pid = status["stages"][1]["instances"][0]["pid"]
            killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            restarted = _wait(
                local, lambda s: s.get("restored_from") is not None and s["phase"] == "running", 120
            )
            running_after = time.monotonic() - killed
            offset = _sink(restarted).get("output_offset", 0)
            _wait(local, lambda s: _sink(s).get("output_offset", 0) > offset, 120)
            first_output = time.monotonic() - killed
            # What a reader sees: the output is published at the next completed checkpoint.
            log = OutputLogReader(Path(tmp) / "out")
            _wait(local, lambda s: log.end_offset(0) > offset, 120)
            first_published = time.monotonic() - killed
            recorded = _wait(local, lambda s: (s.get("recoveries") or {}).get("last"), 30)
            last = recorded["recoveries"]["last"]
            # The host times a global restart itself; a local one is the coordinator's.
            host = local.recoveries[-1]["seconds"] if last["mode"] == "global" else None
            stop.set()
            runner.join(timeout=60)
    return {
        "mode": mode,
        "recorded_mode": last["mode"],
        "state_keys_at_kill": keys,
        "checkpoint_full_mb": round(before["full"] / 1e6, 1),
        "restored_from": restarted["restored_from"],
        "kill_to_running_s": round(running_after, 2),
        "kill_to_first_output_s": round(first_output, 2),
        "kill_to_first_published_s": round(first_published, 2),
        "host_recovery_s": round(host, 2) if host is not None else None,
        "recorded_recovery_s": round(last["seconds"], 2),
    }


def _run(local: LocalJob, stop: threading.Event) -> None:
    run_job(local, None, stop)


def _keyed(status: dict[str, Any]) -> dict[str, Any]:
    instances = status["stages"][1]["instances"]
    return dict(instances[0]["stats"]) if instances else {}


def _sink(status: dict[str, Any]) -> dict[str, Any]:
    instances = status["stages"][2]["instances"]
    return dict(instances[0]["stats"]) if instances else {}


def _wait(local: LocalJob, condition: Any, seconds: float) -> dict[str, Any]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            status = local.status()
        except Exception:  # the coordinator restarting
            status = None
        if status is not None and condition(status):
            return status
        time.sleep(0.05)
    raise RuntimeError(f"timed out after {seconds:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--window", type=float, default=20.0)
    parser.add_argument("--recovery-rate", type=float, default=400_000.0)
    parser.add_argument("--state-backend", choices=["memory", "rocksdb"], default="memory")
    parser.add_argument("--no-recovery", action="store_true", help="leave out the recovery part")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each side, alternated")
    parser.add_argument(
        "--recovery-rounds", type=int, default=2, help="recoveries of each mode, alternated"
    )
    parser.add_argument(
        "--only-recovery", action="store_true", help="leave out the throughput part"
    )
    args = parser.parse_args()
    backend = args.state_backend
    # The sides alternate, each run `--rounds` times: on a shared machine a side run once
    # measures the load of its minute as much as the checkpoints.
    runs: dict[str, list[dict[str, Any]]] = {"none": [], "every_10s": [], "every_1s": []}
    for _ in range(0 if args.only_recovery else args.rounds):
        runs["none"].append(measure(None, args.warmup, args.window, backend))
        runs["every_10s"].append(measure(10.0, args.warmup, args.window, backend))
        runs["every_1s"].append(measure(1.0, args.warmup, args.window, backend))
    recoveries: dict[str, list[dict[str, Any]]] = {mode: [] for mode in RECOVERY_MODES}
    for _ in range(0 if args.no_recovery else args.recovery_rounds):
        for mode in RECOVERY_MODES:
            try:
                recoveries[mode].append(measure_recovery(args.recovery_rate, backend, mode))
            except (RuntimeError, RunError) as exc:  # a run that did not recover is reported
                recoveries[mode].append({"mode": mode, "error": str(exc).splitlines()[0]})
    recovery = {
        mode: {
            "kill_to_first_output_s": [r.get("kill_to_first_output_s") for r in runs_],
            "target_met": all(
                r.get("kill_to_first_output_s", 1e9) <= TARGET_RECOVERY_S for r in runs_
            ),
            "runs": runs_,
        }
        for mode, runs_ in recoveries.items()
        if runs_
    }
    if args.only_recovery:
        print(json.dumps({"recovery": recovery, "target_recovery_s": TARGET_RECOVERY_S,
                          "state_backend": backend}, indent=2))  # fmt: skip
        return 0
    rates = {side: [r["records_per_s"] for r in rs] for side, rs in runs.items()}
    base = sum(rates["none"]) / len(rates["none"])

    def side(name: str) -> dict[str, Any]:
        mean = sum(rates[name]) / len(rates[name])
        return {"records_per_s": [round(r) for r in rates[name]], "ratio": round(mean / base, 3),
                "runs": runs[name]}  # fmt: skip

    every_10 = side("every_10s")
    result = {
        "no_checkpoints_records_per_s": [round(r) for r in rates["none"]],
        "every_10s": every_10,
        "every_1s": side("every_1s"),
        "target_ratio_at_10s": TARGET_RATIO_AT_10S,
        "target_met": every_10["ratio"] >= TARGET_RATIO_AT_10S,
        "recovery": recovery,
        "target_recovery_s": TARGET_RECOVERY_S,
        "state_backend": backend,
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
