"""State chunks of moving key groups: how an old owner packs whole groups and a new owner loads
them, in bulk on both sides.

A RocksDB store ships its groups as one SST file per chunk, read range by range and ingested at
the new owner as it is; the memory stores ship an Arrow IPC snapshot of the groups, built and
restored with vectorised column operations. A chunk is a JSON header (its groups, its format,
and for SST the groups' key counts and hits, which the new owner keeps in memory) followed by
the body; the caller seals it (`keyshift.runtime.state_integrity`). SST files are only shipped
when the seal authenticates them: a process function's values are decoded from them without a
check per value, so unauthenticated jobs move Arrow chunks, whose values the store checks.

In a hand-over from checkpoints (`keyshift.runtime.handover`) the new owner already holds the
groups as a checkpoint had them: a `changes` chunk carries only the keys changed since (their
rows, as Arrow IPC, on either backend) and the keys deleted since (in the header), and a whole
chunk for such a group replaces what was preloaded. Keys the new owner fetched on demand
meanwhile (`keep`) hold newer state than any chunk: a chunk never touches them.
Used by `keyshift.runtime.migration`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from keyshift.runtime.records import decode, pack, pack_raw, unpack_raw
from keyshift.runtime.rocksdb_state import RocksStore
from keyshift.runtime.state import KEY_COL, KeyedState

ARROW = "arrow"
SST = "sst"
CHANGES = "changes"


class StateTransferError(ValueError):
    """A state chunk that this instance cannot load: malformed, or of the wrong format."""


@dataclass(frozen=True)
class Chunk:
    """What one chunk carried: its groups, how many keys, and its size on the wire."""

    groups: list[int]
    keys: int
    nbytes: int


def export_chunk(state: KeyedState, groups: Sequence[int], bulk: bool) -> tuple[bytes, Chunk]:
    """The state of `groups` packed for a new owner (not sealed yet). `bulk` allows SST files
    (a RocksDB store whose chunks are authenticated)."""
    ordered = sorted(int(g) for g in groups)
    if bulk and isinstance(state, RocksStore):
        where = np.asarray(ordered, dtype=np.int64)
        keys = state.group_sizes()[where]
        header = {
            "groups": ordered,
            "format": SST,
            "keys": keys.tolist(),
            "hits": state.group_hits()[where].tolist(),
        }
        payload = pack_raw(header, state.export_groups(ordered))
        return payload, Chunk(ordered, int(keys.sum()), len(payload))
    snapshot = state.snapshot_groups(ordered)
    payload = pack({"groups": ordered, "format": ARROW}, snapshot)
    return payload, Chunk(ordered, snapshot.num_rows, len(payload))


def _plain(key: Any) -> Any:
    """A key as JSON carries it (a numpy integer as a Python int)."""
    return key.item() if hasattr(key, "item") else key


def export_changes(state: KeyedState, groups: Sequence[int]) -> tuple[bytes, Chunk]:
    """What changed in `groups` since the state's change marks were last cleared (at its last
    checkpoint's barrier), packed for a new owner that preloaded them from that checkpoint."""
    ordered = sorted(int(g) for g in groups)
    changes = state.changes(ordered)
    deleted = [_plain(k) for g in ordered for k in changes.deleted.get(g, ())]
    header = {"groups": ordered, "format": CHANGES, "deleted": deleted}
    payload = pack(header, changes.upserts)
    return payload, Chunk(ordered, changes.upserts.num_rows + len(deleted), len(payload))


def _decoded(body: bytes | memoryview, sender: str) -> pa.RecordBatch | None:
    try:
        return decode(body) if len(body) else None
    except pa.ArrowException as exc:
        raise StateTransferError(f"malformed state chunk from {sender}: {exc}") from exc


def _without(rows: pa.RecordBatch, keep: Collection[Any]) -> pa.RecordBatch:
    if not keep or not rows.num_rows:
        return rows
    keys = rows.column(KEY_COL).to_pylist()
    return rows.filter(pa.array([k not in keep for k in keys]))


def _drop_preloaded(state: KeyedState, groups: list[int], keep: Collection[Any]) -> None:
    """Drop what a preload put in `groups`, except the keys fetched since."""
    if not keep:
        state.drop_groups(groups)
        return
    held = state.snapshot_groups(groups).column(KEY_COL).to_pylist()
    state.drop_keys([k for k in held if k not in keep])


def import_chunk(
    state: KeyedState,
    payload: bytes | memoryview,
    sender: str,
    keep: Collection[Any] | None = None,
) -> Chunk:
    """Load an opened (authenticated) chunk into `state`; a malformed one is refused whole.
    `keep`: None when the chunk's groups were not preloaded; else the keys fetched since the
    preload, which the chunk leaves alone (see the module's docstring)."""
    try:
        header, body = unpack_raw(payload)
        groups = [int(g) for g in header["groups"]]
        kind = header.get("format", ARROW)
        deleted = list(header.get("deleted", ()))
    except (ValueError, KeyError, TypeError) as exc:
        raise StateTransferError(f"malformed state chunk from {sender}: {exc}") from exc
    if kind == CHANGES:
        if keep is None:
            raise StateTransferError(
                f"{sender} sent the changes of key groups {groups[:8]} since a checkpoint, "
                "but this instance did not preload them"
            )
        upserts = _decoded(body, sender)
        changed = [] if upserts is None else upserts.column(KEY_COL).to_pylist()
        state.drop_keys([k for k in (*changed, *deleted) if k not in keep])
        if upserts is not None:
            state.restore(_without(upserts, keep))
        return Chunk(groups, len(changed) + len(deleted), len(payload))
    if keep is not None:
        _drop_preloaded(state, groups, keep)
    if kind == SST:
        if not isinstance(state, RocksStore):
            raise StateTransferError(
                f"{sender} sent an SST state chunk, but this instance's state is not in RocksDB"
            )
        keys = np.asarray(header.get("keys"), dtype=np.int64)
        hits = np.asarray(header.get("hits"), dtype=np.int64)
        if keys.shape != (len(groups),) or hits.shape != (len(groups),):
            raise StateTransferError(
                f"SST state chunk from {sender}: key counts or hits do not match its groups"
            )
        state.ingest_groups(groups, keys, hits, body)
        return Chunk(groups, int(keys.sum()), len(payload))
    if kind != ARROW:
        raise StateTransferError(f"state chunk from {sender} has unknown format {kind!r}")
    snapshot = _decoded(body, sender)
    if snapshot is None:
        return Chunk(groups, 0, len(payload))
    state.restore(snapshot)
    return Chunk(groups, snapshot.num_rows, len(payload))
