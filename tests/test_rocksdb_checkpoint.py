"""Native RocksDB checkpoints (keyshift.runtime.rocksdb_checkpoint through the keyed instance's
KeyedCheckpointer): real databases, a real checkpoint directory (local and moto's S3 server).

Each test takes checkpoints of a real RocksDB state, builds the checkpoint's metadata from the
instances' acks as the coordinator does, and restores into fresh databases, which must hold
exactly the state the checkpoint was taken of, whichever instances the groups land on.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from keyshift.runtime.checkpoint_store import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointMeta,
    CheckpointStore,
    chains_from_json,
    database_from_json,
)
from keyshift.runtime.checkpointing import CheckpointProtocolError, KeyedCheckpointer
from keyshift.runtime.job import CheckpointSettings
from keyshift.runtime.protocol import Barrier, KeyedCheckpointAck
from keyshift.runtime.records import GROUP
from keyshift.runtime.rocksdb_state import RocksAggregateState, open_database, prepare_directory
from keyshift.runtime.state import AggregateState
from tests.conftest import wait_for
from tests.s3_server import s3_bucket, s3_options
from tests.test_state import G, make_batch

EVERY = np.ones(G, dtype=bool)


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.live)])
def settings(request: pytest.FixtureRequest, tmp_path: Path) -> CheckpointSettings:
    if request.param == "local":
        return CheckpointSettings(storage=str(tmp_path / "checkpoints"))
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = s3_bucket(endpoint, "native")
    return CheckpointSettings(storage=f"s3://{bucket}/job", storage_options=s3_options(endpoint))


def rocks(root: Path, owner: str) -> RocksAggregateState:
    db = open_database(prepare_directory(root / owner, owner), block_cache_mb=8, write_buffer_mb=1)
    return RocksAggregateState("sum", G, pa.int64(), db, track_changes=False)


def feed(state: RocksAggregateState, keys: range | list[int]) -> None:
    state.apply(make_batch(list(keys), [float(k % 5) for k in keys]), "key", "value")


def truth(*feeds: range | list[int]) -> dict[int, float]:
    sums: dict[int, float] = {}
    for keys in feeds:
        for k in keys:
            sums[k] = sums.get(k, 0.0) + float(k % 5)
    return sums


def checkpoint_now(
    checkpointer: KeyedCheckpointer, barrier: Barrier, state: Any, owned: np.ndarray
) -> KeyedCheckpointAck:
    """A keyed instance's checkpoint, its upload waited for."""
    checkpointer.start(barrier, state, owned)
    ack = checkpointer.wait()
    assert ack is not None
    return ack


def take(
    checkpointer: KeyedCheckpointer,
    state: Any,
    number: int,
    previous: int | None,
    owned: np.ndarray = EVERY,
) -> KeyedCheckpointAck:
    ack = checkpoint_now(checkpointer, Barrier(id=number, previous=previous), state, owned)
    assert ack.error is None, ack
    return ack


def commit(store: CheckpointStore, number: int, acks: list[KeyedCheckpointAck]) -> CheckpointMeta:
    """The checkpoint's metadata from the keyed instances' acks, as the coordinator makes it."""
    groups = {}
    databases = {}
    for ack in acks:
        groups.update(chains_from_json(ack.chains))
        if ack.writer is not None and ack.database is not None:
            databases[ack.writer] = database_from_json(ack.database)
    meta = CheckpointMeta(
        id=number,
        created=time.time(),
        groups=groups,
        databases=databases,
        written=sum(a.written for a in acks),
    )
    store.commit(meta)
    return store.load(number)


def test_a_native_checkpoint_uploads_only_new_sst_files_and_restores_exactly(
    tmp_path: Path, settings: CheckpointSettings
) -> None:
    state = rocks(tmp_path / "a", "keyed-0")
    checkpointer = KeyedCheckpointer(settings, "keyed-0")
    feed(state, range(20_000))
    first = take(checkpointer, state, 1, None)
    assert checkpointer.store is not None
    store = checkpointer.store
    meta1 = commit(store, 1, [first])
    feed(state, range(19_000, 21_000))
    second = take(checkpointer, state, 2, 1)
    meta2 = commit(store, 2, [second])

    assert first.reused == 0 and first.written > 0
    # The first checkpoint's SST files are named again, not uploaded again.
    assert second.reused > 0 and second.written < first.written
    reused = set(meta1.databases["keyed-0"].values()) & set(meta2.databases["keyed-0"].values())
    assert any(f.path.endswith(".sst") for f in reused)
    assert set(meta2.groups) == set(range(G))
    assert meta2.groups[0].database == "keyed-0" and meta2.groups[0].files == ()

    fresh = rocks(tmp_path / "b", "keyed-0")
    restorer = KeyedCheckpointer(settings, "keyed-0")
    assert restorer.restore(meta2, fresh, EVERY) == 21_000
    assert fresh.items() == truth(range(20_000), range(19_000, 21_000))
    assert fresh.key_count == 21_000
    np.testing.assert_array_equal(fresh.group_sizes(), state.group_sizes())
    np.testing.assert_array_equal(fresh.group_hits(), state.group_hits())
    # A restored database is a new one: its next checkpoint stores all its files.
    after = take(restorer, fresh, 3, 2)
    assert after.reused == 0 and after.written > 0


