"""What timers cost a process function, A/B in one process.

The same batches of records (`--keys` uniform keys, event time advancing 1 ms per record,
1000 records a batch) go through two process stores of a backend: `plain`, a process function
that counts each key's records per 2 s period of event time (what the timed one counts, without
timers), and `timers`, `tests.job_fns:count_until_period_end` with `emit_period` as its
`on_timer`: it also registers an event-time timer per key and period, and after each batch the
timers the watermark (the batch's last event time) has passed fire and emit their periods. Each
round feeds every batch to both, alternating which goes first; records/s per variant are
printed per round, and their ratio.

Run: `.venv/bin/python bench/timers.py --rounds 3 --backend memory`.
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

import numpy as np
import pyarrow as pa

from keyshift.runtime.keyspace import key_groups
from keyshift.runtime.records import record_schema
from keyshift.runtime.rocksdb_state import RocksProcessState, open_database, prepare_directory
from keyshift.runtime.state import ProcessFunction, ProcessState
from keyshift.runtime.state_values import ValueCodec
from keyshift.runtime.timers import EVENT, KeyedTimers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the functions: tests/job_fns
from tests.job_fns import PERIOD_US, count_until_period_end, emit_period

BATCH = 1000
GROUPS = 4096


def count_in_period(state: dict[int, int] | None, record: dict[str, Any]) -> tuple[Any, Any]:
    """count_until_period_end without its timer: the plain side of the comparison."""
    end = (record["event_time"] // PERIOD_US + 1) * PERIOD_US
    counts = state or {}
    counts[end] = counts.get(end, 0) + 1
    return counts, None


def batches(keys: int, count: int, seed: int) -> list[pa.RecordBatch]:
    rng = np.random.default_rng(seed)
    out = []
    for b in range(count):
        key = pa.array(rng.integers(0, keys, BATCH))
        times = np.arange(b * BATCH, (b + 1) * BATCH, dtype=np.int64) * 1000
        out.append(
            pa.RecordBatch.from_arrays(
                [
                    key,
                    pa.array(np.zeros(BATCH)),
                    pa.array(times),
                    pa.array(times),
                    pa.array(np.zeros(BATCH, dtype=np.int32)),
                    pa.array(np.arange(BATCH, dtype=np.int64)),
                    pa.array(key_groups(key, GROUPS)),
                ],
                schema=record_schema({"key": "int", "value": "float"}),
            )
        )
    return out


def store(function: ProcessFunction, backend: str, directory: Path, name: str) -> Any:
    codec = ValueCodec(allow_pickle=False)
    if backend == "memory":
        return ProcessState(function, GROUPS, pa.int64(), codec)
    db = open_database(prepare_directory(directory / name, name), 64, 16)
    return RocksProcessState(function, GROUPS, pa.int64(), db, codec, track_changes=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backend", choices=["memory", "rocksdb"], default="memory")
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"plain": [], "timers": []}
    fired = 0
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            data = batches(args.keys, args.batches, seed=round_)
            timers = KeyedTimers(count_until_period_end, emit_period, "key", pa.int64(), True)
            ready = np.ones(GROUPS, dtype=bool)
            stores = {
                "plain": store(count_in_period, args.backend, Path(tmp), f"plain-{round_}"),
                "timers": store(timers, args.backend, Path(tmp), f"timers-{round_}"),
            }
            spent = dict.fromkeys(stores, 0.0)
            for i, b in enumerate(data):
                order = ["plain", "timers"] if i % 2 == 0 else ["timers", "plain"]
                for name in order:
                    t0 = time.perf_counter()
                    stores[name].apply(b, "key")
                    if name == "timers":
                        watermark = int(b.column("event_time")[-1].as_py())
                        fired += len(timers.fire(stores[name], EVENT, watermark, ready))
                    spent[name] += time.perf_counter() - t0
            for name, seconds in spent.items():
                rates[name].append(args.batches * BATCH / seconds)
            print(
                f"round {round_}: "
                + ", ".join(f"{n} {rates[n][-1]:,.0f} records/s" for n in rates),
                file=sys.stderr,
            )
    plain, timed = statistics.median(rates["plain"]), statistics.median(rates["timers"])
    print(
        json.dumps(
            {
                "backend": args.backend,
                "keys": args.keys,
                "records_per_round": args.batches * BATCH,
                "rounds": args.rounds,
                "plain_records_per_s": round(plain),
                "timers_records_per_s": round(timed),
                "ratio_timers_to_plain": round(timed / plain, 3),
                "timers_fired": fired,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
