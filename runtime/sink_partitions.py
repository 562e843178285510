"""The output partitions one sink instance owns, and its side of a rescale of the sink.

A sink instance writes whole output partitions (keyshift.runtime.sink_router says which
partition a key's updates go to): for a log sink, one `OutputLogWriter` and `LogRetention` per
owned partition; a function sink owns partitions only for the hand-over's order. A rescale
(keyshift.runtime.sink_rescale) moves partitions between instances with a fence:

- an old owner goes on writing a leaving partition until every live sender's epoch MARKER (or
  END) is in, then flushes it, publishes what a completed checkpoint owes it and closes it
  (`leaving_closed`): nothing of it can still come here;
- a new owner parks a coming partition's records (in arrival order) until the coordinator
  says its old owner has closed it (`open`), then opens it after its last record and writes
  them first.

So each partition has one writer at a time, and each key's updates from a sender stay in the
order sent. Used by keyshift.runtime.sink_stage, which owns the loop and the disk's stalls.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa

from keyshift.runtime.job import LogSink
from keyshift.runtime.keyspace import Assignment
from keyshift.runtime.log_retention import LogRetention
from keyshift.runtime.output_log import OutputLogWriter
from keyshift.runtime.protocol import MovePartitions
from keyshift.runtime.records import GROUP, split_by_owner
from keyshift.runtime.sink_router import partition_of
from keyshift.runtime.storage import retrying

Attempt = Callable[[Callable[[], Any]], bool]  # a write, False when the disk refused it


class PartitionError(RuntimeError):
    """Records of a partition this instance neither owns nor is taking over."""


@dataclass
class PartitionMove:
    """This instance's part of one rescale of the sink."""

    epoch: int
    leaving: set[int]
    coming: set[int]
    markers: set[str] = field(default_factory=set)  # senders whose epoch marker is in
    parked: dict[int, list[pa.RecordBatch]] = field(default_factory=dict)
    closed: bool = False  # the leaving partitions are closed (out_done sent)


