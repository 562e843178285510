"""The edge into a sink, at its senders (the keyed instances whose updates the sink writes):
each update goes to output partition `key group % partitions`, and to the sink instance that
owns that partition by the sink's partition assignment (its entry in the `partitions` of the
topology). A keyed instance holds one per sink it feeds.

A rescale of the sink (keyshift.runtime.sink_rescale) reaches a sender as `reroute` naming the
sink: it sends an epoch MARKER on every stream to the sink, after the last batch it routed by
the old owners, then routes by the new ones; an old owner of a partition knows from the
markers when nothing more of it can come. The map/filter stages a job puts between a keyed
stage and its sink run here, on the updates before they are routed. Used by
keyshift.runtime.keyed_stage.
"""

from __future__ import annotations

import json
from typing import cast

import numpy as np
import pyarrow as pa

from keyshift.runtime.edge_router import apply_transforms, resolve_transforms, switch_outlets
from keyshift.runtime.job import Chained, FieldType
from keyshift.runtime.job_graph import KEY_FIELD
from keyshift.runtime.keyspace import Assignment, key_groups
from keyshift.runtime.protocol import Ack, Barrier, Reroute, Topology
from keyshift.runtime.records import (
    ARROW_TYPES,
    GROUP,
    RESERVED_FIELDS,
    split_by_owner,
    with_record_ids,
)
from keyshift.runtime.stage_context import InstanceContext
from keyshift.runtime.transport import BARRIER, END, Outlet

_FIELD_TYPES: dict[pa.DataType, FieldType] = {
    kind: cast(FieldType, name) for name, kind in ARROW_TYPES.items()
}


def partition_of(groups: np.ndarray, partitions: int) -> np.ndarray:
    """The output partition of each key group: the same for the job's whole life."""
    return (groups % partitions).astype(np.int64)


def partition_owners(partitions: int, parallelism: int, epoch: int = 1) -> Assignment:
    """Partitions over sink instances in near-equal contiguous ranges (instance i owns
    partition i when there are as many of each, as before partitions could move)."""
    return Assignment.contiguous(partitions, parallelism, epoch)


class SinkRouter:
    """A sender's streams to the instances of sink `sink`, and which one owns each partition."""

    def __init__(
        self, ctx: InstanceContext, sink: str, transforms: tuple[Chained, ...] = ()
    ) -> None:
        self.ctx = ctx
        self.transforms = resolve_transforms(transforms)
        self.stage = sink
        self.partitions = ctx.spec.sink_stage(sink).output_partitions
        self.outlets: dict[int, Outlet] = ctx.connect(self.stage)
        self.owners = Assignment.from_json(ctx.wait_topology().partitions[sink])

    def route(self, out: pa.RecordBatch) -> list[tuple[int, pa.RecordBatch]]:
        """The updates' parts by the sink instance that owns their partition, after the maps
        and filters chained before the sink."""
        if self.transforms:
            out = self.transformed(out)
        partition = partition_of(out.column(GROUP).to_numpy(), self.partitions)
        owners = self.owners.owners[partition].astype(np.int64)
        parallelism = int(owners.max()) + 1 if len(owners) else 1
        return split_by_owner(out, owners, parallelism)

    def transformed(self, out: pa.RecordBatch) -> pa.RecordBatch:
        """The updates through the maps and filters, in the updates' schema (a map's result
        that does not fit it is rejected, as any chained function's). Each goes to the
        partition of its key group: a map that rewrites the key sends it to its new key's."""
        fields: dict[str, FieldType] = {
            f.name: _FIELD_TYPES[f.type] for f in out.schema if f.name not in RESERVED_FIELDS
        }
        records = apply_transforms(self.ctx, with_record_ids(out), self.transforms, fields)
        groups = pa.array(key_groups(records.column(KEY_FIELD), self.ctx.spec.max_key_groups))
        columns = [groups if f.name == GROUP else records.column(f.name) for f in out.schema]
        return pa.RecordBatch.from_arrays(columns, schema=out.schema)

    def send(self, parts: list[tuple[int, pa.RecordBatch]]) -> None:
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
        switch_outlets(self.ctx, self.outlets, new.epoch, command.keyed)
        self.owners = new
        self.ctx.emit(Ack(step="reroute", epoch=new.epoch))
        return True

    def finish(self, kind: bytes = END) -> None:
        for outlet in self.outlets.values():
            outlet.finish(kind=kind)
