"""A sink instance's output partitions and its side of a rescale of the sink, on real output
logs in a temporary directory (keyshift.runtime.sink_partitions), and the coordinator's
refusals of rescales that cannot be (keyshift.runtime.coordinator), and the CLI's summary of
one: what a rescale of the sink relies on, without starting processes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pyarrow as pa
import pytest

from keyshift.operator.cli import describe_rescale
from keyshift.runtime.coordinator import Coordinator
from keyshift.runtime.job import LogSink, parse_job
from keyshift.runtime.output_log import OutputLogReader
from keyshift.runtime.protocol import MovePartitions, RescaleRequest
from keyshift.runtime.records import GROUP
from keyshift.runtime.rescale import RescaleStatus
from keyshift.runtime.sink_partitions import PartitionError, SinkPartitions
from keyshift.runtime.sink_router import partition_owners
from keyshift.runtime.transport import ControlError
from tests.conftest import count_job


def updates(groups: list[int], first: int) -> pa.RecordBatch:
    """Updates of key groups `groups`, their values numbered from `first` (the order made)."""
    n = len(groups)
    return pa.RecordBatch.from_pydict(
        {
            "key": pa.array(groups, pa.int64()),
            "value": pa.array(range(first, first + n), pa.int64()),
            GROUP: pa.array(groups, pa.int32()),
        }
    )


def write(parts: SinkPartitions, batch: pa.RecordBatch) -> None:
    for partition, records in parts.split(batch):
        parts.writers[partition].append(records)


def attempt(write: Callable[[], object]) -> bool:
    """The sink's write attempt, on a disk that takes every write."""
    write()
    return True


def test_a_partition_handed_over_keeps_one_writer_and_the_order_made(tmp_path: Path) -> None:
    config = LogSink(path=str(tmp_path), segment_records=4)
    owners = partition_owners(2, 1)
    old = SinkPartitions(config, 0, owners, {})
    new = SinkPartitions(config, 1, owners, {})
    assert (old.owned, new.owned) == ({0, 1}, set())
    write(old, updates([1, 0, 3], 0))  # partition 1 gets values 0 and 2
    move = MovePartitions(epoch=2, owners=partition_owners(2, 2, 2).to_json())
    old.prepare(move)
    new.prepare(move)
    # A sender rerouted: what it sends now for partition 1 waits at the new owner...
    write(new, updates([5, 7], 10))
    assert new.move is not None and len(new.move.parked[1]) == 1
    # ... while what another sender routed by the old owners still comes to the old one.
    write(old, updates([9], 20))
    assert not old.close_leaving({"track/0", "track/1"}, attempt)
    old.marker("track/0", json.dumps({"epoch": 2}).encode())
    old.marker("track/1", json.dumps({"epoch": 1}).encode())  # an earlier epoch's: not this one
    assert not old.close_leaving({"track/0", "track/1"}, attempt)
    old.marker("track/1", None)  # its END ends every epoch
    assert old.close_leaving({"track/0", "track/1"}, attempt)
    assert old.owned == {0} and not old.moving
    for partition, batch in new.open([1]):
        new.writers[partition].append(batch)
    assert new.owned == {1} and not new.moving
    new.flush()
    old.flush()
    table = OutputLogReader(tmp_path).read(1, 0)
    assert table.column("value").to_pylist() == [0, 2, 20, 10, 11]
    assert table.column("offset").to_pylist() == list(range(5))


def test_records_of_a_partition_neither_owned_nor_coming_are_refused(tmp_path: Path) -> None:
    parts = SinkPartitions(LogSink(path=str(tmp_path)), 1, partition_owners(4, 2), {})
    assert parts.owned == {2, 3}
    with pytest.raises(PartitionError, match="records of output partition 1, which sink instance"):
        parts.split(updates([2, 1], 0))


def test_a_move_that_does_not_fit_is_refused(tmp_path: Path) -> None:
    parts = SinkPartitions(None, 0, partition_owners(2, 1), {})
    with pytest.raises(PartitionError, match="names 3 partitions, not 2"):
        parts.prepare(MovePartitions(epoch=2, owners=partition_owners(3, 1, 2).to_json()))
    with pytest.raises(PartitionError, match="no such move here"):
        parts.open([1])
    parts.prepare(MovePartitions(epoch=2, owners=partition_owners(2, 2, 2).to_json()))
    with pytest.raises(PartitionError, match="while another move runs"):
        parts.prepare(MovePartitions(epoch=3, owners=partition_owners(2, 1, 3).to_json()))


