"""Event-time watermarks: how far event time has progressed, so that windows know when they are
complete. Pure code: no clock reads (`now` is passed in) and no I/O.

- `WatermarkGenerator`, at each source instance: bounded out-of-orderness (the highest event
  time seen less the bound) and an idle timeout, after which the instance tells its receivers
  not to wait for it until it emits again (quiet time only: waiting for their credits is not).
- `WatermarkTracker`, at each receiving instance: the minimum over its live, non-idle inputs,
  never moving backwards; an input that ended or left no longer holds it back. A keyed stage
  upstream that moves key groups holds it (`hold`) at the old owner's watermark until every
  new owner has released it (`release`): the moved windows fire at the new owners, later than
  the watermarks of the stage may have gone. A new owner is an input from its release on,
  also before its first watermark (an instance the rescale started may not have one yet).

The source stage loop (`keyshift.runtime.source_stage`) sends what its generator says as
`WATERMARK` messages (`keyshift.runtime.protocol.Watermark`); the keyed stage loop
(`keyshift.runtime.keyed_stage`) feeds them to its tracker and exports the result.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

__all__ = ["WatermarkGenerator", "WatermarkTracker"]


@dataclass
class WatermarkGenerator:
    """A source instance's watermark: every event time it will still emit is at or above it,
    unless a record is later than `bound_us` (a late record)."""

    bound_us: int
    idle_timeout: float | None
    last_active: float  # when the instance started or was last busy emitting records
    highest_us: int | None = None
    idle: bool = False
    # Records were emitted since the last `check_idle`: the instance was busy until that check.
    emitting: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        if self.bound_us < 0:
            raise ValueError(f"the out-of-orderness bound must be >= 0 µs, got {self.bound_us}")
        if self.idle_timeout is not None and self.idle_timeout <= 0:
            raise ValueError(f"the idle timeout must be > 0 s, got {self.idle_timeout}")

    def observe(self, highest_event_time_us: int, now: float) -> None:
        """Records were emitted; the highest of their event times."""
        if self.highest_us is None or highest_event_time_us > self.highest_us:
            self.highest_us = highest_event_time_us
        self.last_active = now
        self.idle = False
        self.emitting = True

    @property
    def watermark(self) -> int | None:
        """None until a record is seen."""
        return None if self.highest_us is None else self.highest_us - self.bound_us

    def held_up(self, now: float) -> None:
        """Records wait that the instance cannot emit now (a rescale paused it, or its
        receivers withhold credits): a quiet spell that is not the input's, so not idleness.
        Else its receivers would go on with the other sources, past the records it sends when
        it can."""
        if not self.idle:
            self.last_active = now

    def check_idle(self, now: float) -> bool:
        """Whether the instance has just become idle (nothing emitted for the timeout); true
        once per quiet spell. A spell starts at the first check after records were emitted,
        not when they were: the watermark sent after them may have waited that long for the
        receivers' credits, and backpressure is not a quiet input (else the receivers would go
        on with the other sources, past the records it sends next)."""
        if self.emitting:
            self.emitting = False
            self.last_active = max(self.last_active, now)
            return False
        if self.idle or self.idle_timeout is None or now - self.last_active < self.idle_timeout:
            return False
        self.idle = True
        return True


@dataclass
class WatermarkTracker:
    """The watermark of an instance with several inputs: the minimum of its inputs'
    watermarks, over the inputs that are neither idle nor ended. It never moves backwards;
    while an active input has not sent a watermark yet, it does not move at all. Once every
    input has ended it is final: `FINAL` (every window is complete)."""

    FINAL = (1 << 63) - 1

    inputs: set[str]
    current: int | None = None
    _marks: dict[str, int] = field(default_factory=dict)
    _idle: set[str] = field(default_factory=set)
    _ended: set[str] = field(default_factory=set)
    # (stage, epoch, holder) -> the holder's watermark (None: it had none) and the new owners
    # not yet released: every old owner of a move holds, each at its own watermark. Releases
    # by (stage, epoch), kept for holds they overtook (they travel on other streams): a few
    # names per move.
    _holds: dict[tuple[str, int, str], tuple[int | None, set[str]]] = field(default_factory=dict)
    _released: dict[tuple[str, int], set[str]] = field(default_factory=dict)
    _left: set[str] = field(default_factory=set)  # retired (said so with a LEAVE), not lost

    def advance(self, sender: str, watermark: int | None, idle: bool = False) -> bool:
        """A watermark from `sender` (none: it has not seen a record yet; idle: it has gone
        quiet); whether the current one moved."""
        self.inputs.add(sender)
        self._left.discard(sender)  # an instance of its name joined again
        if watermark is not None and watermark > self._marks.get(sender, watermark - 1):
            self._marks[sender] = watermark
        if idle:
            self._idle.add(sender)
        else:
            self._idle.discard(sender)
        return self._recompute()

    def end(self, sender: str) -> bool:
        """`sender`'s input is complete: it holds nothing back any more."""
        self.inputs.add(sender)
        self._ended.add(sender)
        return self._recompute()

    def leave(self, sender: str) -> bool:
        """`sender` left its stage (a rescale retired it): it holds nothing back, until an
        instance of its name joins again and sends a watermark."""
        self.inputs.discard(sender)
        self._left.add(sender)
        self._marks.pop(sender, None)
        self._idle.discard(sender)
        return self._recompute()

    def forget_lost(
        self, stages: Collection[str], present: Collection[str], retired: Collection[str] = ()
    ) -> bool:
        """Of `stages`' instances, those not `present` any more died, unless `retired`: they
        hold nothing back, neither as inputs nor as the old owners of a move (their groups'
        state went with them), and a move waiting for a lost new owner's release waits no more
        (it will never come). A retired instance is no loss: its watermark and hold stand
        until its LEAVE, which comes after everything it sent (windows it fired, the results
        its move's new owners wait for) and may come after the topology that no longer lists
        it; forgetting it then let the watermark pass results still on their way."""
        known = set(self.inputs)
        for (_, _, holder), (_, waiting) in self._holds.items():
            known |= {holder, *waiting}
        absent = {n for n in known if n.rsplit("/", 1)[0] in stages and n not in present}
        # A retired old owner's hold stays until its new owners release it.
        lost = absent - self._left - set(retired)
        if not lost:
            return False
        for held, (_, waiting) in list(self._holds.items()):
            waiting -= lost
            if not waiting or held[2] in lost:
                del self._holds[held]
        self.inputs -= lost
        for sender in lost:
            self._marks.pop(sender, None)
            self._idle.discard(sender)
        return self._recompute()

    def hold(
        self, stage: str, epoch: int, holder: str, watermark: int | None, until: set[str]
    ) -> None:
        """Stay at or below `holder`'s `watermark` until every instance in `until` (named as
        senders are) has released `stage`'s move of `epoch`."""
        waiting = until - self._released.get((stage, epoch), set())
        if waiting:
            self._holds[(stage, epoch, holder)] = (watermark, waiting)

    def release(self, stage: str, epoch: int, sender: str) -> bool:
        """`sender`, a new owner of `stage`'s move of `epoch`, has sent what the move held."""
        # It sends the moved groups' records from now on: an input, though it may have sent no
        # watermark yet (an instance the rescale started), which then holds everything.
        self.inputs.add(sender)
        self._released.setdefault((stage, epoch), set()).add(sender)
        for held in [h for h in self._holds if h[:2] == (stage, epoch)]:
            waiting = self._holds[held][1]
            waiting.discard(sender)
            if not waiting:
                del self._holds[held]
        return self._recompute()

    def _recompute(self) -> bool:
        live = self.inputs - self._ended
        if not live:
            candidate: int | None = self.FINAL
        else:
            active = live - self._idle
            if not active:
                return False  # all quiet: nothing says how far event time has come
            marks = [self._marks.get(s) for s in active]
            if any(m is None for m in marks):
                return False
            candidate = min(m for m in marks if m is not None)
            for held, _ in self._holds.values():
                if held is None:
                    return False
                candidate = min(candidate, held)
        if candidate is None or (self.current is not None and candidate <= self.current):
            return False
        self.current = candidate
        return True
