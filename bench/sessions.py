"""What session windows cost against tumbling windows, A/B in one process: NEXMark Q11's keyed
stage (bids per bidder and session, gap 10 s) beside the same count per bidder and tumbling
10 s window.

The same batches of NEXMark bids (`--events` events of the model at `--event-rate` events/s of
event time, 50 ms out of order; the bids among them, keyed by bidder, in batches of 8192) go
through both, as the keyed stage drives them (`keyshift.runtime.windows.EventWindows`): each
batch is absorbed, then the windows the watermark (the batch's highest event time less 50 ms)
has passed fire. `tumbling` is `KeyedWindows` over the vectorised aggregate store; `sessions`
is `SessionWindows` over a process store (the per-record `SessionFunction`). Each round feeds
every batch to both, alternating which goes first; records/s per variant per round, and their
ratio; the results each fired, which must match over rounds.

Run: `.venv/bin/python bench/sessions.py --rounds 3 --backend memory`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from keyshift.runtime.keyspace import key_groups
from keyshift.runtime.nexmark import NexmarkModel, events
from keyshift.runtime.records import EVENT_TIME, record_schema
from keyshift.runtime.rocksdb_state import (
    RocksAggregateState,
    RocksProcessState,
    open_database,
    prepare_directory,
)
from keyshift.runtime.sessions import SessionFunction, SessionWindows
from keyshift.runtime.state import AggregateState, ProcessState
from keyshift.runtime.state_values import ValueCodec
from keyshift.runtime.windows import (
    AggregateContents,
    EventWindows,
    KeyedWindows,
    WindowShape,
    composite_groups,
)

BATCH = 8192
GROUPS = 4096
WINDOW_US = 10_000_000  # the tumbling window's size and the session gap
DISORDER_US = 50_000


def bid_batches(count: int, event_rate: float) -> list[pa.RecordBatch]:
    """The bids among the first `count` events, as a keyed stage reads them."""
    model = NexmarkModel(seed=1, event_rate=event_rate, max_disorder_us=DISORDER_US)
    made = events(model, np.arange(count, dtype=np.int64))
    bids = made.filter(pc.equal(made.column("kind"), "bid"))
    bidder, times = bids.column("bidder"), bids.column(EVENT_TIME)
    n = bids.num_rows
    batch = pa.RecordBatch.from_arrays(
        [
            bidder,
            times,
            times,
            pa.array(np.zeros(n, dtype=np.int32)),
            pa.array(np.arange(n, dtype=np.int64)),
            pa.array(key_groups(bidder, GROUPS)),
        ],
        schema=record_schema({"bidder": "int"}),
    )
    return [batch.slice(start, BATCH) for start in range(0, n, BATCH)]


def tumbling(backend: str, directory: Path) -> EventWindows:
    state: Any
    if backend == "memory":
        state = AggregateState("count", GROUPS, pa.string())
    else:
        db = open_database(prepare_directory(directory, "tumbling"), 64, 16)
        groups_of = partial(composite_groups, pa.int64(), GROUPS)
        state = RocksAggregateState("count", GROUPS, pa.string(), db, False, groups_of)
    contents = AggregateContents("count", None, state)
    shape = WindowShape(WINDOW_US, WINDOW_US)
    return KeyedWindows(shape, contents, "bidder", pa.int64(), state, GROUPS)


def sessions(backend: str, directory: Path) -> EventWindows:
    function = SessionFunction(WINDOW_US, 0, "count", None, None, None, "bidder", GROUPS)
    state: Any
    if backend == "memory":
        state = ProcessState(function, GROUPS, pa.int64())
    else:
        db = open_database(prepare_directory(directory, "sessions"), 64, 16)
        codec = ValueCodec(allow_pickle=False)
        state = RocksProcessState(function, GROUPS, pa.int64(), db, codec, False)
    return SessionWindows(function, "bidder", pa.int64(), state, GROUPS)


def feed(windows: EventWindows, batch: pa.RecordBatch, ready: np.ndarray) -> int:
    """One batch as the keyed stage takes it; the results it fired."""
    watermark = int(pc.max(batch.column(EVENT_TIME)).as_py()) - DISORDER_US
    windows.absorb(windows.expand(batch), windows.thresholds(watermark, ready))
    out = windows.fire(watermark, ready)
    return 0 if out is None else out.num_rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=500_000)
    parser.add_argument("--event-rate", type=float, default=10_000.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backend", choices=["memory", "rocksdb"], default="memory")
    args = parser.parse_args()
    data = bid_batches(args.events, args.event_rate)
    records = sum(b.num_rows for b in data)
    makers = {"tumbling": tumbling, "sessions": sessions}
    rates: dict[str, list[float]] = {name: [] for name in makers}
    fired: dict[str, set[int]] = {name: set() for name in makers}
    ready = np.ones(GROUPS, dtype=bool)
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            variants = {
                n: make(args.backend, Path(tmp) / f"{n}-{round_}") for n, make in makers.items()
            }
            spent = dict.fromkeys(variants, 0.0)
            results = dict.fromkeys(variants, 0)
            for i, batch in enumerate(data):
                order = list(variants) if i % 2 == 0 else list(reversed(variants))
                for name in order:
                    t0 = time.perf_counter()
                    results[name] += feed(variants[name], batch, ready)
                    spent[name] += time.perf_counter() - t0
            for name, seconds in spent.items():
                rates[name].append(records / seconds)
                fired[name].add(results[name])
            print(
                f"round {round_}: "
                + ", ".join(f"{n} {rates[n][-1]:,.0f} records/s" for n in rates),
                file=sys.stderr,
            )
    tumbled, sessioned = (statistics.median(rates[n]) for n in ("tumbling", "sessions"))
    print(
        json.dumps(
            {
                "backend": args.backend,
                "bids_per_round": records,
                "rounds": args.rounds,
                "tumbling_records_per_s": round(tumbled),
                "sessions_records_per_s": round(sessioned),
                "ratio_sessions_to_tumbling": round(sessioned / tumbled, 3),
                "results_fired": {n: sorted(f) for n, f in fired.items()},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
