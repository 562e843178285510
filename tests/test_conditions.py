"""keyshift.operator.conditions: conditions upserted by type, as the API conventions ask."""

from __future__ import annotations

from keyshift.operator.conditions import condition, upsert_conditions
from keyshift.operator.k8s_scaling import timestamp

T0, T1 = 1_700_000_000.0, 1_700_000_100.0


def test_an_upsert_keeps_other_types_and_the_time_of_an_unchanged_status() -> None:
    first = upsert_conditions(
        [], [condition("Ready", False, "NotSettled"), condition("Rescaling", False, "Idle")], 1, T0
    )
    assert [c["type"] for c in first] == ["Ready", "Rescaling"]
    assert all(c["lastTransitionTime"] == timestamp(T0) for c in first)
    assert all(c["observedGeneration"] == 1 for c in first)

    later = upsert_conditions(first, [condition("Ready", False, "InvalidSpec", "bad")], 2, T1)
    ready = {c["type"]: c for c in later}["Ready"]
    assert ready["lastTransitionTime"] == timestamp(T0)  # same status: the time stays
    assert (ready["reason"], ready["message"], ready["observedGeneration"]) == (
        "InvalidSpec",
        "bad",
        2,
    )
    assert {c["type"]: c for c in later}["Rescaling"] == first[1]  # untouched

    flipped = upsert_conditions(later, [condition("Ready", True, "Running")], 2, T1)
    assert {c["type"]: c for c in flipped}["Ready"]["lastTransitionTime"] == timestamp(T1)
    assert [c["type"] for c in flipped] == ["Ready", "Rescaling"]


def test_a_condition_without_a_time_gets_one() -> None:
    old = [{"type": "Degraded", "status": "False", "reason": "SpecValid"}]
    (merged,) = upsert_conditions(old, [condition("Degraded", False, "SpecValid")], 3, T1)
    assert merged["lastTransitionTime"] == timestamp(T1)
