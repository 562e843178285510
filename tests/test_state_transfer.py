"""Tests of keyshift.runtime.state_transfer: whole key groups packed at an old owner and loaded at
a new one (SST files for RocksDB, Arrow IPC for memory), against per-key values computed
independently; and chunks that must be refused whole: torn, unsealed, forged, of a format the
receiving store cannot take.
"""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from keyshift.runtime import rocksdb_state
from keyshift.runtime.keyspace import key_groups
from keyshift.runtime.records import pack_raw, unpack_raw
from keyshift.runtime.rocksdb_state import (
    RocksAggregateState,
    RocksProcessState,
    RocksStateError,
    open_database,
    prepare_directory,
)
from keyshift.runtime.state import AggregateState, ProcessState
from keyshift.runtime.state_integrity import StateIntegrityError, StateSeal
from keyshift.runtime.state_transfer import (
    ARROW,
    SST,
    StateTransferError,
    export_changes,
    export_chunk,
    import_chunk,
)
from keyshift.runtime.state_values import ValueCodec
from tests.test_state import G, make_batch

SEAL = StateSeal(b"k" * 32)


def rocks_counts(root: Path, owner: str) -> RocksAggregateState:
    db = open_database(prepare_directory(root / owner, owner), block_cache_mb=8, write_buffer_mb=1)
    return RocksAggregateState("sum", G, pa.int64(), db, track_changes=True)


