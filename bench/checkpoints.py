"""Checkpoint benchmark: throughput with checkpoints every 10 s and every 1 s, as a ratio to no
checkpoints, and the size of incremental checkpoints against full ones.

The pipeline of bench/throughput.py (one generator, 1,000,000 keys, Zipf 1.0 -> one keyed count
-> a discarding sink, as fast as it goes) runs three times in this process's run: without
checkpoints, with a checkpoint every 10 s, with one every 1 s (to a local directory). Each
run measures records/s through the keyed instance over the same steady window. The sizes come
from the checkpoints' metadata: bytes each checkpoint wrote (its new shards) against bytes of
all the shards it names (what a full checkpoint, or a recovery, reads).

Run: `make bench-checkpoints` or `.venv/bin/python bench/checkpoints.py`.
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
from throughput import job, ratio, snapshot

from keyshift.operator.local_host import LocalJob
from keyshift.runtime.checkpoint_store import CheckpointStore
from keyshift.runtime.job import parse_job

TARGET_RATIO_AT_10S = 0.9


def measure(interval: float | None, warmup: float, window: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-checkpoints-") as tmp:
        spec_data = job(65536)
        storage = Path(tmp) / "checkpoints"
        if interval is not None:
            spec_data["checkpoints"] = {"interval": interval, "storage": str(storage),
                                        "retain": 1000}  # fmt: skip
        path = Path(tmp) / "job.yaml"
        path.write_text(yaml.safe_dump(spec_data))
        with LocalJob(parse_job(spec_data), path, log_dir=Path(tmp) / "logs") as local:
            local.start()
            deadline = time.monotonic() + 60
            while not snapshot(local)["counts"].get("records_in"):
                if time.monotonic() > deadline:
                    raise RuntimeError("no records reached the keyed instance within 60 s")
                time.sleep(0.2)
            time.sleep(warmup)
            before = snapshot(local)
            time.sleep(window)
            after = snapshot(local)
            checkpoints = local.status().get("checkpoints")
        result: dict[str, Any] = {
            "records_per_s": ratio(before["counts"], after["counts"], "records_in"),
            "state_keys": after["counts"].get("state_keys", 0),
        }
        if interval is not None:
            store = CheckpointStore(str(storage))
            metas = [store.load(c) for c in store.completed()]
            full = [sum(chain.size for chain in m.groups.values()) for m in metas]
            result.update(
                completed=len(metas),
                failed=(checkpoints or {}).get("failed"),
                first_written_mb=round(metas[0].written / 1e6, 1) if metas else None,
                later_written_mb=[round(m.written / 1e6, 1) for m in metas[1:6]],
                last_full_mb=round(full[-1] / 1e6, 1) if full else None,
                last_duration_s=round(
                    (checkpoints or {}).get("last_completed", {}).get("seconds", 0.0), 2
                ),
            )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--window", type=float, default=20.0)
    args = parser.parse_args()
    none = measure(None, args.warmup, args.window)
    every_10 = measure(10.0, args.warmup, args.window)
    every_1 = measure(1.0, args.warmup, args.window)
    base = none["records_per_s"]
    result = {
        "no_checkpoints_records_per_s": round(base),
        "every_10s": {**every_10, "records_per_s": round(every_10["records_per_s"]),
                      "ratio": round(every_10["records_per_s"] / base, 3)},
        "every_1s": {**every_1, "records_per_s": round(every_1["records_per_s"]),
                     "ratio": round(every_1["records_per_s"] / base, 3)},
        "target_ratio_at_10s": TARGET_RATIO_AT_10S,
        "target_met": every_10["records_per_s"] / base >= TARGET_RATIO_AT_10S,
    }  # fmt: skip
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
