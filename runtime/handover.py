"""Hand-over from checkpoints (Rhino), a new owner's side before the switch: the preload.

When a rescale of a checkpointed job moves key groups, the coordinator first has each new owner
load its future groups from the latest completed checkpoint (`Preload`), while the old owners
go on processing them. The read (checkpoint metadata, the groups' shard chains, or the RocksDB
databases that hold them) runs on a thread of its own; the rows go into the instance's state in
the keyed loop, which alone touches the state. The groups stay unowned there: no record of them
comes before a `MigrateIn` names the checkpoint and claims them, and the old owner then sends
only what changed since it (`keyshift.runtime.state_transfer`'s `changes` chunks). A read that
fails (a checkpoint missing, corrupt, unreadable, or without these groups) loads nothing and is
reported with its reason: the rescale then moves the groups directly. Groups still unclaimed
when the rescale ends (it failed, or fell back) are dropped.
Used by `keyshift.runtime.keyed_stage`.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from keyshift.runtime.checkpoint_store import CheckpointError, CheckpointStore
from keyshift.runtime.protocol import Preload, Preloaded
from keyshift.runtime.rocksdb_checkpoint import copy_database, download_database, native_groups
from keyshift.runtime.rocksdb_state import RocksStateError, RocksStore
from keyshift.runtime.stage_context import InstanceContext
from keyshift.runtime.state import KeyedState
from keyshift.runtime.state_checkpoint import read_groups

log = logging.getLogger("keyshift.handover")


class PreloadError(Exception):
    """A preload that cannot be used; the message is the reason a rescale reports."""


@dataclass(frozen=True)
class _Read:
    """What the reading thread fetched: shard rows, downloaded databases (with the groups to
    copy from each), and the bytes read from the checkpoint store."""

    rows: pa.RecordBatch
    databases: list[tuple[Path, list[int]]]
    nbytes: int


def _read(
    store: CheckpointStore,
    checkpoint: int,
    stage: str,
    groups: list[int],
    schema: pa.Schema,
    beside: Path | None,
) -> _Read:
    """Read `groups` of `stage` at `checkpoint` (off the keyed loop). `beside`: where a RocksDB
    store downloads databases (None: the state is not in RocksDB)."""
    meta = store.load(checkpoint).of_stage(stage)
    absent = [g for g in groups if g not in meta.groups]
    if absent:
        raise PreloadError(f"checkpoint {checkpoint} has no state of key groups {absent[:8]}")
    chains = {g: meta.groups[g] for g in groups}
    held = native_groups(chains)
    if held and beside is None:
        raise PreloadError(
            f"checkpoint {checkpoint} holds key groups in RocksDB databases, and this "
            "instance's state is not in RocksDB"
        )
    shards = {g: c for g, c in chains.items() if c.database is None}
    rows = read_groups(store, shards, schema)
    nbytes = sum(f.size for f in {f for c in shards.values() for f in c.files})
    databases: list[tuple[Path, list[int]]] = []
    try:
        for writer, wanted in sorted(held.items()):
            assert beside is not None
            local = download_database(store, meta, writer, beside, patient=False)
            databases.append((local, wanted))
            nbytes += sum(f.size for f in meta.databases[writer].values())
    except BaseException:
        for local, _ in databases:
            _remove(local)
        raise
    return _Read(rows, databases, nbytes)


def _remove(local: Path) -> None:
    shutil.rmtree(local, ignore_errors=True)


class Preloader:
    """One rescale's preload at a new owner: read on a thread, put into the state by `poll`
    in the keyed loop, claimed by the moves in that name its checkpoint, and the rest dropped
    by `discard`."""

    def __init__(
        self, ctx: InstanceContext, store: CheckpointStore, command: Preload, state: KeyedState
    ) -> None:
        self.ctx = ctx
        self.checkpoint = command.checkpoint
        self.groups = sorted(set(command.groups))
        # Groups in the state and not claimed yet; the ones claimed belong to a move in.
        self.unclaimed = np.zeros(ctx.spec.max_key_groups, dtype=bool)
        self.loaded = False
        self.cancelled = False
        self.started = time.monotonic()
        self._future: Future[_Read] = Future()
        beside = state.directory if isinstance(state, RocksStore) else None
        schema = state.snapshot_groups([]).schema
        threading.Thread(
            target=self._run,
            args=(store, schema, beside),
            name=f"preload-{command.checkpoint}",
            daemon=True,  # a stopping instance does not wait for it
        ).start()

    def _run(self, store: CheckpointStore, schema: pa.Schema, beside: Path | None) -> None:
        try:
            read = _read(store, self.checkpoint, self.ctx.stage, self.groups, schema, beside)
        except (CheckpointError, PreloadError, RocksStateError, pa.ArrowException) as exc:
            self._future.set_exception(PreloadError(str(exc)))
        except BaseException as exc:  # a bug: raised again in the keyed loop by `poll`
            self._future.set_exception(exc)
        else:
            self._future.set_result(read)

    def poll(self, state: KeyedState) -> Preloaded | None:
        """Once the read has ended (and only once): its groups put into the state, and the event
        that says so or why not. Nothing when it was cancelled meanwhile."""
        if not self._future.done() or self.loaded:
            return None
        self.loaded = True
        try:
            read = self._future.result()
        except PreloadError as exc:
            return self._failed(str(exc))
        if self.cancelled:
            for local, _ in read.databases:
                _remove(local)
            return None
        self.unclaimed[self.groups] = True
        try:
            state.restore(read.rows)
            keys = read.rows.num_rows
            for local, wanted in read.databases:
                assert isinstance(state, RocksStore)
                keys += copy_database(state, local, wanted)
        except (ValueError, RocksStateError) as exc:
            for local, _ in read.databases:
                _remove(local)
            self.discard(state)
            return self._failed(f"cannot load checkpoint {self.checkpoint}'s state: {exc}")
        seconds = time.monotonic() - self.started
        stats = self.ctx.metrics.migration_stats()
        stats["keys_preloaded"] += keys
        stats["bytes_preloaded"] += read.nbytes
        log.info(
            "preloaded %d keys of %d key groups (%d bytes) from checkpoint %d in %.2f s",
            keys, len(self.groups), read.nbytes, self.checkpoint, seconds,
        )  # fmt: skip
        return Preloaded(
            checkpoint=self.checkpoint, keys=keys, bytes=read.nbytes, seconds=round(seconds, 3)
        )

    def _failed(self, reason: str) -> Preloaded:
        log.warning("preload from checkpoint %d failed: %s", self.checkpoint, reason)
        return Preloaded(checkpoint=self.checkpoint, error=reason)

    def claim(self, groups: np.ndarray) -> bool:
        """A move in takes `groups` over: whether all of them were preloaded (else the move
        must not build on the preload)."""
        if not self.loaded or not bool(self.unclaimed[groups].all()):
            return False
        self.unclaimed[groups] = False
        return True

    def discard(self, state: KeyedState) -> None:
        """Drop what is loaded and unclaimed (the groups are not this instance's), and anything
        the read still brings."""
        self.cancelled = True
        left = np.flatnonzero(self.unclaimed)
        if len(left):
            state.drop_groups(left.tolist())
            self.unclaimed[left] = False