class SinkPartitions:
    """The partitions this sink instance owns, their writers, and the move under way."""

    def __init__(
        self, config: LogSink | None, index: int, owners: Assignment, restore: dict[str, int]
    ) -> None:
        """`config`: a log sink's (None: a function sink); `restore`: a recovery's output
        offsets by partition, which the owned partitions are truncated to."""
        self.config = config
        self.count = len(owners.owners)
        self.index = index
        self.owned: set[int] = {int(p) for p in np.flatnonzero(owners.owners == index)}
        self.writers: dict[int, OutputLogWriter] = {}
        self.retention: dict[int, LogRetention] = {}
        self.publish_to: dict[int, int] = {}  # completed checkpoints' offsets not yet published
        self.move: PartitionMove | None = None
        for partition in sorted(self.owned):
            writer = self._open(partition)
            offset = restore.get(str(partition))
            if writer is not None and offset is not None:
                # What came after the checkpoint is made again by the replay from its positions.
                retrying(partial(writer.truncate, offset), "truncating the output log")

    def _open(self, partition: int) -> OutputLogWriter | None:
        """Open a partition's writer after its last complete segment (a disk that is full
        now is waited for, here as while running)."""
        config = self.config
        if config is None:
            return None
        writer = retrying(
            lambda: OutputLogWriter(config.path, partition, config.format, config.segment_records),
            "opening the output log",
        )
        self.writers[partition] = writer
        self.retention[partition] = LogRetention(
            writer, config.path, config.readers, config.max_unread_records
        )
        return writer

    # -- records ---------------------------------------------------------------------------

    def split(self, batch: pa.RecordBatch) -> list[tuple[int, pa.RecordBatch]]:
        """A batch's records by partition (without their key group), in order; those of a
        partition coming here are parked until it opens."""
        partitions = partition_of(batch.column(GROUP).to_numpy(), self.count)
        batch = batch.drop_columns([GROUP])
        if len(partitions) and (partitions == partitions[0]).all():
            parts = [(int(partitions[0]), batch)]  # the usual case: no copy
        else:
            parts = split_by_owner(batch, partitions, self.count)
        kept = []
        for partition, part in parts:
            if self.move is not None and partition in self.move.coming:
                self.move.parked.setdefault(partition, []).append(part)
            elif partition in self.owned:
                kept.append((partition, part))
            else:
                raise PartitionError(
                    f"{part.num_rows} records of output partition {partition}, which sink "
                    f"instance {self.index} neither owns nor is taking over"
                )
        return kept

    @property
    def end_offsets(self) -> dict[str, int]:
        return {str(p): w.end_offset for p, w in sorted(self.writers.items())}

    def flush(self) -> None:
        for writer in self.writers.values():
            writer.flush()

    def catch_up(self) -> None:
        """The writes the log owes besides records: publishing completed checkpoints'
        offsets, and trimming what the readers have read."""
        for partition, offset in list(self.publish_to.items()):
            self.writers[partition].publish(offset)
            del self.publish_to[partition]
        for retention in self.retention.values():
            retention.poll()

    def blocked(self) -> bool:
        """Whether a reader lags too far behind in one of the owned partitions."""
        return any(retention.blocked() for retention in self.retention.values())

    def completed(self, outputs: dict[str, int]) -> None:
        """A checkpoint completed at these offsets: publish the owned partitions' up to them."""
        for partition in self.writers:
            offset = outputs.get(str(partition))
            if offset is not None:
                self.publish_to[partition] = int(offset)

    def finish(self, publish: bool) -> None:
        """The job is done: write the rest, and with checkpoints make all of it final."""
        for writer in self.writers.values():
            retrying(writer.close, "writing the end of the output log")
            if publish:
                retrying(partial(writer.publish, writer.end_offset), "publishing the output log")

    # -- a rescale of the sink -------------------------------------------------------------

    def prepare(self, command: MovePartitions) -> None:
        if self.move is not None:
            raise PartitionError("move_partitions while another move runs")
        owners = Assignment.from_json(command.owners).owners
        if len(owners) != self.count:
            raise PartitionError(
                f"move_partitions names {len(owners)} partitions, not {self.count}"
            )
        mine = {int(p) for p in np.flatnonzero(owners == self.index)}
        self.move = PartitionMove(command.epoch, self.owned - mine, mine - self.owned)
        self._end_if_done()  # nothing moves to or from here

    def marker(self, sender: str, payload: bytes | None) -> None:
        """A sender's epoch marker (None: its END, which ends every epoch)."""
        move = self.move
        if move is None:
            return
        if payload is None or int(json.loads(payload)["epoch"]) == move.epoch:
            move.markers.add(sender)

    def close_leaving(self, live: AbstractSet[str], attempt: Attempt) -> bool:
        """Close the leaving partitions once every live sender's marker is in; True the first
        time they are closed (the caller reports out_done). A write the disk refuses leaves
        them open, to be tried again."""
        move = self.move
        if move is None or move.closed or not move.leaving or not live <= move.markers:
            return False
        for partition in sorted(move.leaving):
            writer = self.writers.get(partition)
            if writer is not None:
                offset = self.publish_to.get(partition)
                if not attempt(writer.close):
                    return False
                if offset is not None and not attempt(partial(writer.publish, offset)):
                    return False
                self.publish_to.pop(partition, None)
                del self.writers[partition], self.retention[partition]
            self.owned.discard(partition)
        move.closed = True
        self._end_if_done()
        return True

    def open(self, partitions: list[int]) -> list[tuple[int, pa.RecordBatch]]:
        """Take over `partitions`: open them, and hand back what was parked for them, in
        order, for the caller to write."""
        move = self.move
        if move is None or not set(partitions) <= move.coming:
            raise PartitionError(f"open_partitions {partitions} with no such move here")
        parked = []
        for partition in partitions:
            self._open(partition)
            self.owned.add(partition)
            move.coming.discard(partition)
            parked += [(partition, batch) for batch in move.parked.pop(partition, [])]
        self._end_if_done()
        return parked

    def _end_if_done(self) -> None:
        move = self.move
        if move is not None and (move.closed or not move.leaving) and not move.coming:
            self.move = None

    @property
    def moving(self) -> bool:
        return self.move is not None

    def stats(self) -> dict[str, Any]:
        return {
            "partitions": sorted(self.owned),
            "output_offset": sum(w.end_offset for w in self.writers.values()),
        }
