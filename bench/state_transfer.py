"""How a RocksDB stage's moving groups are best shipped: SST files vs large ordered chunks.

Builds a RocksDB keyed count of `--keys` keys (4,096 key groups) and moves all its groups to a
second, empty store through `keyshift.runtime.state_transfer`, the code a live rescale uses,
chunk by chunk (`--chunk-groups` groups per chunk, sealed and opened as on the wire), in two
formats, alternated `--rounds` times (the stores swap roles each time):

- **sst**: the old owner reads each group's range and writes it with `SstFileWriter`; the new
  owner ingests the file (`ingest_external_file`, moved, no work per key);
- **chunk**: the old owner builds an ordered Arrow chunk of the groups; the new owner writes it
  with one write batch (after the one multi-get that checks no key is already there).

Reported per format and round: seconds to export (old owner) and to import (new owner), MB on
the wire, and keys/s and logical MB/s at each end (52 bytes per key: the 12-byte key and the
40-byte value RocksDB holds). Run: `.venv/bin/python bench/state_transfer.py` (~1 minute).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from keyshift.runtime.keyspace import key_groups
from keyshift.runtime.records import EVENT_TIME, GROUP, INGEST_TIME, SEQ, SOURCE
from keyshift.runtime.rocksdb_state import RocksAggregateState, open_database, prepare_directory
from keyshift.runtime.state_integrity import StateSeal
from keyshift.runtime.state_transfer import export_chunk, import_chunk

GROUPS = 4096
BYTES_PER_KEY = 12 + 40
SEAL = StateSeal(b"b" * 32)
BATCH = 200_000


def store(root: Path, owner: str) -> RocksAggregateState:
    db = open_database(prepare_directory(root / owner, owner), 256, 64)
    return RocksAggregateState("count", GROUPS, pa.int64(), db, track_changes=False)


def fill(state: RocksAggregateState, keys: int) -> None:
    order = np.random.default_rng(1).permutation(keys).astype(np.int64)
    for start in range(0, keys, BATCH):
        part = pa.array(order[start : start + BATCH])
        zeros = pa.array(np.zeros(len(part), dtype=np.int64))
        batch = pa.RecordBatch.from_arrays(
            [part, pa.array(key_groups(part, GROUPS), type=pa.int32()), zeros, zeros,
             pa.array(np.zeros(len(part), dtype=np.int32)), zeros],
            names=["key", GROUP, EVENT_TIME, INGEST_TIME, SOURCE, SEQ],
        )  # fmt: skip
        state.apply(batch, "key", None)
    state._db.flush()


def move_all(
    old: RocksAggregateState, new: RocksAggregateState, bulk: bool, per: int
) -> dict[str, float]:
    export_s = import_s = 0.0
    wire = moved = 0
    for start in range(0, GROUPS, per):
        groups = list(range(start, min(start + per, GROUPS)))
        t0 = time.perf_counter()
        payload, _ = export_chunk(old, groups, bulk)
        sealed = SEAL.seal(payload)
        old.drop_groups(groups)
        t1 = time.perf_counter()
        got = import_chunk(new, SEAL.open(sealed, "chunk"), "bench")
        t2 = time.perf_counter()
        export_s += t1 - t0
        import_s += t2 - t1
        wire += len(sealed)
        moved += got.keys
    return {
        "keys": moved,
        "export_s": round(export_s, 3),
        "import_s": round(import_s, 3),
        "wire_mb": round(wire / 1e6, 2),
        "export_keys_per_s": round(moved / export_s),
        "import_keys_per_s": round(moved / import_s),
        "export_mb_per_s": round(moved * BYTES_PER_KEY / 1e6 / export_s, 1),
        "import_mb_per_s": round(moved * BYTES_PER_KEY / 1e6 / import_s, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--chunk-groups", type=int, default=128, help="groups per chunk")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-transfer-"))
    runs: list[dict[str, Any]] = []
    try:
        for round_ in range(args.rounds):
            for fmt in ("sst", "chunk"):
                shutil.rmtree(root, ignore_errors=True)
                old, new = store(root, "a"), store(root, "b")
                fill(old, args.keys)
                run = {"format": fmt, "round": round_ + 1, **move_all(
                    old, new, fmt == "sst", args.chunk_groups)}  # fmt: skip
                assert new.key_count == args.keys and old.key_count == 0
                old.close()
                new.close()
                runs.append(run)
                print(json.dumps(run), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for fmt in ("sst", "chunk"):
        mine = [r for r in runs if r["format"] == fmt]
        out = statistics.median(r["export_mb_per_s"] for r in mine)
        into = statistics.median(r["import_mb_per_s"] for r in mine)
        print(
            f"{fmt}: median export {out:.1f} MB/s, import {into:.1f} MB/s, "
            f"{mine[0]['wire_mb']} MB on the wire for {args.keys:,} keys"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
