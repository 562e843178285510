"""Native checkpoints of a RocksDB instance's state, as Flink's incremental RocksDB checkpoints.

Used by `keyshift.runtime.checkpointing` (the keyed instance's side of a checkpoint, and its
restore). At a barrier the instance takes a RocksDB checkpoint (memtables flushed, SST files
hard-linked into a directory beside its database: the consistent snapshot, taken in the keyed
loop) and then, off the loop, stores its files through the checkpoint store, checksummed and
sealed like shards (as Flink's asynchronous phase); an SST file that the instance's previous
completed checkpoint already stored is named again, not uploaded, since RocksDB never changes
an SST file once written. The checkpoint's metadata names every file of every instance's
database, and each of the instance's groups as held by that database.

A restore (after a crash, or onto other instances than wrote it: a rescale from a checkpoint)
downloads each database that holds groups the instance owns, opens it read-only and copies the
owned groups' ranges into the instance's own database (a group is one contiguous range).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from keyshift.runtime.checkpoint_store import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointMeta,
    CheckpointStore,
    GroupChain,
    ShardFile,
)
from keyshift.runtime.rocksdb_state import RocksStateError, RocksStore
from keyshift.runtime.storage import retrying

log = logging.getLogger("keyshift.checkpoints")
SST_SUFFIX = ".sst"


@dataclass(frozen=True)
class WrittenDatabase:
    files: dict[str, ShardFile]  # every file of the database's checkpoint, by local name
    written: int  # bytes uploaded for this checkpoint
    reused: int  # bytes of SST files an earlier checkpoint stored


def snapshot_database(state: RocksStore, checkpoint: int) -> Path:
    """A RocksDB checkpoint of the instance's database beside it (memtables flushed, SST files
    hard-linked): the state at the barrier, which `upload_database` then stores while the
    database goes on changing."""
    local = state.directory / f"checkpoint-{checkpoint}"
    shutil.rmtree(local, ignore_errors=True)
    try:
        state.checkpoint_into(local)
    except (RocksStateError, OSError) as exc:
        shutil.rmtree(local, ignore_errors=True)
        # The local disk failed (full, gone): this checkpoint fails, the job goes on.
        raise CheckpointError(f"{state.directory}: {exc}", retryable=True) from exc
    return local


def upload_database(
    store: CheckpointStore,
    checkpoint: int,
    writer: str,
    local: Path,
    previous: Mapping[str, ShardFile],
) -> WrittenDatabase:
    """Store the files of a database checkpoint taken by `snapshot_database` that `previous`
    (the files of the instance's last completed checkpoint) does not already hold, and delete
    the local checkpoint."""
    try:
        files: dict[str, ShardFile] = {}
        written = reused = 0
        for path in sorted(local.iterdir()):
            known = previous.get(path.name) if path.suffix == SST_SUFFIX else None
            size = path.stat().st_size
            if known is not None and known.size == size:
                files[path.name] = known
                reused += size
                continue
            data = path.read_bytes()
            files[path.name] = store.write_database_file(checkpoint, writer, path.name, data)
            written += len(data)
    except OSError as exc:
        raise CheckpointError(f"{writer}: {exc}", retryable=True) from exc
    finally:
        shutil.rmtree(local, ignore_errors=True)
    return WrittenDatabase(files, written, reused)


def native_groups(chains: Mapping[int, GroupChain]) -> dict[str, list[int]]:
    """The groups of `chains` that a database holds, per database (writer)."""
    held: dict[str, list[int]] = {}
    for group, chain in chains.items():
        if chain.database is not None:
            held.setdefault(chain.database, []).append(group)
    return held


def restore_databases(
    store: CheckpointStore,
    meta: CheckpointMeta,
    state: RocksStore,
    held: Mapping[str, list[int]],
) -> int:
    """Copy the groups each database of `meta` holds for this instance (`held`) into `state`;
    the keys restored. Storage that fails is waited for; a file that does not match its
    checksum or HMAC is CheckpointCorrupt."""
    restored = 0
    for writer, groups in sorted(held.items()):
        local = download_database(store, meta, writer, state.directory, patient=True)
        restored += copy_database(state, local, groups)
        log.info(
            "restored %d groups from %s's database of checkpoint %d", len(groups), writer, meta.id
        )
    return restored


def download_database(
    store: CheckpointStore, meta: CheckpointMeta, writer: str, beside: Path, patient: bool
) -> Path:
    """Download `writer`'s database of `meta` into a directory in `beside`. `patient`: storage
    that fails is waited for (a recovery cannot go on without it); else its error is raised
    (a hand-over falls back to a direct transfer instead)."""
    files = meta.databases.get(writer)
    if files is None:
        raise CheckpointCorrupt(
            f"checkpoint {meta.id} names groups held by {writer}'s database but not its files"
        )
    local = beside / f"restore-{meta.id}-{writer}"
    shutil.rmtree(local, ignore_errors=True)
    try:
        local.mkdir(parents=True)
        for name, stored in sorted(files.items()):
            read = partial(store.read_database_file, stored)
            what = f"restoring {writer}'s database from checkpoint {meta.id}"
            (local / name).write_bytes(retrying(read, what) if patient else read())
    except OSError as exc:
        shutil.rmtree(local, ignore_errors=True)
        raise RocksStateError(
            f"cannot download {writer}'s database of checkpoint {meta.id} into {local}: {exc}"
        ) from exc
    except BaseException:
        shutil.rmtree(local, ignore_errors=True)
        raise
    return local


def copy_database(state: RocksStore, local: Path, groups: list[int]) -> int:
    """Copy `groups` from a database `download_database` fetched into `state`, and delete the
    download; the keys copied."""
    try:
        return state.copy_groups(local, groups)
    finally:
        shutil.rmtree(local, ignore_errors=True)
