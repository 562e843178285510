"""Incremental checkpoints of keyed state, per key group (Rhino's fine-grained state shards).

Used by the keyed stage instances (to write their groups at a checkpoint) and by recovery (to
rebuild groups from a checkpoint). Each key group's state at a checkpoint is a chain of shard
rows: a base (all its keys) and then deltas (the keys changed since the previous checkpoint,
and tombstones for deleted ones). At the barrier `snapshot_groups` copies out the bases and
deltas of all the instance's groups; `store_groups` then writes them as one shard per instance
and checkpoint (off the keyed loop) and returns each group's new chain; a group
gets a base when it has none yet, when it arrived by migration since the last checkpoint,
when its chain reached `max_chain` links (compaction), or when the instance's previous
checkpoint did not complete (its deltas would miss that checkpoint's changes). So recovery and
hand-over read only what changed plus one base per group, and a checkpoint of a skewed
workload writes little more than its hot keys.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from keyshift.runtime.checkpoint_store import CheckpointStore, GroupChain, ShardFile
from keyshift.runtime.state import GROUP_COL, KEY_COL, KeyedState

DELETED_COL = "_deleted"
_ROW = "_row"
DEFAULT_MAX_CHAIN = 8


@dataclass(frozen=True)
class WrittenGroups:
    chains: dict[int, GroupChain]  # the new chain of every group written
    shard: ShardFile | None  # None when nothing changed
    base_groups: int
    delta_groups: int
    rows: int


def _with_deleted(batch: pa.RecordBatch, deleted: bool) -> pa.Table:
    table = pa.Table.from_batches([batch])
    return table.append_column(DELETED_COL, pa.array(np.full(table.num_rows, deleted)))


def _tombstones(schema: pa.Schema, deleted: Mapping[int, Sequence[object]]) -> pa.Table:
    groups = [g for g, keys in deleted.items() for _ in keys]
    keys = [k for ks in deleted.values() for k in ks]
    columns = []
    for f in schema:
        if f.name == GROUP_COL:
            columns.append(pa.array(groups, f.type))
        elif f.name == KEY_COL:
            columns.append(pa.array(keys, f.type))
        else:
            columns.append(pa.nulls(len(keys), f.type))
    columns.append(pa.array(np.ones(len(keys), dtype=np.bool_)))
    return pa.Table.from_arrays(columns, schema=schema.append(pa.field(DELETED_COL, pa.bool_())))


@dataclass(frozen=True)
class GroupsSnapshot:
    """What a checkpoint writes of some groups, copied out of the state at the barrier: the
    state goes on changing while the snapshot is stored."""

    table: pa.Table  # the bases' and deltas' rows, tombstones included
    groups: tuple[int, ...]
    base: frozenset[int]  # groups written whole
    touched: frozenset[int]  # groups with rows in `table`
    previous: Mapping[int, GroupChain]


def snapshot_groups(
    state: KeyedState,
    groups: Sequence[int],
    previous: Mapping[int, GroupChain],
    previous_complete: bool,
    max_chain: int = DEFAULT_MAX_CHAIN,
) -> GroupsSnapshot:
    """Copy out what this instance's checkpoint writes of `groups`, and clear the state's
    change marks.

    `previous` holds the groups' chains at the last completed checkpoint; `previous_complete`
    says whether this instance's own last checkpoint was that one.
    """
    changes = state.changes(groups)
    base = frozenset(
        g
        for g in groups
        if not previous_complete
        or g not in previous
        or g in changes.restored
        or len(previous[g].files) >= max_chain
    )
    parts = [_with_deleted(state.snapshot_groups(sorted(base)), False)]
    upserts = changes.upserts
    if upserts.num_rows:
        in_delta = ~np.isin(upserts.column(GROUP_COL).to_numpy(), list(base))
        parts.append(_with_deleted(upserts.filter(pa.array(in_delta)), False))
    deleted = {g: keys for g, keys in changes.deleted.items() if g not in base}
    if deleted:
        parts.append(_tombstones(upserts.schema, deleted))
    table = pa.concat_tables(parts)
    touched = frozenset(np.unique(table.column(GROUP_COL).to_numpy()).tolist())
    state.clear_changes()
    return GroupsSnapshot(table, tuple(groups), base, touched, previous)


def store_groups(
    store: CheckpointStore, checkpoint: int, writer: str, snapshot: GroupsSnapshot
) -> WrittenGroups:
    """Write a snapshot as this instance's shard of `checkpoint`, and each group's new chain."""
    table = snapshot.table
    shard = store.write_shard(checkpoint, writer, table) if table.num_rows else None
    chains: dict[int, GroupChain] = {}
    for g in snapshot.groups:
        if g in snapshot.base:
            chains[g] = GroupChain((shard,) if shard is not None and g in snapshot.touched else ())
        elif g in snapshot.touched:
            assert shard is not None
            chains[g] = GroupChain((*snapshot.previous[g].files, shard))
        else:
            chains[g] = snapshot.previous[g]
    base = len(snapshot.base)
    deltas = len(snapshot.touched - snapshot.base)
    return WrittenGroups(chains, shard, base, deltas, int(table.num_rows))


def read_groups(
    store: CheckpointStore, chains: Mapping[int, GroupChain], schema: pa.Schema
) -> pa.RecordBatch:
    """The state rows of some groups at a checkpoint, ready for `KeyedState.restore`: each
    chain's base and deltas applied in order (the last write of a key wins; tombstones delete).
    `schema` is the state's snapshot schema."""
    # A shard of a later checkpoint comes later in every chain that names it: reading the
    # shards in checkpoint order, each once, keeps every group's links in order.
    users: dict[ShardFile, list[int]] = {}
    for group, chain in chains.items():
        for shard in chain.files:
            users.setdefault(shard, []).append(group)
    parts: list[pa.Table] = []
    written = 0  # a running row number: later links of a chain get higher ones
    for shard in sorted(users, key=lambda f: f.path):  # paths start with the checkpoint id
        table = store.read_shard(shard)
        wanted = pa.array(users[shard], pa.int32())
        rows = table.filter(pc.is_in(table.column(GROUP_COL), value_set=wanted))
        order = np.arange(written, written + rows.num_rows, dtype=np.int64)
        written += rows.num_rows
        parts.append(rows.append_column(_ROW, pa.array(order)))
    if not written:
        return pa.RecordBatch.from_pylist([], schema=schema)
    table = pa.concat_tables(parts)
    latest = table.group_by([GROUP_COL, KEY_COL], use_threads=False).aggregate([(_ROW, "max")])
    table = table.filter(pc.is_in(table.column(_ROW), latest.column(f"{_ROW}_max")))
    table = table.filter(pc.invert(table.column(DELETED_COL)))
    table = table.drop_columns([_ROW, DELETED_COL]).select(schema.names).cast(schema)
    if not table.num_rows:
        return pa.RecordBatch.from_pylist([], schema=schema)
    return table.combine_chunks().to_batches()[0]
