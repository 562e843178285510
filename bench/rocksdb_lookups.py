"""RocksDB table options for a keyed count's point lookups, A/B in one process.

Two (or more) `RocksAggregateState`s, each on its own database with a `--cache-mb` block cache,
are fed the same 65,536-record batches of uniform keys from `--keys`; each batch goes to every
variant, alternating which goes first, and each variant's `apply` is timed. Every 10 batches
it prints records/s per variant. Variants: `charged` (index and filter blocks charged to the
cache: the options before partitioning), `partitioned` (what `open_database` uses now:
two-level index and filters, top level and L0 pinned in the cache) and `hash` (charged, plus a
hash index inside data blocks and L0 pinned).

Run: `.venv/bin/python bench/rocksdb_lookups.py --batches 60 charged partitioned`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import rocksdict

from keyshift.runtime.keyspace import key_groups
from keyshift.runtime.records import record_schema
from keyshift.runtime.rocksdb_state import RocksAggregateState, open_database

BATCH = 65_536
GROUPS = 4096


def database(directory: Path, variant: str, cache_mb: int) -> rocksdict.Rdict:
    if variant == "partitioned":
        return open_database(directory, cache_mb, 16)
    options = rocksdict.Options(raw_mode=True)
    options.create_if_missing(True)
    table = rocksdict.BlockBasedOptions()
    table.set_block_cache(rocksdict.Cache(cache_mb << 20))
    table.set_cache_index_and_filter_blocks(True)
    table.set_bloom_filter(10, False)
    if variant == "hash":
        table.set_data_block_index_type(rocksdict.DataBlockIndexType.binary_and_hash())
        table.set_data_block_hash_ratio(0.75)
        table.set_pin_l0_filter_and_index_blocks_in_cache(True)
    options.set_block_based_table_factory(table)
    options.set_write_buffer_size(16 << 20)
    options.set_max_write_buffer_number(2)
    db = rocksdict.Rdict(str(directory), options)
    writes = rocksdict.WriteOptions()
    writes.disable_wal = True  # type: ignore[method-assign,assignment]
    db.set_write_options(writes)
    return db


def batch(rng: np.random.Generator, keys: int) -> pa.RecordBatch:
    """A batch as the source stage sends it, of uniform keys."""
    key = pa.array(rng.integers(0, keys, BATCH))
    seqs = pa.array(np.arange(BATCH, dtype=np.int64))
    return pa.RecordBatch.from_arrays(
        [
            key,
            pa.array(np.zeros(BATCH)),
            seqs,
            seqs,
            pa.array(np.zeros(BATCH, dtype=np.int32)),
            seqs,
            pa.array(key_groups(key, GROUPS), type=pa.int32()),
        ],
        schema=record_schema({"key": "int", "value": "float"}),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("variants", nargs="+", choices=["charged", "partitioned", "hash"])
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--keys", type=int, default=10_000_000)
    parser.add_argument("--cache-mb", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-rocksdb-lookups-") as tmp:
        states = {
            v: RocksAggregateState(
                "count", GROUPS, pa.int64(), database(Path(tmp) / v, v, args.cache_mb), False
            )
            for v in args.variants
        }
        rng = np.random.default_rng(1)
        spent = dict.fromkeys(args.variants, 0.0)
        for i in range(args.batches):
            records = batch(rng, args.keys)
            for v in args.variants if i % 2 else args.variants[::-1]:
                t0 = time.perf_counter()
                states[v].apply(records, "key", None)
                spent[v] += time.perf_counter() - t0
            if i % 10 == 9:
                keys = next(iter(states.values())).key_count
                rates = {v: round(10 * BATCH / spent[v]) for v in args.variants}
                print(f"batches {i + 1}, keys {keys}: records/s {rates}", flush=True)
                spent = dict.fromkeys(args.variants, 0.0)
        for state in states.values():
            state.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
