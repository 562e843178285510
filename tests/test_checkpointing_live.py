"""Aligned checkpoints of a running job (keyshift.runtime.checkpointing), with real processes.

Checkpoints are taken every half second while two generator sources feed a keyed count over
two, then (after a hot-first rescale) three instances. Every retained checkpoint must be a
consistent cut: the keyed state rebuilt from its files equals the counts of exactly the
records its source positions name, and the sinks' output up to its offsets ends in that same
state. A checkpoint whose storage fails is reported, processing goes on, and the job reports
degraded after enough failures in a row.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from keyshift.runtime.checkpoint_store import CheckpointStore
from keyshift.runtime.output_log import OutputLogReader
from keyshift.runtime.state import AggregateState
from keyshift.runtime.state_checkpoint import read_groups
from keyshift.runtime.transport import JsonClient
from tests.conftest import count_job, running_job, wait_for
from tests.test_rescale import SERVICE, check_counts, rescale_via, sum_out, truth

pytestmark = pytest.mark.live

# Runs until drained: checkpoints before and after a rescale however long that takes, and
# no waiting for a total after what a test checks.
SOURCE = {"kind": "generator", "keys": 3000, "distribution": "zipf", "seed": 9,
          "profile": {"rate": 10000}}  # fmt: skip
GROUPS = 256


def checkpointed_job(out: Path, storage: str, **checkpoints: Any) -> dict[str, Any]:
    return count_job(
        max_key_groups=GROUPS,
        source={"parallelism": 2, "config": SOURCE},
        keyed={"name": "counts", "parallelism": 2},
        sink={"parallelism": 2, "config": {"kind": "log", "path": str(out), "format": "jsonl",
                                           "segment_records": 5000}},
        batching={"max_records": 1024},
        checkpoints={"interval": 0.5, "storage": storage, "retain": 50, **checkpoints},
    )  # fmt: skip


def checkpoints_of(local: Any) -> dict[str, Any]:
    return local.status()["checkpoints"]


def test_every_checkpoint_is_a_consistent_cut_through_a_rescale(tmp_path: Path) -> None:
    out, storage = tmp_path / "out", tmp_path / "checkpoints"
    with running_job(tmp_path, checkpointed_job(out, str(storage))) as local:
        wait_for(lambda: checkpoints_of(local)["completed"] >= 3, 60, "three checkpoints")
        client = JsonClient(local.address, SERVICE)
        try:
            rescale_via(local, client, 3, "hot-first", stage="counts")
        finally:
            client.close()
        done = checkpoints_of(local)["completed"]
        wait_for(lambda: checkpoints_of(local)["completed"] >= done + 3, 60, "more checkpoints")
        local.drain()
        wait_for(lambda: local.status()["phase"] == "finished", 120, "the job to drain")
        status = checkpoints_of(local)
    assert status["failed"] == 0 and not status["degraded"]
    store = CheckpointStore(str(storage))
    ids = store.completed()
    assert len(ids) >= 6
    log = OutputLogReader(out)
    epochs = set()
    for checkpoint in ids:
        meta = store.load(checkpoint)
        epochs.add(meta.epochs["counts"])
        assert sorted(meta.groups) == list(range(GROUPS))
        positions = [meta.sources[str(s)] for s in range(2)]
        expected, _ = truth(SOURCE, positions)
        state = AggregateState("count", GROUPS, pa.int64())
        state.restore(read_groups(store, meta.groups, state.snapshot_groups([]).schema))
        assert state.items() == dict(expected), f"checkpoint {checkpoint} is not a cut"
        # The output up to the checkpoint's offsets ends in the same counts.
        latest: Counter[int] = Counter()
        for partition, offset in meta.outputs.items():
            table = log.read(int(partition), 0, offset)
            for key, version in zip(
                table["key"].to_pylist(), table["version"].to_pylist(), strict=True
            ):
                latest[key] = max(latest[key], version)
        assert dict(latest) == dict(expected)
    assert len(epochs) == 2  # checkpoints before and after the rescale
    sizes = [store.load(c).written for c in ids[1:]]
    full = store.load(ids[-1])
    assert min(sizes) < full.size()


def test_failing_checkpoint_storage_degrades_the_job_and_processing_goes_on(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file where the checkpoint directory should be")
    job = checkpointed_job(out, str(blocked / "checkpoints"), degraded_after=2)
    with running_job(tmp_path, job) as local:
        wait_for(lambda: checkpoints_of(local)["degraded"], 60, "the job to report degraded")
        status = checkpoints_of(local)
        assert status["completed"] == 0 and status["failed"] >= 2
        # Storage that fails from the start cannot even list earlier checkpoints: none is
        # numbered, each attempt fails with that reason.
        assert "cannot list the checkpoints taken before" in status["last"]["error"]
        flowed = sum_out(local)
        wait_for(lambda: sum_out(local) > flowed + 5000, 60, "records to flow while degraded")
        local.drain()
        final = wait_for(
            lambda: (s := local.status())["phase"] == "finished" and s, 120, "the job to drain"
        )
    # Processing went on: every record the sources emitted is counted, each key's exactly.
    emitted = [i["stats"]["emitted"] for i in final["stages"][0]["instances"]]
    check_counts(out, SOURCE, emitted)
