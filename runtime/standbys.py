"""Warm standbys: pre-started idle instances of keyed stages, waiting for a scale-out.

A host starts `standby` processes per keyed stage beside the job's instances; each connects to
the coordinator and waits on its `Standby` stream, owning no key groups, receiving no records
and counted in no parallelism. A scale-out (`set_desired`) gives the waiting ones its new
indexes, in the order they offered themselves; each then registers under its index as any new
instance does, so routers, checkpoints and logs only ever see indexes. The
host sees which process took which index in the status, and starts processes only for the
indexes no standby took (and new standbys, in the background).

A standby may be pinned to one index: on Kubernetes each standby is a pod of its stage's
StatefulSet above the stage's parallelism, whose ordinal is the only index it may ever have
(so no second pod is ever started for an index). A scale-out gives each pinned standby its own
index if the scale-out reaches it, and the unpinned ones the indexes left, in order.

Used by `keyshift.runtime.coordinator` under its lock (this pool has none of its own).
"""

from __future__ import annotations

from dataclasses import dataclass

from keyshift.runtime.protocol import StandbyStatus


@dataclass
class Standby:
    """One standby process of a stage; `index` once a scale-out took it; `pinned`, the one
    index it may take (None: any)."""

    stage: str
    pid: int
    index: int | None = None
    pinned: int | None = None


class StandbyPool:
    """The standbys of every keyed stage, in the order they offered themselves."""

    def __init__(self, stages: list[str]) -> None:
        self.waiting: dict[str, list[Standby]] = {stage: [] for stage in stages}

    def offer(self, stage: str, pid: int, pinned: int | None = None, wanted: int = 0) -> Standby:
        """A standby of `stage` now waits; KeyError for a stage that keeps none. A pinned one
        whose index is below `wanted` (the stage's desired parallelism: the job starts, or
        restarts from a checkpoint, or its pod came back) takes it at once."""
        taken = pinned if pinned is not None and pinned < wanted else None
        standby = Standby(stage, pid, index=taken, pinned=pinned)
        self.waiting[stage].append(standby)
        return standby

    def take(self, stage: str, indexes: range) -> None:
        """A scale-out's new `indexes`: a pinned standby takes its own if it is among them;
        the unpinned ones take the rest, lowest index first."""
        idle = [s for s in self.waiting.get(stage, []) if s.index is None]
        left = list(indexes)
        for standby in idle:
            if standby.pinned in left:
                standby.index = standby.pinned
                left.remove(standby.pinned)
        unpinned = [s for s in idle if s.pinned is None]
        for standby, index in zip(unpinned, left, strict=False):
            standby.index = index

    def leave(self, standby: Standby) -> None:
        """A standby that went away (its stream ended), before or after it was taken."""
        members = self.waiting[standby.stage]
        if standby in members:
            members.remove(standby)

    def registered(self, stage: str, index: int) -> None:
        """An instance registered as `index`: the standby that took it, if one did, is done."""
        members = self.waiting.get(stage, [])
        members[:] = [s for s in members if s.index != index]

    def status(self, stage: str) -> list[StandbyStatus]:
        return [StandbyStatus(pid=s.pid, index=s.index) for s in self.waiting.get(stage, [])]
