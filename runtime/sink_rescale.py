"""A rescale of the sink, driven by the coordinator: whole output partitions move between sink
instances, fenced so that each partition keeps one writer at a time and each key's order.

The partitions are fixed for the job's life (`sink.partitions`); a key's updates always go to
the same one, whatever the sink's parallelism, so the output log's readers (by partition and
offset) see the same layout before and after. One step, in named phases:

1. PREPARING: every sink instance gets the new owners (`move_partitions`): an old owner keeps
   writing a leaving partition, a new owner parks the records of a coming one.
2. REROUTING: every sender (the keyed instances feeding the sink) gets the new owners
   (`reroute` naming the sink) and sends an epoch MARKER on each stream to the sink.
3. CLOSING: each old owner, once every live sender's marker (or END) is in, has all of its
   leaving partitions' records by the old owners: it flushes, publishes what a completed
   checkpoint owes, closes them and reports `out_done`.
4. OPENING: each new owner is told (`open_partitions`) and opens its partitions after their
   last record, writes what it parked, in order, and reports `in_done`.

A scale-out starts the new instances first; a scale-in retires the highest indexes once they
own nothing. Rescales run one at a time in the whole job (keyshift.runtime.rescale); a sink
instance lost meanwhile fails the job (or restarts it from its checkpoint), as outside one.
Used by `keyshift.runtime.coordinator`.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from keyshift.runtime.keyspace import Assignment
from keyshift.runtime.protocol import InDone, MovePartitions, OpenPartitions, OutDone, Reroute
from keyshift.runtime.rescale import (
    MOVE_TIMEOUT,
    STEP_TIMEOUT,
    RescaleDriver,
    RescaleHost,
    RescaleStatus,
    moves_reported,
    step_acked,
)
from keyshift.runtime.sink_router import partition_owners


class SinkRescaleHost(RescaleHost, Protocol):
    """What the sink's driver needs besides a keyed one's (implemented by Coordinator)."""

    def commit_partitions(self, sink: str, owners: Assignment) -> None: ...


class SinkRescaleDriver(RescaleDriver):
    """Runs one rescale of sink `sink`: `current` is its partitions' owners."""

    host: SinkRescaleHost

    def __init__(
        self,
        host: SinkRescaleHost,
        status: RescaleStatus,
        sink: str,
        upstream: tuple[str, ...],
        current: Assignment,
    ) -> None:
        super().__init__(host, status, sink, upstream, current, np.zeros(len(current.owners)))

    def _run(self) -> None:
        status = self.status
        sink = self.keyed
        old_p, new_p = status.from_parallelism, status.to_parallelism
        if new_p > old_p:
            self._phase("starting-instances")
            self.host.set_desired(sink, new_p)
            self.host.wait_for(
                lambda _events: len(self.host.addresses(sink)) >= new_p,
                self.host.register_timeout,
                f"new instances {sink}/{old_p}..{new_p - 1} to register",
            )
        epoch = self.current.epoch + 1
        status.epoch = epoch
        status.steps = 1
        target = partition_owners(len(self.current.owners), new_p, epoch)
        moving = np.flatnonzero(target.owners != self.current.owners)
        status.groups_to_move = len(moving)
        senders = {int(i) for i in self.current.owners[moving]}
        receivers: dict[int, list[int]] = {}
        for partition in moving.tolist():
            receivers.setdefault(int(target.owners[partition]), []).append(partition)
        addresses = self.host.addresses(sink)
        self._phase("preparing")
        move = MovePartitions(epoch=epoch, owners=target.to_json())
        for index in addresses:
            self.host.send(sink, index, move)
        self.host.wait_for(
            step_acked("move_partitions", epoch, {(sink, i) for i in addresses}),
            STEP_TIMEOUT,
            "sink instances to prepare",
        )
        self._phase("rerouting")
        self._broadcast_senders(
            Reroute(
                stage=sink,
                epoch=epoch,
                assignment=target.to_json(),
                keyed={str(i): a for i, a in addresses.items()},
            )
        )
        self._phase("closing")
        self.host.wait_for(
            moves_reported(OutDone, epoch, senders), MOVE_TIMEOUT, "old owners to close partitions"
        )
        self._phase("opening")
        for index, partitions in receivers.items():
            self.host.send(sink, index, OpenPartitions(epoch=epoch, partitions=partitions))
        self.host.wait_for(
            moves_reported(InDone, epoch, set(receivers)),
            MOVE_TIMEOUT,
            "new owners to open partitions",
        )
        self.current = target
        self.host.commit_partitions(sink, target)
        status.groups_moved = len(moving)
        if new_p < old_p:
            self._phase("retiring")
            self.host.set_desired(sink, new_p)
            self.host.retire(sink, list(range(new_p, old_p)))