def fill(state: Any, rng: random.Random, records: int) -> tuple[Counter[int], Counter[int]]:
    """Apply random records in a few batches; return each key's count and sum, kept apart."""
    counts: Counter[int] = Counter()
    sums: Counter[int] = Counter()
    for _ in range(4):
        keys = [rng.randrange(20_000) for _ in range(records // 4)]
        values = [float(rng.randrange(100)) for _ in keys]
        state.apply(make_batch(keys, values), "key", "value")
        counts.update(keys)
        for key, value in zip(keys, values, strict=True):
            sums[key] += int(value)
    return counts, sums


def move(old: Any, new: Any, groups: list[int], bulk: bool) -> tuple[str, int]:
    """Move `groups` as the migration does: export, seal, drop; open, import."""
    payload, sent = export_chunk(old, groups, bulk)
    old.drop_groups(groups)
    got = import_chunk(new, SEAL.open(SEAL.seal(payload), "chunk"), "keyed/0")
    assert (got.keys, got.nbytes, got.groups) == (sent.keys, sent.nbytes, sorted(groups))
    return ("sst" if payload.find(b'"format": "sst"') >= 0 else "arrow"), sent.keys


@pytest.mark.parametrize("bulk", [True, False])
def test_many_rocksdb_groups_move_with_every_keys_value(tmp_path: Path, bulk: bool) -> None:
    rng = random.Random(7)
    old, new = rocks_counts(tmp_path, "keyed-0"), rocks_counts(tmp_path, "keyed-1")
    counts, sums = fill(old, rng, 40_000)
    moving = sorted(rng.sample(range(G), 40))
    hits_before = old.group_hits()[moving].copy()
    kinds = set()
    moved = 0
    for start in range(0, len(moving), 7):  # hot-first chunks hold groups in any order
        chunk = moving[start : start + 7][::-1]
        kind, keys = move(old, new, chunk, bulk)
        kinds.add(kind)
        moved += keys
    assert kinds == {"sst" if bulk else "arrow"}
    here, there = old.items(), new.items()
    assert not set(here) & set(there)
    assert {**here, **there} == dict(sums)
    groups = old.group_sizes() + new.group_sizes()
    assert groups.sum() == len(counts) == old.key_count + new.key_count
    assert new.key_count == moved == len(there)
    # Hotness moves with the groups (hot-first orders the next move by it).
    assert (new.group_hits()[moving] == hits_before).all()
    assert new.group_hits().sum() == sum(counts[k] for k in there)
    rows = new.snapshot_keys(list(there))
    assert dict(
        zip(rows.column("key").to_pylist(), rows.column("count").to_pylist(), strict=True)
    ) == {k: counts[k] for k in there}
    # The next incremental checkpoint writes the arrived groups whole.
    assert new.changes(moving).restored >= set(moving)
    # The new owner goes on from the moved values.
    key = next(iter(there))
    new.apply(make_batch([key], [5.0]), "key", "value")
    assert new.get(key) == sums[key] + 5
    assert not list((tmp_path / "keyed-0" / "transfer").glob("*"))
    assert not list((tmp_path / "keyed-1" / "transfer").glob("*"))


def test_process_state_values_move_in_sst_files(tmp_path: Path) -> None:
    codec = ValueCodec(allow_pickle=False)

    def store(owner: str) -> RocksProcessState:
        db = open_database(prepare_directory(tmp_path / owner, owner), 8, 1)
        return RocksProcessState(
            lambda s, r: ({"n": (s or {"n": 0})["n"] + 1, "last": r["key"]}, None),
            G,
            pa.string(),
            db,
            codec,
            track_changes=False,
        )

    old, new = store("keyed-0"), store("keyed-1")
    keys = [f"k{random.Random(3).randrange(500)}-{i % 300}" for i in range(3000)]
    old.apply(make_batch(keys, [0.0] * len(keys)), "key")
    truth = {k: {"n": n, "last": k} for k, n in Counter(keys).items()}
    kind, moved = move(old, new, list(range(G)), bulk=True)
    assert kind == "sst" and moved == len(truth)
    assert old.items() == {} and new.items() == truth


def test_memory_groups_move_as_arrow_whatever_bulk_says() -> None:
    rng = random.Random(1)
    old, new = AggregateState("sum", G, pa.int64()), AggregateState("sum", G, pa.int64())
    _, sums = fill(old, rng, 8000)
    kind, _ = move(old, new, list(range(0, G, 2)), bulk=True)
    assert kind == "arrow"
    assert {**old.items(), **new.items()} == dict(sums)


def test_torn_unsealed_or_forged_chunks_are_refused_and_load_nothing(tmp_path: Path) -> None:
    old, new = rocks_counts(tmp_path, "keyed-0"), rocks_counts(tmp_path, "keyed-1")
    fill(old, random.Random(2), 4000)
    payload, _ = export_chunk(old, list(range(8)), bulk=True)
    sealed = SEAL.seal(payload)
    with pytest.raises(StateIntegrityError, match="does not match its signature"):
        SEAL.open(sealed[: len(sealed) // 2], "state chunk from keyed/0")
    with pytest.raises(StateIntegrityError, match="does not match its signature"):
        SEAL.open(payload, "state chunk from keyed/0")  # never sealed
    with pytest.raises(StateIntegrityError, match="does not match its signature"):
        StateSeal(b"x" * 32).open(sealed, "state chunk from keyed/0")  # another job's key
    with pytest.raises(StateIntegrityError, match="too short"):
        SEAL.open(b"tiny", "state chunk from keyed/0")
    assert new.key_count == 0 and new.items() == {}


def test_chunks_a_store_cannot_take_are_refused_with_the_reason(tmp_path: Path) -> None:
    rocks = rocks_counts(tmp_path, "keyed-0")
    fill(rocks, random.Random(4), 4000)
    sst, _ = export_chunk(rocks, [1, 2], bulk=True)
    memory = AggregateState("sum", G, pa.int64())
    with pytest.raises(StateTransferError, match="not in RocksDB"):
        import_chunk(memory, sst, "keyed/0")
    target = rocks_counts(tmp_path, "keyed-1")
    bad: list[tuple[bytes, str]] = [
        (b"\x01", "too short"),
        (b"\xff\x00\x00\x00{}", "shorter than"),
        (pack_raw({"format": SST}, b""), "groups"),
        (pack_raw({"groups": [1], "format": "parquet"}, b""), "unknown format 'parquet'"),
        (pack_raw({"groups": [1, 2], "format": SST, "keys": [1], "hits": [1]}, b"x"), "match"),
        (b"\x02\x00\x00\x00[]", "not a JSON object"),
        (pack_raw({"groups": [1], "format": ARROW}, b"not arrow"), "malformed state chunk"),
    ]
    for payload, reason in bad:
        with pytest.raises(StateTransferError, match=reason):
            import_chunk(target, payload, "keyed/0")
    # A torn SST file inside a well-formed header: RocksDB refuses it, nothing is counted.
    header = {"groups": [1, 2], "format": SST, "keys": [3, 4], "hits": [3, 4]}
    with pytest.raises(RocksStateError, match="cannot ingest the state file"):
        import_chunk(target, pack_raw(header, b"SST?" * 100), "keyed/0")
    assert target.key_count == 0 and int(np.sum(target.group_sizes())) == 0
    assert target.items() == {} and not list((tmp_path / "keyed-1" / "transfer").glob("*"))


def test_a_group_whose_keys_do_not_match_its_count_is_never_shipped(tmp_path: Path) -> None:
    """The export reads as many keys as the group counts; if the count were wrong it would
    ship a neighbour's keys or leave some behind, so the range's bounds are checked."""
    state = rocks_counts(tmp_path, "keyed-0")
    fill(state, random.Random(5), 4000)
    group = int(np.flatnonzero(state.group_sizes())[0])
    for wrong in (1, -1):
        state._group_keys[group] += wrong  # a bookkeeping bug, simulated
        with pytest.raises(RocksStateError, match=f"key group {group} does not hold"):
            export_chunk(state, [group], bulk=True)
        state._group_keys[group] -= wrong
    _, sent = export_chunk(state, [group], bulk=True)
    assert sent.keys == state.group_sizes()[group] > 0
    assert not list((tmp_path / "keyed-0" / "transfer").glob("*"))


def delete_on_negative(state: Any, record: dict[str, Any]) -> tuple[Any, None]:
    """A process function: counts a key's records, and a negative value deletes its state."""
    return (None, None) if record["value"] < 0 else ((state or 0) + 1, None)


@pytest.mark.parametrize("backend", ["memory", "rocksdb"])
def test_changes_since_a_checkpoint_bring_a_preloaded_copy_up_to_date(
    tmp_path: Path, backend: str
) -> None:
    """A hand-over's switch: the new owner holds the groups as a checkpoint had them; the old
    owner's changes since (updates, new keys, deletions) make it equal to the old owner's
    state, and a key the new owner fetched meanwhile (and went on updating) is left alone."""
    codec = ValueCodec(allow_pickle=False)

    def store(owner: str) -> Any:
        if backend == "memory":
            return ProcessState(delete_on_negative, G, pa.int64(), codec)
        db = open_database(prepare_directory(tmp_path / owner, owner), 8, 1)
        return RocksProcessState(delete_on_negative, G, pa.int64(), db, codec, True)

    rng = random.Random(5)
    old, new = store("keyed-0"), store("keyed-1")
    old.apply(make_batch([rng.randrange(3000) for _ in range(6000)], [1.0] * 6000), "key")
    moving = list(range(0, G, 2))
    checkpoint = old.snapshot_groups(moving)  # the state at the checkpoint's barrier
    old.clear_changes()
    keys = [rng.randrange(4000) for _ in range(3000)]  # updates, new keys, deletions
    old.apply(make_batch(keys, [-1.0 if k % 7 == 0 else 1.0 for k in keys]), "key")
    new.restore(checkpoint)  # the preload
    in_moving = {k for k in keys if k % 7 == 0 and group_of(k) in moving}
    fetched = sorted(in_moving)[0] if in_moving else None
    keep: set[Any] = set()
    if fetched is not None:  # fetched on demand: deleted at the old owner, absent there
        keep.add(fetched)
        new.drop_keys([fetched])
        new.apply(make_batch([fetched], [1.0]), "key")
    payload, sent = export_changes(old, moving)
    assert unpack_raw(payload)[0]["deleted"], "no deletion since the checkpoint: proves less"
    with pytest.raises(StateTransferError, match="did not preload them"):
        import_chunk(store("keyed-2"), payload, "keyed/0")
    got = import_chunk(new, payload, "keyed/0", keep)
    assert got.groups == moving and got.keys == sent.keys > 0
    expected = {k: v for k, v in old.items().items() if group_of(k) in moving}
    if fetched is not None:
        expected[fetched] = 1
    assert new.items() == expected


def group_of(key: int) -> int:
    return int(key_groups(pa.array([key], pa.int64()), G)[0])


def test_past_the_marked_keys_budget_rocksdb_state_asks_for_every_group_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RocksDB state outgrows memory, its change marks must not: past MAX_MARKED_KEYS keys
    marked since the last checkpoint it stops marking and says every group has no delta (a
    hand-over then pushes them whole), until the next checkpoint clears the marks."""
    monkeypatch.setattr(rocksdb_state, "MAX_MARKED_KEYS", 50)
    codec = ValueCodec(allow_pickle=False)
    db = open_database(prepare_directory(tmp_path / "keyed-0", "keyed-0"), 8, 1)
    state = RocksProcessState(delete_on_negative, G, pa.int64(), db, codec, True)
    state.apply(make_batch(list(range(40)), [1.0] * 40), "key")
    assert state.changes(range(G)).restored == set()  # within the budget: deltas known
    state.apply(make_batch(list(range(40, 100)), [1.0] * 60), "key")
    state.apply(make_batch([1], [1.0]), "key")
    changes = state.changes(range(G))
    assert changes.restored == set(range(G)) and changes.upserts.num_rows == 0
    state.clear_changes()  # a checkpoint's barrier
    state.apply(make_batch([7], [1.0]), "key")
    changes = state.changes(range(G))
    assert changes.restored == set() and changes.upserts.num_rows == 1
