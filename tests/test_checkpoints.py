"""Checkpoint storage and incremental keyed-state checkpoints (keyshift.runtime.checkpoint_store,
keyshift.runtime.state_checkpoint), on a local directory and on S3 through s3fs against moto's
S3 server running as a real HTTP process on loopback.

Each test writes real state shards, commits metadata, and rebuilds state from a checkpoint
into an empty store, which must equal the state it was taken from. With moto's server stopped,
every operation is a retryable CheckpointError, and `retrying` waits until it is back.
"""

from __future__ import annotations

import logging
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
    GroupChain,
    KeyedGroups,
    SinkOutputs,
)
from keyshift.runtime.state_checkpoint import (
    WrittenGroups,
    read_groups,
    snapshot_groups,
    store_groups,
)
from keyshift.runtime.storage import retrying
from tests.conftest import wait_for
from tests.s3_server import MotoServer, create_bucket, s3_bucket, s3_options
from tests.test_state import (  # noqa: F401 (backend is a fixture)
    AggregateStore,
    G,
    backend,
    make_batch,
    new_process_state,
    new_state,
)

ALL_GROUPS = list(range(G))


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.live)])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> CheckpointStore:
    if request.param == "local":
        return CheckpointStore(str(tmp_path / "checkpoints"))
    endpoint = request.getfixturevalue("s3_endpoint")
    bucket = s3_bucket(endpoint, "ckpt")
    return CheckpointStore(f"s3://{bucket}/job-a", s3_options(endpoint))


def zipf_keys(n: int, keys: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.zipf(1.3, n) - 1) % keys


def aggregate(n: int = 50_000, keys: int = 10_000) -> AggregateStore:
    state = new_state("sum")
    ks = zipf_keys(n, keys, 1)
    state.apply(make_batch(ks.tolist(), (ks % 7).astype(float).tolist()), "key", "value")
    return state


def write(
    store: CheckpointStore,
    number: int,
    writer: str,
    state: Any,
    groups: list[int],
    chains: dict[int, GroupChain],
    complete: bool,
    max_chain: int = 8,
) -> WrittenGroups:
    """A keyed instance's shard checkpoint: the snapshot at the barrier, then its upload."""
    snapshot = snapshot_groups(state, groups, chains, complete, max_chain)
    return store_groups(store, number, writer, snapshot)


def checkpoint(
    store: CheckpointStore,
    state: Any,
    number: int,
    previous: CheckpointMeta | None,
    complete: bool = True,
    max_chain: int = 8,
) -> tuple[CheckpointMeta, int]:
    chains = previous.groups if previous else {}
    written = write(store, number, "keyed-0", state, ALL_GROUPS, chains, complete, max_chain)
    size = written.shard.size if written.shard else 0
    meta = CheckpointMeta(id=number, created=time.time(), groups=written.chains, written=size)
    store.commit(meta)
    return meta, size


def restored(store: CheckpointStore, meta: CheckpointMeta, fresh: Any) -> dict[Any, Any]:
    schema = fresh.snapshot_groups([]).schema
    fresh.restore(read_groups(store, meta.groups, schema))
    return fresh.items()


@pytest.mark.usefixtures("backend")
def test_incremental_checkpoints_write_the_changed_keys_and_restore_exactly(
    store: CheckpointStore,
) -> None:
    state = aggregate()
    first, full = checkpoint(store, state, 1, None)
    # A skewed second interval: only the 20 hottest keys change.
    hot = list(range(20)) * 50
    state.apply(make_batch(hot, [1.0] * len(hot), first_seq=10**6), "key", "value")
    _, delta = checkpoint(store, state, 2, store.load(1))
    assert delta < full / 20, f"delta {delta} B vs full {full} B"
    assert store.completed() == [1, 2]
    assert restored(store, store.load(2), new_state("sum")) == state.items()
    assert restored(store, first, new_state("sum")) != state.items()


@pytest.mark.usefixtures("backend")
def test_deleted_keys_leave_tombstones_and_stay_deleted(store: CheckpointStore) -> None:
    def keep_positive(state: Any, record: dict[str, Any]) -> tuple[Any, Any]:
        total = (state or 0) + record["value"]
        return (total if total > 0 else None), None

    state = new_process_state(keep_positive, pa.int64())
    state.apply(make_batch(list(range(100)), [5.0] * 100), "key")
    checkpoint(store, state, 1, None)
    state.apply(make_batch([3, 4, 200], [-10.0, 1.0, 2.0], first_seq=100), "key")
    meta, _ = checkpoint(store, state, 2, store.load(1))
    rebuilt = restored(store, meta, new_process_state(keep_positive, pa.int64()))
    assert 3 not in rebuilt and rebuilt[4] == 6.0 and rebuilt[200] == 2.0
    assert rebuilt == state.items()


