"""Warm standbys: pre-started idle instances of keyed stages, waiting for a scale-out.

A host starts `standby` processes per keyed stage beside the job's instances; each connects to
the coordinator and waits on its `Standby` stream, owning no key groups, receiving no records
and counted in no parallelism. A scale-out (`set_desired`) gives the waiting ones its new
indexes, in the order they offered themselves; each then registers under its index as any new
instance does, so routers, checkpoints and logs only ever see indexes. The
host sees which process took which index in the status, and starts processes only for the
indexes no standby took (and new standbys, in the background).

Used by `keyshift.runtime.coordinator` under its lock (this pool has none of its own).
"""

from __future__ import annotations

from dataclasses import dataclass

from keyshift.runtime.protocol import StandbyStatus


@dataclass
class Standby:
    """One standby process of a stage; `index` once a scale-out took it."""

    stage: str
    pid: int
    index: int | None = None


class StandbyPool:
    """The standbys of every keyed stage, in the order they offered themselves."""

    def __init__(self, stages: list[str]) -> None:
        self.waiting: dict[str, list[Standby]] = {stage: [] for stage in stages}

    def offer(self, stage: str, pid: int) -> Standby:
        """A standby of `stage` now waits; KeyError for a stage that keeps none."""
        standby = Standby(stage, pid)
        self.waiting[stage].append(standby)
        return standby

    def take(self, stage: str, indexes: range) -> None:
        """A scale-out's new `indexes`: waiting standbys take them, lowest index first."""
        idle = [s for s in self.waiting.get(stage, []) if s.index is None]
        for standby, index in zip(idle, indexes, strict=False):
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