def test_a_checkpoint_restores_onto_other_instances_each_with_its_own_groups(
    tmp_path: Path,
) -> None:
    """A rescale from a checkpoint: groups two instances wrote land on three."""
    settings = CheckpointSettings(storage=str(tmp_path / "checkpoints"))
    owners = np.arange(G) % 2
    acks = []
    for index in range(2):
        state = rocks(tmp_path / "old", f"keyed-{index}")
        keys = [k for k in range(10_000) if k % 2 == index]
        # Keys are fed to whichever instance; each instance then owns its groups' keys only.
        state.apply(make_batch(keys, [1.0] * len(keys)), "key", "value")
        mine = owners == index
        state.drop_groups(np.flatnonzero(~mine).tolist())
        acks.append(take(KeyedCheckpointer(settings, f"keyed-{index}"), state, 1, None, mine))
    store = CheckpointStore(settings.storage)
    meta = commit(store, 1, acks)
    assert set(meta.databases) == {"keyed-0", "keyed-1"}
    restored: dict[int, float] = {}
    total = 0
    for index in range(3):
        fresh = rocks(tmp_path / "new", f"keyed-{index}")
        owned = np.arange(G) % 3 == index
        total += KeyedCheckpointer(settings, f"keyed-{index}").restore(meta, fresh, owned)
        items = fresh.items()
        assert not set(items) & set(restored)
        restored.update(items)
    assert total == len(restored)
    # Every key of the owned groups, once, with its value; keys of dropped groups are gone.
    survivors = {}
    for index in range(2):
        keys = [k for k in range(10_000) if k % 2 == index]
        groups = make_batch(keys, [1.0] * len(keys)).column(GROUP).to_numpy()
        survivors.update({k: 1.0 for k, g in zip(keys, groups, strict=True) if owners[g] == index})
    assert restored == survivors


def test_retention_deletes_the_files_no_kept_checkpoint_names(tmp_path: Path) -> None:
    settings = CheckpointSettings(storage=str(tmp_path / "checkpoints"))
    state = rocks(tmp_path / "a", "keyed-0")
    checkpointer = KeyedCheckpointer(settings, "keyed-0")
    store = CheckpointStore(settings.storage)
    metas = []
    for number in range(1, 5):
        feed(state, range(number * 5_000))
        # Compaction merges SST files: later checkpoints stop naming early ones.
        state._db.compact_range(None, None)
        ack = take(checkpointer, state, number, number - 1 if number > 1 else None)
        metas.append(commit(store, number, [ack]))
    deleted = store.retain(1)
    kept = metas[-1].files()
    on_disk = {f"shards/{p.name}" for p in (tmp_path / "checkpoints" / "shards").iterdir()}
    assert on_disk == kept
    assert set(deleted) - {f"checkpoints/{n:010d}.json" for n in range(1, 4)}
    fresh = rocks(tmp_path / "b", "keyed-0")
    KeyedCheckpointer(settings, "keyed-0").restore(store.load(4), fresh, EVERY)
    assert fresh.items() == truth(*(range(n * 5_000) for n in range(1, 5)))


def test_a_corrupt_or_missing_database_file_is_detected_and_skipped(tmp_path: Path) -> None:
    settings = CheckpointSettings(storage=str(tmp_path / "checkpoints"))
    state = rocks(tmp_path / "a", "keyed-0")
    checkpointer = KeyedCheckpointer(settings, "keyed-0")
    store = CheckpointStore(settings.storage)
    feed(state, range(3_000))
    meta1 = commit(store, 1, [take(checkpointer, state, 1, None)])
    feed(state, range(3_000, 6_000))
    meta2 = commit(store, 2, [take(checkpointer, state, 2, 1)])
    only2 = meta2.files() - meta1.files()
    sst = next(p for p in only2 if p.endswith(".sst"))
    path = tmp_path / "checkpoints" / sst
    path.write_bytes(path.read_bytes()[:-10] + b"0123456789")
    fresh = rocks(tmp_path / "b", "keyed-0")
    with pytest.raises(CheckpointCorrupt, match="does not match its checksum"):
        KeyedCheckpointer(settings, "keyed-0").restore(meta2, fresh, EVERY)
    assert store.latest_valid() == meta1
    path.unlink()
    with pytest.raises(CheckpointCorrupt, match="is missing"):
        store.verify(meta2)


