"""The RocksDB state backend's own cases (keyshift.runtime.rocksdb_state): its directories, and
a job whose state path cannot be used. The behaviour it shares with the memory backend (values,
snapshots, migration, checkpoints, live rescales and recovery) is tested by running those
suites on both backends (tests/test_state.py, test_checkpoints.py, test_rescale.py,
test_recovery.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import yaml

from keyshift.runtime.checkpointing import KeyedCheckpointer
from keyshift.runtime.job import CheckpointSettings, JobError, parse_job
from keyshift.runtime.protocol import Barrier
from keyshift.runtime.records import GROUP
from keyshift.runtime.rocksdb_state import (
    COPY_CHUNK,
    MARKER,
    RocksAggregateState,
    RocksStateError,
    open_database,
    prepare_directory,
)
from tests.conftest import cli
from tests.small_disk import small_disk
from tests.test_rocksdb_checkpoint import checkpoint_now
from tests.test_state import G, make_batch


def counts(path: Path, owner: str = "keyed-0") -> RocksAggregateState:
    db = open_database(prepare_directory(path, owner), block_cache_mb=8, write_buffer_mb=1)
    return RocksAggregateState("count", G, pa.int64(), db, track_changes=False)


def test_a_restarted_instance_starts_from_an_empty_database(tmp_path: Path) -> None:
    """What a crashed incarnation left is older than the checkpoint the instance loads."""
    state = counts(tmp_path / "keyed-0")
    state.apply(make_batch([1, 2, 2], [0.0] * 3), "key", None)
    assert state.items() == {1: 1, 2: 2}
    state.close()
    again = counts(tmp_path / "keyed-0")
    assert again.items() == {} and again.key_count == 0


def test_a_directory_that_is_not_this_instances_state_is_refused(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "precious.txt").write_text("not ours")
    with pytest.raises(RocksStateError, match="not a keyshift state directory"):
        counts(foreign)
    assert (foreign / "precious.txt").read_text() == "not ours"

    counts(tmp_path / "shared", owner="keyed-0").close()
    with pytest.raises(RocksStateError, match="give each keyed instance its own state path"):
        counts(tmp_path / "shared", owner="keyed-1")
    assert (tmp_path / "shared" / MARKER).exists()

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with pytest.raises(RocksStateError, match=r"cannot use .* for RocksDB state"):
        counts(blocked / "below")


def test_state_settings_are_checked_with_the_job(tmp_path: Path) -> None:
    job = {"name": "j", "keyed": {"state": {"backend": "rocksdb", "block_cache_mb": 1}}}
    with pytest.raises(JobError, match="block_cache_mb"):
        parse_job(job)
    with pytest.raises(JobError, match="backend"):
        parse_job({"name": "j", "keyed": {"state": {"backend": "leveldb"}}})
    spec = parse_job({"name": "j", "keyed": {"state": {"backend": "rocksdb"}}})
    assert spec.keyed.state.path == "state" and spec.keyed.state.backend == "rocksdb"
    assert parse_job({"name": "j"}).keyed.state.backend == "memory"


@pytest.mark.live
def test_a_job_whose_state_path_cannot_be_used_fails_at_start_naming_it(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    job = {
        "name": "unusable",
        "source": {"config": {"kind": "generator", "keys": 100, "total": 1000}},
        "keyed": {"state": {"backend": "rocksdb", "path": str(tmp_path / "a-file" / "state")}},
        "sink": {"config": {"kind": "log", "path": str(tmp_path / "out"), "format": "jsonl"}},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    with cli(["run", str(tmp_path / "job.yaml"), "--no-view", "--log-dir", str(tmp_path)]) as proc:
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    assert "RocksStateError" in out and "for RocksDB state" in out, out


def test_a_full_disk_stops_the_writes_with_an_error_naming_it_and_loses_nothing(
    tmp_path: Path,
) -> None:
    """A batch that does not fit fails whole (the instance stops, and the job recovers from
    its last checkpoint); what was written before stays readable, and a checkpoint on the
    full disk fails with the reason instead of writing a partial one."""
    with small_disk(tmp_path / "disk", "4m") as disk:
        state = counts(disk / "keyed-0")
        written = 0
        with pytest.raises(RocksStateError, match=r"cannot write RocksDB state at .*No space left"):
            while written < 10_000_000:
                state.apply(
                    make_batch(list(range(written, written + 5000)), [0.0] * 5000), "key", None
                )
                written += 5000
        assert state.key_count == written
        assert state.get(0) == 1 and state.get(written - 1) == 1 and state.get(written) is None
        checkpointer = KeyedCheckpointer(
            CheckpointSettings(storage=str(tmp_path / "checkpoints")), "keyed-0"
        )
        ack = checkpoint_now(
            checkpointer, Barrier(id=1, previous=None), state, np.ones(G, dtype=bool)
        )
        assert ack.error is not None and "No space left" in ack.error, ack
        assert state.key_count == written
        with pytest.raises(Exception, match="No space left"):
            state.close()  # its memtable cannot be flushed either


def test_a_marker_that_cannot_be_read_is_refused_and_kept(tmp_path: Path) -> None:
    """A corrupt keyshift-state.json: whose state this is cannot be told, so nothing is
    deleted."""
    counts(tmp_path / "keyed-0").close()
    (tmp_path / "keyed-0" / MARKER).write_text("{not json")
    with pytest.raises(RocksStateError, match=r"cannot be read.*refusing to use or delete it"):
        counts(tmp_path / "keyed-0")
    assert (tmp_path / "keyed-0" / "db").is_dir()


def test_a_checkpoints_groups_are_copied_whole_in_bounded_batches(tmp_path: Path) -> None:
    """A group larger than a copy batch (COPY_CHUNK keys) arrives whole, and only the groups
    asked for: the range read stops at the group's end."""
    groups = 2
    keys = list(range(3 * COPY_CHUNK))
    batch = make_batch(keys + keys[:7], [0.0] * (len(keys) + 7), max_key_groups=groups)

    def store(owner: str) -> RocksAggregateState:
        path = prepare_directory(tmp_path / owner, owner)
        db = open_database(path, block_cache_mb=8, write_buffer_mb=1)
        return RocksAggregateState("count", groups, pa.int64(), db, track_changes=False)

    state = store("keyed-0")
    state.apply(batch, "key", None)
    sizes = state.group_sizes()
    assert sizes.min() > COPY_CHUNK  # each group takes several copy batches
    state.checkpoint_into(tmp_path / "copy")
    state.close()
    restored = store("keyed-1")
    assert restored.copy_groups(tmp_path / "copy", [0]) == sizes[0] == restored.key_count
    in_group = batch.column(GROUP).to_numpy()[: len(keys)] == 0
    assert restored.items() == {k: 2 if k < 7 else 1 for k in np.asarray(keys)[in_group].tolist()}
