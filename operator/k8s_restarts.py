"""The restart strategy on Kubernetes: the operator restarts a checkpointed job whose
coordinator failed, after the delay the job's strategy (`spec.job.restart`,
`keyshift.runtime.restart_strategy`) gives, and gives up when the strategy does.

A lost instance makes the coordinator exit to be restarted, and Kubernetes restarts it (and the
pods) by itself. What Kubernetes does not restart is a coordinator that failed and stays up
saying so: an instance that failed, instances that did not register in time after a restart.
For those the operator rolls the coordinator's Deployment (a new pod, which goes on from the
latest checkpoint) as `kubectl rollout restart` does. Each local recovery the coordinator
reports counts as a failure of the same series (the coordinator applies the strategy to them
itself, and says when it gave up: then the operator does not restart the job either).
`Restarts` is the memory of it, kept in the StreamingJob's status so a restarted operator goes
on with it; used by `keyshift.operator.k8s_operator`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from keyshift.runtime.restart_strategy import RestartStrategy, counting_local


@dataclass
class Restarts:
    """The failures the operator restarted a job after (times in seconds since the epoch), the
    failed coordinator it last took in (its incarnation), when that one is due a restart, and
    why it will not be restarted, once the strategy gives up."""

    failures: list[float] = field(default_factory=list)
    handled: str | None = None
    due: float | None = None
    gave_up: str | None = None

    def observe(self, strategy: RestartStrategy, current: Mapping[str, Any], now: float) -> bool:
        """Take in the coordinator's status at `now`; True when its failed coordinator is to be
        restarted now."""
        last = (current.get("recoveries") or {}).get("last")
        self.failures = strategy.kept(counting_local(self.failures, last))
        incarnation = current.get("incarnation")
        if current.get("phase") != "failed":
            if incarnation != self.handled:
                self.due = None
                self.gave_up = None  # a new coordinator runs (restarted by hand, say)
            return False
        if incarnation != self.handled:
            self.handled = str(incarnation)
            if current.get("gave_up"):  # the coordinator's strategy, on a local recovery
                self.due, self.gave_up = None, str(current["gave_up"])
                return False
            decision = strategy.decide(self.failures, now)
            self.failures = strategy.kept([*self.failures, now])
            self.due = None if decision.delay is None else now + decision.delay
            self.gave_up = decision.why if decision.delay is None else None
        if self.due is not None and now >= self.due:
            self.due = None
            return True
        return False

    def to_json(self) -> dict[str, Any]:
        return {
            "failures": list(self.failures),
            "handled": self.handled,
            "due": self.due,
            "gaveUp": self.gave_up,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Restarts:
        """Read back what `to_json` wrote; ValueError naming what is wrong."""
        try:
            failures = [float(t) for t in data.get("failures") or []]
            due = data.get("due")
            handled, gave_up = data.get("handled"), data.get("gaveUp")
            if not all(v is None or isinstance(v, str) for v in (handled, gave_up)):
                raise ValueError("handled and gaveUp must be strings")
            return cls(failures, handled, None if due is None else float(due), gave_up)
        except (TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"not a restart memory: {exc}") from None