def test_a_database_file_name_that_is_not_rocksdbs_is_refused(tmp_path: Path) -> None:
    """Names say where a restore writes a file: a path is refused when the metadata is read."""
    with pytest.raises(ValueError, match="not RocksDB file names"):
        database_from_json({"../../evil": {"path": "p", "sha256": "0", "size": 1}})
    store = CheckpointStore(str(tmp_path / "checkpoints"))
    with pytest.raises(CheckpointError, match="not a RocksDB file name"):
        store.write_database_file(1, "keyed-0", "a/b", b"")


def test_native_groups_cannot_be_restored_into_memory_state(tmp_path: Path) -> None:
    settings = CheckpointSettings(storage=str(tmp_path / "checkpoints"))
    state = rocks(tmp_path / "a", "keyed-0")
    feed(state, range(100))
    meta = commit(
        CheckpointStore(settings.storage),
        1,
        [take(KeyedCheckpointer(settings, "keyed-0"), state, 1, None)],
    )
    memory = AggregateState("sum", G, pa.int64())
    with pytest.raises(CheckpointError, match="not rocksdb"):
        KeyedCheckpointer(settings, "keyed-0").restore(meta, memory, EVERY)
    assert memory.key_count == 0


def test_a_checkpoint_whose_storage_fails_fails_and_the_next_uploads_everything(
    tmp_path: Path,
) -> None:
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the checkpoint directory should be")
    state = rocks(tmp_path / "a", "keyed-0")
    feed(state, range(1_000))
    checkpointer = KeyedCheckpointer(CheckpointSettings(storage=str(blocked / "ckpt")), "keyed-0")
    ack = checkpoint_now(checkpointer, Barrier(id=1, previous=None), state, EVERY)
    assert ack.error is not None and "cannot write" in ack.error
    assert state.items() == truth(range(1_000))
    # No checkpoint directory is left beside the database.
    assert sorted(p.name for p in state.directory.iterdir()) == ["db", "keyshift-state.json"]


@pytest.mark.parametrize("backend", ["memory", "rocksdb"])
def test_the_upload_runs_beside_the_loop_and_stores_the_state_at_the_barrier(
    tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snapshot is taken at `start`; the state goes on changing while the upload, held
    at its first write here, runs; the checkpoint restores the state as it was at `start`."""
    settings = CheckpointSettings(storage=str(tmp_path / "checkpoints"))
    state: Any = (
        rocks(tmp_path / "a", "keyed-0")
        if backend == "rocksdb"
        else (AggregateState("sum", G, pa.int64()))
    )
    fresh: Any = (
        rocks(tmp_path / "b", "keyed-0")
        if backend == "rocksdb"
        else (AggregateState("sum", G, pa.int64()))
    )
    feed(state, range(5_000))
    checkpointer = KeyedCheckpointer(settings, "keyed-0")
    store = checkpointer.store = CheckpointStore(settings.storage)
    writing, go_on = threading.Event(), threading.Event()
    write = store._write

    def held(relative: str, data: bytes) -> None:
        writing.set()
        go_on.wait(60)
        write(relative, data)

    monkeypatch.setattr(store, "_write", held)
    checkpointer.start(Barrier(id=1, previous=None), state, EVERY)
    try:
        wait_for(writing.is_set, 30, "the upload to start writing")
        assert checkpointer.finished() is None  # still uploading
        with pytest.raises(CheckpointProtocolError, match="while 1's upload runs"):
            checkpointer.start(Barrier(id=2, previous=1), state, EVERY)
        feed(state, range(4_000, 6_000))  # the loop goes on meanwhile
    finally:
        go_on.set()
    ack = checkpointer.wait()
    assert ack is not None and ack.error is None, ack
    assert 0 < ack.snapshot_seconds <= ack.seconds
    assert checkpointer.wait() is None  # nothing runs any more
    KeyedCheckpointer(settings, "keyed-0").restore(commit(store, 1, [ack]), fresh, EVERY)
    assert fresh.items() == truth(range(5_000))
    assert state.items() == truth(range(5_000), range(4_000, 6_000))
    if backend == "rocksdb":  # the local checkpoint is gone once uploaded
        assert sorted(p.name for p in state.directory.iterdir()) == ["db", "keyshift-state.json"]