@pytest.mark.usefixtures("backend")
def test_a_group_gets_a_base_after_a_migration_a_failed_checkpoint_or_a_long_chain(
    tmp_path: Path,
) -> None:
    store = CheckpointStore(str(tmp_path))
    state = aggregate(5_000, 500)
    meta, _ = checkpoint(store, state, 1, None)
    chain_lengths = {len(c.files) for c in meta.groups.values()}
    assert chain_lengths == {1}
    hot = [0] * 10
    for number in (2, 3):
        state.apply(make_batch(hot, [1.0] * 10, first_seq=number * 100), "key", "value")
        meta, _ = checkpoint(store, state, number, meta, max_chain=3)
    group = next(g for g, c in meta.groups.items() if len(c.files) == 3)
    # The chain of the hot key's group is full: the next change compacts it into a base.
    state.apply(make_batch(hot, [1.0] * 10, first_seq=400), "key", "value")
    meta, _ = checkpoint(store, state, 4, meta, max_chain=3)
    assert len(meta.groups[group].files) == 1
    # Keys arriving by migration: their group's next checkpoint is a base.
    other = new_state("sum")
    other.restore(state.snapshot_groups([group]))
    written = write(store, 5, "keyed-1", other, [group], {group: meta.groups[group]}, True)
    assert (written.base_groups, written.delta_groups) == (1, 0)
    # This instance's last checkpoint did not complete: everything is a base.
    written = write(store, 6, "keyed-0", state, ALL_GROUPS, meta.groups, False)
    assert written.base_groups == G


@pytest.mark.usefixtures("backend")
def test_a_corrupt_or_partial_checkpoint_is_skipped_for_the_previous_one(
    store: CheckpointStore, caplog: pytest.LogCaptureFixture
) -> None:
    state = aggregate(5_000, 500)
    first, _ = checkpoint(store, state, 1, None)
    state.apply(make_batch([1, 2], [1.0, 1.0], first_seq=10**6), "key", "value")
    second, _ = checkpoint(store, state, 2, first)
    (new_shard,) = second.files() - first.files()
    path = f"{store.root}/{new_shard}"
    store.fs.pipe_file(path, store.fs.cat_file(path)[:-10])  # a partial write
    assert store.latest_valid() == first
    assert store.skipped == 1 and "skipping checkpoint 2" in caplog.text
    with pytest.raises(CheckpointCorrupt, match="does not match its checksum"):
        store.verify(second)
    metadata = f"{store.root}/checkpoints/{1:010d}.json"
    store.fs.pipe_file(metadata, store.fs.cat_file(metadata).replace(b'"id', b'"ID'))
    assert store.latest_valid() is None


@pytest.mark.usefixtures("backend")
def test_retention_keeps_the_newest_checkpoints_and_the_files_they_name(
    store: CheckpointStore,
) -> None:
    state = aggregate(5_000, 500)
    meta = None
    for number in range(1, 6):
        state.apply(make_batch([number], [1.0], first_seq=number * 10), "key", "value")
        meta, _ = checkpoint(store, state, number, meta)
    orphan = store.write_shard(3, "keyed-9", pa.table({"x": [1]}))  # a failed checkpoint's
    in_flight = store.write_shard(6, "keyed-0", pa.table({"x": [1]}))  # one being written
    deleted = store.retain(keep=2)
    assert store.completed() == [4, 5]
    assert orphan.path in deleted and in_flight.path not in deleted
    with pytest.raises(CheckpointCorrupt, match="is missing"):
        store.load(1)
    # The base of checkpoint 1 is still named by checkpoint 5's chains: it stays.
    kept = store.load(5).files() | store.load(4).files()
    assert all(store.fs.exists(f"{store.root}/{path}") for path in kept)
    latest = store.latest_valid()
    assert latest is not None
    assert restored(store, latest, new_state("sum")) == state.items()