def test_a_restore_truncates_each_owned_partition_to_the_checkpoint(tmp_path: Path) -> None:
    config = LogSink(path=str(tmp_path), segment_records=2)
    first = SinkPartitions(config, 0, partition_owners(2, 1), {})
    write(first, updates([0, 1, 2, 3, 4, 5], 0))
    first.flush()
    assert first.end_offsets == {"0": 3, "1": 3}
    again = SinkPartitions(config, 0, partition_owners(2, 1), {"0": 2, "1": 0})
    assert again.end_offsets == {"0": 2, "1": 0}


def refusal(job: dict[str, object], request: RescaleRequest) -> ControlError:
    coordinator = Coordinator(parse_job(job), 30.0)
    with pytest.raises(ControlError) as refused:
        coordinator.rescale(request)
    return refused.value


def test_rescales_that_cannot_be_are_refused_naming_the_reason() -> None:
    job = count_job(sink={"parallelism": 1, "partitions": 2})
    beyond = refusal(job, RescaleRequest(stage="sink", parallelism=3))
    assert beyond.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "from 1 to 2 (the sink writes 2 output partitions" in str(beyond)
    options = refusal(job, RescaleRequest(stage="sink", parallelism=2, options={"chunk_keys": 8}))
    assert "do not apply to the sink" in str(options)
    source = refusal(job, RescaleRequest(stage="source", parallelism=2))
    assert "is a source: its parallelism is bounded by its partitions" in str(source)
    unknown = refusal(job, RescaleRequest(stage="nope", parallelism=2))
    assert unknown.code == grpc.StatusCode.NOT_FOUND
    # A fitting request goes as far as the job's phase: the job has not started.
    starting = refusal(job, RescaleRequest(stage="sink", parallelism=2))
    assert "job is starting" in str(starting)


def test_each_sink_of_a_job_is_bounded_by_its_own_partitions() -> None:
    """Two sinks: a rescale names the sink it moves, bounded by that sink's partitions."""
    job: dict[str, object] = {
        "name": "two",
        "graph": [
            {"name": "clicks", "kind": "source"},
            {"name": "counts", "kind": "keyed", "input": "clicks", "key_by": "key"},
            {"name": "out", "kind": "sink", "input": "counts", "partitions": 4,
             "config": {"kind": "log", "path": "out/two"}},
            {"name": "copy", "kind": "sink", "input": "counts", "partitions": 2,
             "config": {"kind": "log", "path": "out/copy"}},
        ],
    }  # fmt: skip
    beyond = refusal(job, RescaleRequest(stage="copy", parallelism=3))
    assert beyond.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "stage 'copy' must be an integer from 1 to 2 (the sink writes 2" in str(beyond)
    options = refusal(job, RescaleRequest(stage="copy", parallelism=2, options={"chunk_keys": 8}))
    assert "do not apply to the sink" in str(options)
    assert "job is starting" in str(refusal(job, RescaleRequest(stage="out", parallelism=4)))
    coordinator = Coordinator(parse_job(job), 30.0)
    topology = coordinator._topology()
    assert {sink: len(owners["owners"]) for sink, owners in topology.partitions.items()} == {
        "out": 4,
        "copy": 2,
    }


def test_a_stateless_stage_is_refused_naming_the_stage_it_runs_in() -> None:
    job = count_job(source={"transforms": [{"filter": "tests.pipeline_fns:keep"}]})
    chained = refusal(job, RescaleRequest(stage="source-1", parallelism=2))
    assert chained.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "stateless filter chained into the processes of stage 'source'" in str(chained)


def test_the_partitions_stay_where_a_checkpoint_had_them() -> None:
    owners = partition_owners(4, 3, 7)
    assert np.array_equal(owners.owners, [0, 0, 1, 2])
    assert partition_owners(3, 3).owners.tolist() == [0, 1, 2]  # one each, as before


def test_the_cli_describes_a_sink_rescale_by_the_partitions_it_moved() -> None:
    made = RescaleStatus("a", 2, "sink", 1, 3, "hot-first", {}, "done", epoch=2,
                         groups_to_move=3, groups_moved=3,
                         progress={"partitions_out": 3.0, "partitions_in": 3.0})  # fmt: skip
    text = describe_rescale(made.report())
    assert text.startswith("rescale 2 of sink 1->3: done after ")
    assert text.endswith("; 3/3 output partitions moved")
