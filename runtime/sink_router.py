"""The edge into the sink, at its senders (the keyed instances whose updates the sink writes):
each update goes to output partition `key group % partitions`, and to the sink instance that
owns that partition by the sink's partition assignment (the `partitions` of the topology).

A rescale of the sink (keyshift.runtime.sink_rescale) reaches a sender as `reroute` naming the
sink: it sends an epoch MARKER on every stream to the sink, after the last batch it routed by
the old owners, then routes by the new ones; an old owner of a partition knows from the
markers when nothing more of it can come. Used by keyshift.runtime.keyed_stage.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa

from keyshift.runtime.keyspace import Assignment
from keyshift.runtime.protocol import Ack, Barrier, Reroute, Topology
from keyshift.runtime.records import GROUP, encode, split_by_owner
from keyshift.runtime.stage_context import InstanceContext
from keyshift.runtime.transport import BARRIER, END, MARKER, Outlet


def partition_of(groups: np.ndarray, partitions: int) -> np.ndarray:
    """The output partition of each key group: the same for the job's whole life."""
    return (groups % partitions).astype(np.int64)


def partition_owners(partitions: int, parallelism: int, epoch: int = 1) -> Assignment:
    """Partitions over sink instances in near-equal contiguous ranges (instance i owns
    partition i when there are as many of each, as before partitions could move)."""
    return Assignment.contiguous(partitions, parallelism, epoch)


class SinkRouter:
    """A sender's streams to the sink instances, and which one owns each partition."""

    def __init__(self, ctx: InstanceContext) -> None:
        self.ctx = ctx
        self.stage = ctx.spec.sink.name
        self.partitions = ctx.spec.sink.output_partitions
        self.outlets: dict[int, Outlet] = ctx.connect(self.stage)
        self.owners = Assignment.from_json(ctx.wait_topology().partitions)

    def route(self, out: pa.RecordBatch) -> list[tuple[int, bytes]]:
        """The updates' parts by the sink instance that owns their partition."""
        partition = partition_of(out.column(GROUP).to_numpy(), self.partitions)
        owners = self.owners.owners[partition].astype(np.int64)
        parallelism = int(owners.max()) + 1 if len(owners) else 1
        return [(o, encode(part)) for o, part in split_by_owner(out, owners, parallelism)]

    def send(self, parts: list[tuple[int, bytes]]) -> None:
        for owner, payload in parts:
            self.ctx.send(self.outlets[owner], payload)

    def barrier(self, barrier: Barrier) -> None:
        encoded = json.dumps(barrier.wire()).encode()
        for outlet in self.outlets.values():
            self.ctx.send(outlet, encoded, kind=BARRIER)

    def handle(self, command: Reroute | Topology) -> bool:
        """Follow a reroute of the sink, or close the streams to sink instances that left;
        False if the command is not for this edge."""
        if isinstance(command, Topology):
            current = command.addresses(self.stage)
            for index in [i for i in self.outlets if i not in current]:
                self.outlets.pop(index).abort()
            return False  # the other edges follow it too
        if command.stage != self.stage:
            return False
        new = Assignment.from_json(command.assignment)
        marker = json.dumps({"epoch": new.epoch}).encode()
        for outlet in self.outlets.values():
            self.ctx.send(outlet, marker, kind=MARKER)
        for joined, address in command.keyed.items():
            if int(joined) not in self.outlets:
                self.outlets[int(joined)] = self.ctx.outlet(address)
        self.owners = new
        self.ctx.emit(Ack(step="reroute", epoch=new.epoch))
        return True

    def finish(self, kind: bytes = END) -> None:
        for outlet in self.outlets.values():
            outlet.finish(kind=kind)