@pytest.mark.usefixtures("backend")
def test_each_keyed_stage_of_a_graph_restores_its_own_groups(store: CheckpointStore) -> None:
    """A job of two keyed stages: the first's groups and owners are the checkpoint's `groups`
    and `assignment`, the second's are under `later`; each stage restores its own, and
    retention keeps the files of both."""
    first, second = aggregate(5_000, 500), aggregate(3_000, 300)
    ours = write(store, 1, "a-0", first, ALL_GROUPS, {}, True)
    theirs = write(store, 1, "b-0", second, ALL_GROUPS, {}, True)
    owners = {"epoch": 3, "owners": [0] * G}
    meta = CheckpointMeta(
        id=1,
        created=time.time(),
        epochs={"a": 1, "b": 3},
        assignment={"epoch": 1, "owners": [0] * G},
        groups=ours.chains,
        later={"b": KeyedGroups(owners, theirs.chains)},
    )
    store.commit(meta)
    loaded = store.load(1)
    assert loaded == meta
    assert loaded.of_stage("a") is loaded
    b = loaded.of_stage("b")
    assert b.assignment == owners and b.groups == theirs.chains and b.later == {}
    assert restored(store, loaded.of_stage("a"), new_state("sum")) == first.items()
    assert restored(store, b, new_state("sum")) == second.items()
    store.retain(keep=1)
    assert {f.path for f in theirs.chains[0].files} <= store.load(1).files()
    assert all(store.fs.exists(f"{store.root}/{path}") for path in store.load(1).files())


def test_a_checkpoint_of_the_format_before_graphs_still_loads() -> None:
    body = CheckpointMeta(7, 1.0, assignment={"epoch": 2, "owners": [0]}).to_json()
    del body["later"]
    body["format"] = 2
    meta = CheckpointMeta.from_json(body)
    assert meta.later == {} and meta.of_stage("counts") is meta
    assert meta.assignment == {"epoch": 2, "owners": [0]}


def test_each_sink_keeps_its_own_offsets_and_owners_and_older_checkpoints_read_as_one() -> None:
    """The first sink's offsets and owners are the top level's (as in a job of one sink); a
    later sink's are under `later_sinks`, each restored by its name."""
    owners = {"epoch": 2, "owners": [0, 1]}
    meta = CheckpointMeta(
        3,
        1.0,
        outputs={"0": 10, "1": 12},
        partitions={"epoch": 1, "owners": [0, 0]},
        later_sinks={"copy": SinkOutputs({"0": 4, "1": 5}, owners)},
    )
    loaded = CheckpointMeta.from_json(meta.to_json())
    assert loaded == meta
    assert loaded.of_sink("out") == SinkOutputs({"0": 10, "1": 12}, {"epoch": 1, "owners": [0, 0]})
    assert loaded.of_sink("copy") == SinkOutputs({"0": 4, "1": 5}, owners)
    older = meta.to_json()
    del older["later_sinks"]
    assert CheckpointMeta.from_json(older).of_sink("out").outputs == {"0": 10, "1": 12}


def test_unusable_storage_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="cannot use checkpoint storage 'nope://x'"):
        CheckpointStore("nope://x")
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    store = CheckpointStore(str(blocked / "below"))
    with pytest.raises(CheckpointError, match="cannot write"):
        store.write_shard(1, "keyed-0", pa.table({"x": [1]}))
    with pytest.raises(CheckpointError, match="writer name 'Keyed 0'"):
        store.write_shard(1, "Keyed 0", pa.table({"x": [1]}))
    with pytest.raises(CheckpointCorrupt, match="is missing"):
        CheckpointStore(str(tmp_path)).load(7)
    assert GroupChain(()).size == 0


@pytest.mark.live
def test_an_unreachable_s3_is_a_retryable_error_that_retrying_waits_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """s3fs lets botocore's EndpointConnectionError through: the store turns it into its own
    error, for listings, writes and reads alike."""
    with MotoServer() as server:
        bucket = s3_bucket(server.url, "down")
        store = CheckpointStore(f"s3://{bucket}/job", s3_options(server.url))
        store.commit(CheckpointMeta(1, time.time()))
        server.stop()
        for operation in (
            store.completed,
            lambda: store.write_shard(2, "keyed-0", pa.table({"x": [1]})),
            lambda: store.commit(CheckpointMeta(2, time.time())),
            lambda: store.load(1),
        ):
            with pytest.raises(CheckpointError, match="Could not connect to the endpoint") as e:
                operation()
            assert e.value.retryable
        listed: list[list[int]] = []
        waiting = threading.Thread(
            target=lambda: listed.append(retrying(store.completed, "listing")), daemon=True
        )
        with caplog.at_level(logging.WARNING, logger="keyshift.storage"):
            waiting.start()
            wait_for(lambda: "listing: cannot list" in caplog.text, 60, "a failed listing")
            assert not listed
            server.start()
            create_bucket(server.url, bucket)  # moto lost its buckets with its process
            waiting.join(timeout=120)
        assert listed == [[]]  # listed once S3 was back (empty: moto lost what it held)
