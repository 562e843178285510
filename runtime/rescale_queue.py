"""The coordinator's queue of rescales waiting for the one that runs: FIFO, bounded, one entry
per stage.

The job moves one stage at a time (two moves must never interleave their epochs, markers or
pauses), so a request for another stage while one runs waits here and starts when the running
one ends, done, failed or recovered from. A request for a stage that already waits replaces
it in its place in line (the newer parallelism is what the caller wants now; the replaced one
ends as `replaced`, naming its successor). Beyond `MAX_QUEUED` waiting requests, or when the
job stops being able to rescale (draining, failed, shut down), requests are refused or
dropped with the reason; nothing here is kept across a coordinator restart. Pure data: the
coordinator (keyshift.runtime.coordinator) holds it under its lock and starts what it pops.
"""

from __future__ import annotations

import time
from collections import deque

from keyshift.runtime.rescale import RescaleStatus

# At most this many requests wait behind the running one: every stage of a graph of that many
# rescalable stages at once, and a bound on how long checkpoints wait (none is taken while a
# rescale runs or waits to start).
MAX_QUEUED = 8


class QueueFull(Exception):
    """A request the queue cannot take; the message says why."""


class RescaleQueue:
    """The rescales waiting to start, in the order they were asked for."""

    def __init__(self, limit: int = MAX_QUEUED) -> None:
        self.limit = limit
        self._waiting: deque[RescaleStatus] = deque()

    def __len__(self) -> int:
        return len(self._waiting)

    def waiting(self) -> list[RescaleStatus]:
        return list(self._waiting)

    def put(self, status: RescaleStatus) -> RescaleStatus | None:
        """Queue `status` (phase `queued`); the request of its stage it replaced, if one
        waited (ended as `replaced`). Raises QueueFull when `limit` requests wait already."""
        for place, waiting in enumerate(self._waiting):
            if waiting.stage == status.stage:
                self._waiting[place] = status
                waiting.phase = "replaced"
                waiting.error = f"replaced by rescale {status.id} of its stage before it started"
                waiting.finished = time.time()
                status.phase = "queued"
                return waiting
        if len(self._waiting) >= self.limit:
            stages = ", ".join(w.stage for w in self._waiting)
            raise QueueFull(
                f"{len(self._waiting)} rescales wait already ({stages}), the most the job "
                f"queues; try again when one has started"
            )
        status.phase = "queued"
        self._waiting.append(status)
        return None

    def pop(self) -> RescaleStatus | None:
        """The request to start next, if any."""
        return self._waiting.popleft() if self._waiting else None

    def drop(self, reason: str) -> list[RescaleStatus]:
        """End every waiting request as failed with `reason` (the job can no longer rescale);
        they are returned for the coordinator's record."""
        dropped = list(self._waiting)
        self._waiting.clear()
        now = time.time()
        for status in dropped:
            status.phase = "failed"
            status.error = f"not started: {reason}"
            status.finished = now
        return dropped
