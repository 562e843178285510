"""Local recovery, the coordinator's side: a lost keyed instance is started again alone while
every other instance rewinds in place to the latest completed checkpoint.

The coordinator (keyshift.runtime.coordinator) asks `refusal` whether a loss can be recovered
locally; if not, it restarts the whole job as before (the reason logged). A `LocalRecovery` is
the one under way: the generation it opens, the instances it replaces, the survivors that have
rewound. It runs on a thread of its own (`Coordinator.recover_locally`): once no checkpoint is in
flight it picks the latest completed one, tells every survivor to `Rewind` to it, and waits
for each to say `Rewound` and for the replacements to register; then the coordinator sends the
topology and the job runs again. Anything else (a loss while it runs, the deadline) falls back
to the global restart.

The fence: each rewind opens a new generation. Data streams carry their sender's generation in
their hello, an inbox takes only its own generation's messages (keyshift.runtime.transport),
and a survivor's inbox moves to the new generation before it says `Rewound`, while nobody
opens a stream of the new generation before the topology that follows every `Rewound`. So
nothing sent before the rewind (records, watermarks, barriers) is taken after it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

# Seconds a local recovery may take from the loss to every survivor rewound and every
# replacement registered (a process start, a checkpoint's metadata read) before the job is
# restarted globally instead.
LOCAL_RECOVERY_TIMEOUT = 30.0


@dataclass
class LocalRecovery:
    """A local recovery under way (times: `failed_at` wall clock, `started` monotonic).

    `delay` is the restart strategy's (keyshift.runtime.restart_strategy): the survivors rewind
    at once (a survivor whose stream broke waits only so long to be told), but the
    replacements are asked for, and the job runs again, only once it has passed."""

    generation: int
    reason: str
    replacing: dict[str, int]  # the lost instances whose replacements are to register: pids
    survivors: set[str]  # the instances to rewind, by name
    delay: float = 0.0
    failed_at: float = field(default_factory=time.time)
    started: float = field(default_factory=time.monotonic)
    checkpoint: int | None = None  # picked once no checkpoint is in flight
    rewound: set[str] = field(default_factory=set)

    @property
    def due(self) -> float:
        """When (monotonic) the replacements are started and the job may run again."""
        return self.started + self.delay

    @property
    def deadline(self) -> float:
        """When (monotonic) the recovery gives way to the global restart."""
        return self.due + LOCAL_RECOVERY_TIMEOUT

    def complete(self, registered: set[str], now: float) -> bool:
        """Every survivor rewound and every replacement registered, the delay passed."""
        return (
            now >= self.due and self.survivors <= self.rewound and set(self.replacing) <= registered
        )


def refusal(
    *,
    enabled: bool,
    keyed: bool,
    phase: str,
    rescaling: bool,
    draining: bool,
    finished: bool,
    ingest: bool,
) -> str | None:
    """Why a lost instance is not recovered locally, if it is not: then the job is restarted
    from its checkpoint as a whole."""
    if not enabled:
        return "the job asks for the global restart (recovery: global)"
    if not keyed:
        return "only a lost keyed instance is recovered locally; a source or sink is not"
    if phase != "running":
        return f"the job is {phase}"
    if rescaling:
        return "a rescale runs: its moves are not rewound in place"
    if draining:
        return "the job is draining"
    if finished:
        return "some instances have finished: they would not replay"
    if ingest:
        return "an ingest source serves its clients on its own port: it restarts with the job"
    return None
