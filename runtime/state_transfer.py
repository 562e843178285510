"""State chunks of moving key groups: how an old owner packs whole groups and a new owner loads
them, in bulk on both sides.

A RocksDB store ships its groups as one SST file per chunk, read range by range and ingested at
the new owner as it is; the memory stores ship an Arrow IPC snapshot of the groups, built and
restored with vectorised column operations. A chunk is a JSON header (its groups, its format,
and for SST the groups' key counts and hits, which the new owner keeps in memory) followed by
the body; the caller seals it (`keyshift.runtime.state_integrity`). SST files are only shipped
when the seal authenticates them: a process function's values are decoded from them without a
check per value, so unauthenticated jobs move Arrow chunks, whose values the store checks.
Used by `keyshift.runtime.migration`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from keyshift.runtime.records import decode, pack, pack_raw, unpack_raw
from keyshift.runtime.rocksdb_state import RocksStore
from keyshift.runtime.state import KeyedState

ARROW = "arrow"
SST = "sst"


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


def import_chunk(state: KeyedState, payload: bytes | memoryview, sender: str) -> Chunk:
    """Load an opened (authenticated) chunk into `state`; a malformed one is refused whole."""
    try:
        header, body = unpack_raw(payload)
        groups = [int(g) for g in header["groups"]]
        kind = header.get("format", ARROW)
    except (ValueError, KeyError, TypeError) as exc:
        raise StateTransferError(f"malformed state chunk from {sender}: {exc}") from exc
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
    try:
        snapshot = decode(body) if len(body) else None
    except pa.ArrowException as exc:
        raise StateTransferError(f"malformed state chunk from {sender}: {exc}") from exc
    if snapshot is None:
        return Chunk(groups, 0, len(payload))
    state.restore(snapshot)
    return Chunk(groups, snapshot.num_rows, len(payload))
