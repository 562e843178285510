"""A StreamingJob's status conditions, kept as the Kubernetes API conventions ask.

Conditions are a list keyed by `type` (the CRD declares it a map list): a writer upserts the
conditions it knows and keeps the others, a condition's `lastTransitionTime` moves only when its
status changes, and each carries the `observedGeneration` it was computed from. Pure functions;
the kopf handlers in `keyshift.operator.k8s_operator` call `upsert_conditions` on every status
write (reconcile and the observing timer each know only some of the types).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from keyshift.operator.k8s_scaling import timestamp


def condition(kind: str, ok: bool, reason: str, message: str = "") -> dict[str, Any]:
    """A condition of `kind` whose status is True when `ok`; times and generation are set by
    `upsert_conditions`."""
    return {
        "type": kind,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message,
    }


def upsert_conditions(
    old: Iterable[Mapping[str, Any]],
    new: Iterable[Mapping[str, Any]],
    generation: int,
    now: float,
) -> list[dict[str, Any]]:
    """`old` with each of `new` put in place of the condition of its type (appended when there
    is none): stamped with `generation`, and with the old `lastTransitionTime` when the status
    did not change, `now` when it did. Conditions of other types are kept as they were."""
    merged = {str(c["type"]): dict(c) for c in old}
    for cond in new:
        before = merged.get(str(cond["type"]))
        same = before is not None and before.get("status") == cond["status"]
        since = before.get("lastTransitionTime") if before is not None and same else None
        merged[str(cond["type"])] = {
            **cond,
            "observedGeneration": generation,
            "lastTransitionTime": since or timestamp(now),
        }
    return list(merged.values())
