"""Tests of keyshift.policies: DS2 and the threshold baseline on hand-built topologies whose
right answer is worked out in each test, the guards, and the settings."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from keyshift.policies import make_policy
from keyshift.policies.decide import decide
from keyshift.policies.ds2 import DS2Policy
from keyshift.policies.guards import GuardState, StageHistory, guard
from keyshift.policies.model import (
    Decision,
    InstanceRates,
    Recommendation,
    ScalingInput,
    StageRates,
    rate_text,
)
from keyshift.policies.settings import AutoscalerSettings, StageBounds, settings_table
from keyshift.policies.threshold import ThresholdPolicy


def inst(records_in: float, busy: float, selectivity: float = 1.0) -> InstanceRates:
    return InstanceRates(records_in, records_in * selectivity, busy)


def source(
    offered: float | None, backlog: float = 0.0, name: str = "src", selectivity: float = 1.0
) -> StageRates:
    valid = offered is not None and math.isfinite(offered) and offered >= 0
    taken = offered if offered is not None and valid else 1000.0
    return StageRates(name, 1, (inst(taken, 0.1, selectivity),), offered=offered, backlog=backlog)


def op(name: str, upstream: Mapping[str, float], *instances: InstanceRates) -> StageRates:
    return StageRates(name, len(instances), instances, upstream=upstream)


def scaling(*stages: StageRates) -> ScalingInput:
    return ScalingInput(now=100.0, window=15.0, stages=stages)


def ds2(**overrides: object) -> DS2Policy:
    return DS2Policy(AutoscalerSettings.model_validate(overrides))


def answers(recommendations: Sequence[Recommendation]) -> dict[str, int]:
    return {r.stage: r.recommended for r in recommendations}


def by_stage(recommendations: Sequence[Recommendation]) -> dict[str, Recommendation]:
    return {r.stage: r for r in recommendations}


# --- DS2: hand-built topologies ---------------------------------------------------------------


def chain() -> ScalingInput:
    """src (10k/s offered) → a → b → c, with selectivities 0.5, 3 and 0.1.

    a: 2 instances, each 5,000 rec/s at busy 0.5: true rate 10,000/s per instance.
    b: 1 instance, 2,000 rec/s at busy 0.8: true rate 2,500/s.
    c: 3 instances, each 1,000 rec/s at busy 0.25: true rate 4,000/s per instance.
    Targets: a gets 10,000/s, b 10,000 * 0.5 = 5,000/s, c 5,000 * 3 = 15,000/s.
    """
    return scaling(
        source(10_000),
        op("a", {"src": 1.0}, inst(5_000, 0.5, 0.5), inst(5_000, 0.5, 0.5)),
        op("b", {"a": 1.0}, inst(2_000, 0.8, 3.0)),
        op("c", {"b": 1.0}, inst(1_000, 0.25, 0.1), inst(1_000, 0.25, 0.1), inst(1_000, 0.25, 0.1)),
    )


def test_ds2_chain_with_selectivities_at_full_utilization() -> None:
    # a: ceil(10,000 / 10,000) = 1; b: ceil(5,000 / 2,500) = 2; c: ceil(15,000 / 4,000) = 4.
    result = ds2(target_utilization=1.0).decide(chain())
    assert answers(result) == {"src": 1, "a": 1, "b": 2, "c": 4}
    stages = by_stage(result)
    assert stages["b"].inputs["target_rate"] == pytest.approx(5_000)
    assert stages["c"].inputs["target_rate"] == pytest.approx(15_000)
    assert stages["b"].inputs["selectivity"] == pytest.approx(3.0)
    assert stages["c"].inputs["true_rate_per_instance"] == pytest.approx(4_000)
    assert not stages["src"].scalable and all(stages[s].scalable for s in "abc")
    assert "true rate 2.5k/s per instance, target 5k/s" in stages["b"].reason


def test_ds2_chain_with_target_utilization() -> None:
    # At 0.8 each instance counts for 0.8 of its true rate:
    # a: ceil(10,000 / 8,000) = 2; b: ceil(5,000 / 2,000) = 3; c: ceil(15,000 / 3,200) = 5.
    assert answers(ds2(target_utilization=0.8).decide(chain())) == {
        "src": 1,
        "a": 2,
        "b": 3,
        "c": 5,
    }


@pytest.mark.parametrize(("utilization", "expected"), [(1.0, 4), (0.8, 5), (0.5, 8), (0.3, 14)])
def test_ds2_target_utilization_leaves_headroom(utilization: float, expected: int) -> None:
    # 4,000/s against 1,000/s per instance: ceil(4 / utilization).
    given = scaling(source(4_000), op("x", {"src": 1.0}, inst(500, 0.5)))
    assert answers(ds2(target_utilization=utilization).decide(given))["x"] == expected


def test_ds2_fan_out_with_shares_and_a_join() -> None:
    """src (12k/s) → parse (selectivity 1) → left (25 % of it, selectivity 2) and right (75 %,
    selectivity 0.5) → join (all of both).

    parse: 1 instance, 6,000 at busy 0.5: 12,000/s; target 12,000 → 1.
    left: target 3,000; 1 instance, 1,000 at busy 0.5: 2,000/s → ceil(1.5) = 2.
    right: target 9,000; 2 instances, 1,500 at busy 0.5: 3,000/s each → exactly 3.
    join: target 3,000 * 2 + 9,000 * 0.5 = 10,500; 3,500/s per instance → exactly 3.
    """
    given = scaling(
        source(12_000),
        op("parse", {"src": 1.0}, inst(6_000, 0.5)),
        op("left", {"parse": 0.25}, inst(1_000, 0.5, 2.0)),
        op("right", {"parse": 0.75}, inst(1_500, 0.5, 0.5), inst(1_500, 0.5, 0.5)),
        op("join", {"left": 1.0, "right": 1.0}, inst(3_500, 1.0, 0.0)),
    )
    result = ds2(target_utilization=1.0).decide(given)
    assert answers(result) == {"src": 1, "parse": 1, "left": 2, "right": 3, "join": 3}
    assert by_stage(result)["join"].inputs["target_rate"] == pytest.approx(10_500)


def test_ds2_copies_to_every_branch_when_shares_are_one() -> None:
    # Both branches get all 8,000/s; 1,000/s per instance each → 8 each.
    given = scaling(
        source(8_000),
        op("a", {"src": 1.0}, inst(500, 0.5)),
        op("b", {"src": 1.0}, inst(250, 0.25)),
    )
    assert answers(ds2(target_utilization=1.0).decide(given)) == {"src": 1, "a": 8, "b": 8}


def test_ds2_source_selectivity_scales_what_downstream_gets() -> None:
    # The source emits 2 records per record taken in: x gets 2 * 3,000 = 6,000/s.
    given = scaling(source(3_000, selectivity=2.0), op("x", {"src": 1.0}, inst(1_000, 0.5)))
    assert answers(ds2(target_utilization=1.0).decide(given))["x"] == 3


def test_ds2_backlog_is_caught_up_by_the_headroom_first() -> None:
    # 8,000/s offered, 1,000/s per instance, utilization 0.8 → 10 instances (8,000 / 800);
    # at full speed they take 10,000/s, 2,000/s more than offered.
    def decide(backlog: float, catch_up: float) -> Recommendation:
        given = scaling(source(8_000, backlog), op("x", {"src": 1.0}, inst(500, 0.5)))
        return by_stage(ds2(catch_up=catch_up).decide(given))["x"]

    assert decide(0, 300).recommended == 10
    # 240,000 records in 300 s: 800/s more, within the 2,000/s of headroom → still 10.
    small = decide(240_000, 300)
    assert small.recommended == 10
    assert small.inputs["catch_up_rate"] == pytest.approx(8_800)
    assert "catch-up" not in small.reason
    # 1,200,000 records in 300 s: 4,000/s more → 12,000/s at full speed → 12.
    large = decide(1_200_000, 300)
    assert large.recommended == 12
    assert "catch-up rate 12k/s" in large.reason
    # The same 240,000 records to be caught up in 60 s: 4,000/s more → 12.
    assert decide(240_000, 60).recommended == 12


def test_ds2_catch_up_rate_flows_through_selectivities() -> None:
    # src 8,000/s + 2,400,000 / 300 s = 16,000/s to catch up; a halves it: b must take 8,000/s
    # (b's target alone: 4,000/s → 5 at 0.8; at full speed 8,000 / 1,000 → 8).
    given = scaling(
        source(8_000, 2_400_000),
        op("a", {"src": 1.0}, inst(4_000, 0.2, 0.5)),
        op("b", {"a": 1.0}, inst(500, 0.5)),
    )
    result = by_stage(ds2().decide(given))
    assert result["b"].recommended == 8
    assert result["b"].inputs["target_rate"] == pytest.approx(4_000)
    assert result["b"].inputs["catch_up_rate"] == pytest.approx(8_000)


def test_ds2_sizes_for_the_backlog_the_clients_report() -> None:
    # The job takes in 4,000/s (all it manages); its clients report 120,000 rows due but not
    # pushed: over client_catch_up = 30 s that is 4,000/s more, so the target is 8,000/s, and
    # at 1,000/s per instance and utilization 0.8, x needs 10 instances (5 without it).
    def decide(client_backlog: float, **settings: object) -> dict[str, Recommendation]:
        src = StageRates("src", 1, (inst(4_000, 0.1),), client_backlog=client_backlog)
        given = scaling(src, op("x", {"src": 1.0}, inst(500, 0.5)))
        return by_stage(ds2(**settings).decide(given))

    assert decide(0)["x"].recommended == 5
    both = decide(120_000)
    assert both["x"].recommended == 10
    assert both["x"].inputs["target_rate"] == pytest.approx(8_000)
    assert both["src"].inputs["client_backlog"] == 120_000
    assert "clients' backlog 120,000 records (target 8k/s)" in both["src"].reason
    # A longer horizon asks less: 120,000 over 120 s is 1,000/s more → 5,000/s → 7.
    assert decide(120_000, client_catch_up=120)["x"].recommended == 7


def test_ds2_client_backlog_flows_through_selectivities_and_adds_to_the_catch_up() -> None:
    # src takes in 2,000/s, its clients report 60,000 (2,000/s over 30 s): target 4,000/s; a
    # halves it, so b's target is 2,000/s → 3 instances of 1,000/s at 0.8. The source's own
    # backlog, 300,000 over 300 s, adds 1,000/s to the catch-up rate on top: 5,000 → b 2,500.
    src = StageRates("src", 1, (inst(2_000, 0.1),), backlog=300_000, client_backlog=60_000)
    given = scaling(
        src,
        op("a", {"src": 1.0}, inst(2_000, 0.2, 0.5)),
        op("b", {"a": 1.0}, inst(500, 0.5)),
    )
    result = by_stage(ds2().decide(given))
    assert result["b"].inputs["target_rate"] == pytest.approx(2_000)
    assert result["b"].inputs["catch_up_rate"] == pytest.approx(2_500)
    assert result["b"].recommended == 3


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_ds2_holds_on_an_invalid_client_backlog(bad: float) -> None:
    src = StageRates("src", 1, (inst(1_000, 0.1),), client_backlog=bad)
    given = scaling(src, op("x", {"src": 1.0}, inst(500, 0.5)))
    result = by_stage(ds2().decide(given))
    assert "invalid client backlog" in result["src"].reason
    assert result["x"].recommended == result["x"].current
    assert "no target rate for upstream src" in result["x"].reason


def test_ds2_offered_rate_defaults_to_what_the_source_took_in() -> None:
    given = scaling(source(None), op("x", {"src": 1.0}, inst(250, 0.5)))
    # The source took in 1,000/s; 500/s per instance → 2.
    assert answers(ds2(target_utilization=1.0).decide(given))["x"] == 2


def test_ds2_ignores_instances_that_were_not_busy() -> None:
    # Only the first instance measured its capacity: 2,000 / 0.5 = 4,000/s. Averaging in the
    # two idle ones would make it 1,333/s and the answer 8 instead of 3.
    given = scaling(
        source(10_000),
        op("x", {"src": 1.0}, inst(2_000, 0.5), inst(0, 0.0), inst(0, 0.0)),
    )
    assert answers(ds2(target_utilization=1.0).decide(given))["x"] == 3


def test_ds2_with_no_busy_instance() -> None:
    idle = op("x", {"src": 1.0}, inst(0, 0.0), inst(0, 0.0))
    # No input at all: one instance is enough.
    quiet = by_stage(ds2().decide(scaling(source(0), idle)))["x"]
    assert quiet.recommended == 1 and "no input" in quiet.reason
    # Input arrives but no instance has measured its capacity yet: hold.
    busy = by_stage(ds2().decide(scaling(source(5_000), idle)))["x"]
    assert busy.recommended == busy.current == 2
    assert "no busy time measured" in busy.reason


def test_ds2_scales_in_a_stage_that_is_all_but_idle() -> None:
    # 7 instances, each 20 rec/s at 0.5 % busy: under MIN_BUSY (1 %), so no true rate is
    # measured, but each does at least 20 / 0.01 = 2,000/s. 300/s then needs
    # ceil(300 / (2,000 * 0.8)) = 1 instance at most.
    given = scaling(
        source(300),
        op("x", {"src": 1.0}, *[inst(20, 0.005, 0.5)] * 7),
        op("y", {"x": 1.0}, *[inst(10, 0.001)] * 3),
    )
    result = by_stage(ds2().decide(given))
    assert result["x"].recommended == 1
    assert (
        "every instance under 1% busy: true rate at least 2k/s per instance" in result["x"].reason
    )
    assert result["x"].inputs["target_rate"] == pytest.approx(300)
    # Downstream still gets a target (x halves its input): 150/s against at least 1,000/s.
    assert result["y"].recommended == 1
    assert result["y"].inputs["target_rate"] == pytest.approx(150)


def test_ds2_never_scales_out_on_the_idle_bound() -> None:
    # 2 instances at 0.5 % busy, but the sources say 100k/s are coming (an upstream stage holds
    # them back): the bound (at least 2,000/s each) would ask for 63; DS2 holds instead, and
    # still passes its target on.
    given = scaling(
        source(100_000),
        op("x", {"src": 1.0}, inst(20, 0.005), inst(20, 0.005)),
        op("y", {"x": 1.0}, inst(1_000, 0.5)),
    )
    result = by_stage(ds2().decide(given))
    assert result["x"].recommended == 2 and "no busy time measured" in result["x"].reason
    assert result["y"].inputs["target_rate"] == pytest.approx(100_000)


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        (InstanceRates(math.nan, 100, 0.5), "NaN, infinite or negative"),
        (InstanceRates(100, -1, 0.5), "NaN, infinite or negative"),
        (InstanceRates(100, 100, math.inf), "NaN, infinite or negative"),
        (InstanceRates(-5, 100, 0.5), "NaN, infinite or negative"),
    ],
)
def test_ds2_holds_a_stage_with_invalid_rates_and_says_why(
    bad: InstanceRates, problem: str
) -> None:
    given = scaling(
        source(10_000),
        op("a", {"src": 1.0}, inst(1_000, 0.5), bad),
        op("b", {"a": 1.0}, inst(1_000, 0.5)),
    )
    result = by_stage(ds2().decide(given))
    assert result["a"].recommended == result["a"].current == 2
    assert problem in result["a"].reason and "stage a" in result["a"].reason
    # Downstream has no target rate to work from: it holds too, naming the upstream.
    assert result["b"].recommended == result["b"].current == 1
    assert "no target rate for upstream a" in result["b"].reason


@pytest.mark.parametrize(
    ("offered", "backlog", "problem"),
    [
        (math.nan, 0.0, "invalid offered rate nan"),
        (-1.0, 0.0, "invalid offered rate -1.0"),
        (1_000.0, -5.0, "invalid backlog -5.0"),
        (1_000.0, math.nan, "invalid backlog nan"),
    ],
)
def test_ds2_holds_everything_downstream_of_an_invalid_source(
    offered: float, backlog: float, problem: str
) -> None:
    given = scaling(source(offered, backlog), op("x", {"src": 1.0}, inst(1_000, 0.5)))
    result = by_stage(ds2().decide(given))
    assert problem in result["src"].reason and not result["src"].scalable
    assert result["x"].recommended == result["x"].current
    assert "no target rate for upstream src" in result["x"].reason


def test_ds2_holds_a_stage_without_metrics() -> None:
    given = scaling(source(1_000), StageRates("x", 2, (), upstream={"src": 1.0}))
    x = by_stage(ds2().decide(given))["x"]
    assert x.recommended == x.current == 2 and "no metrics for stage x" in x.reason


# --- DS2: one step, no overshoot -------------------------------------------------------------


def linear_pipeline(
    offered: float, stages: Sequence[tuple[float, float, int]]
) -> tuple[ScalingInput, list[int], float]:
    """A chain whose instances scale linearly: (capacity per instance, selectivity,
    parallelism) per stage. Returns what each instance would measure (backpressure caps the
    source at the bottleneck), the optimal parallelism of each stage at utilization 1, and the
    lowest busy fraction of any stage."""
    gains, gain = [], 1.0
    for _, selectivity, _ in stages:
        gains.append(gain)
        gain *= selectivity
    taken = min(
        [offered] + [c * p / g for (c, _, p), g in zip(stages, gains, strict=True) if g > 0]
    )
    rates = [source(offered)]
    optimal = []
    lowest = 1.0
    for i, ((capacity, selectivity, parallelism), g) in enumerate(zip(stages, gains, strict=True)):
        each = taken * g / parallelism
        lowest = min(lowest, each / capacity)
        instances = [inst(each, each / capacity, selectivity)] * parallelism
        rates.append(op(f"s{i}", {"src" if i == 0 else f"s{i - 1}": 1.0}, *instances))
        optimal.append(max(1, math.ceil(offered * g / capacity - 1e-6)))
    return scaling(*rates), optimal, lowest


Chain = Sequence[tuple[float, float, int]]


def rescaled(stages: Chain, to: Sequence[int]) -> list[tuple[float, float, int]]:
    return [(c, s, p) for (c, s, _), p in zip(stages, to, strict=True)]


def test_ds2_one_step_from_an_overloaded_chain() -> None:
    # 30,000/s offered; capacities 8,000, 3,000 and 5,000 per instance; selectivities 0.5, 2, 1:
    # inputs 30,000, 15,000 and 30,000/s. The second stage caps the source at 3,000 / 0.5.
    # Optimal: ceil(30,000 / 8,000) = 4, ceil(15,000 / 3,000) = 5, ceil(30,000 / 5,000) = 6.
    stages = [(8_000.0, 0.5, 1), (3_000.0, 2.0, 1), (5_000.0, 1.0, 2)]
    given, optimal, _ = linear_pipeline(30_000, stages)
    assert optimal == [4, 5, 6]
    policy = ds2(target_utilization=1.0)
    first = [r.recommended for r in policy.decide(given)][1:]
    assert first == optimal
    # After the rescale the measured rates change, the answer does not: no overshoot.
    again, _, _ = linear_pipeline(30_000, rescaled(stages, first))
    assert [r.recommended for r in policy.decide(again)][1:] == optimal


@settings(max_examples=100, deadline=None)
@given(
    offered=st.floats(100, 1e6),
    stages=st.lists(
        st.tuples(st.floats(50, 1e5), st.floats(0.1, 4.0), st.integers(1, 20)),
        min_size=1,
        max_size=4,
    ),
)
def test_ds2_converges_in_one_step_when_rates_scale_linearly(
    offered: float, stages: list[tuple[float, float, int]]
) -> None:
    given_rates, optimal, lowest = linear_pipeline(offered, stages)
    assume(lowest >= 0.02)  # below DS2's MIN_BUSY an instance says nothing of its capacity
    policy = ds2(target_utilization=1.0)
    first = [r.recommended for r in policy.decide(given_rates)][1:]
    assert first == optimal
    # Re-fed what the optimal configuration measures, DS2 stays: no overshoot, no hunting.
    again, _, lowest_after = linear_pipeline(offered, rescaled(stages, first))
    assume(lowest_after >= 0.02)
    assert [r.recommended for r in policy.decide(again)][1:] == first


# --- the threshold baseline ------------------------------------------------------------------


def threshold(**overrides: object) -> ThresholdPolicy:
    return ThresholdPolicy(AutoscalerSettings.model_validate({"policy": "threshold", **overrides}))


@pytest.mark.parametrize(
    ("parallelism", "busy", "expected"),
    [
        (2, 0.6, 2),  # within [0.4, 0.9]: hold
        (2, 0.9, 2),  # the band is inclusive
        (2, 0.4, 2),
        (2, 1.0, 3),  # ceil(2 * 1.0 / 0.8) = ceil(2.5)
        (1, 1.0, 2),  # ceil(1.25): busy saturates, so at most *1.25 per decision
        (4, 0.95, 5),  # ceil(4.75)
        (4, 0.2, 1),  # ceil(4 * 0.2 / 0.8) = 1
        (8, 0.3, 3),  # ceil(3.0) = 3, not 4
        (3, 0.0, 1),
    ],
)
def test_threshold_scales_on_busy_outside_the_band(
    parallelism: int, busy: float, expected: int
) -> None:
    instances = [inst(100, busy)] * parallelism
    given = scaling(source(10_000), op("x", {"src": 1.0}, *instances))
    x = by_stage(threshold().decide(given))["x"]
    assert x.recommended == expected
    assert x.inputs["busy"] == pytest.approx(busy)


def test_threshold_uses_the_mean_busy_of_the_instances() -> None:
    given = scaling(source(1), op("x", {"src": 1.0}, inst(1, 1.0), inst(1, 0.6)))
    # Mean 0.8: within the band, although one instance is saturated.
    assert by_stage(threshold().decide(given))["x"].recommended == 2


def test_threshold_never_scales_sources_and_holds_on_bad_rates() -> None:
    given = scaling(
        source(1_000),
        op("x", {"src": 1.0}, InstanceRates(math.nan, 0, 0.5)),
    )
    result = by_stage(threshold().decide(given))
    assert not result["src"].scalable and result["src"].recommended == 1
    assert result["x"].recommended == 1 and "NaN" in result["x"].reason
    assert result["x"].scalable


def test_make_policy_picks_the_named_policy() -> None:
    assert isinstance(make_policy(AutoscalerSettings()), DS2Policy)
    assert isinstance(make_policy(AutoscalerSettings(policy="threshold")), ThresholdPolicy)
    assert make_policy(AutoscalerSettings()).name == "ds2"


# --- guards ----------------------------------------------------------------------------------


def rec(
    stage: str = "x", current: int = 2, recommended: int = 4, scalable: bool = True
) -> Recommendation:
    reason = f"{stage}: policy says {recommended}"
    return Recommendation(stage, current, recommended, reason, {}, scalable)


def guard_settings(**overrides: object) -> AutoscalerSettings:
    """Guards off unless a test turns one on: act on the first tick, no warm-up."""
    base: dict[str, object] = {"activation": 1, "scale_down_activation": 1, "warmup": 0.0}
    return AutoscalerSettings.model_validate({**base, **overrides})


def one(
    recommendation: Recommendation,
    config: AutoscalerSettings,
    state: GuardState | None = None,
    now: float = 100.0,
    rescaling: str | None = None,
) -> tuple[Decision, GuardState]:
    decisions, new = guard([recommendation], state or GuardState(), config, now, "ds2", rescaling)
    assert len(decisions) == 1
    return decisions[0], new


def test_guard_passes_a_clear_recommendation() -> None:
    decision, _ = one(rec(current=2, recommended=4), guard_settings())
    assert (decision.action, decision.target, decision.current) == ("scale_up", 4, 2)
    assert decision.reason == "x: policy says 4; scale up 2→4"
    assert decision.to_json()["to"] == 4 and decision.to_json()["from"] == 2
    down, _ = one(rec(current=4, recommended=2), guard_settings())
    assert (down.action, down.target) == ("scale_down", 2)


def test_guard_bounds_the_target() -> None:
    config = guard_settings(bounds={"min_parallelism": 2, "max_parallelism": 6})
    up, _ = one(rec(current=2, recommended=20), config)
    assert (up.action, up.target, up.recommended) == ("scale_up", 6, 20)
    assert "(bounded to [2, 6])" in up.reason
    down, _ = one(rec(current=5, recommended=1), config)
    assert (down.action, down.target) == ("scale_down", 2)
    # Already at the bound: nothing to do.
    held, _ = one(rec(current=6, recommended=9), config)
    assert (held.action, held.target) == ("hold", 6)
    assert "no change (bounded to [2, 6])" in held.reason


def test_ds2_sizes_the_sink_with_the_keyed_stages_within_its_partitions() -> None:
    """src (8k/s) → keyed (one instance, true rate 10k/s, selectivity 1) → sink (one instance,
    2k/s at busy 1.0: true rate 2k/s). DS2 sizes both in one decision: the keyed stage stays at
    ceil(8k / 10k) = 1, the sink needs ceil(8k / 2k) = 4 and gets its 3 output partitions; the
    source holds, saying why."""
    given = scaling(
        source(8_000),
        op("keyed", {"src": 1.0}, inst(2_000, 0.2)),
        op("sink", {"keyed": 1.0}, inst(2_000, 1.0, 0.0)),
    )
    config = guard_settings(target_utilization=1.0)
    step = decide(given, ds2(target_utilization=1.0), GuardState(), config, 100.0,
                  scalable={"keyed": 256, "sink": 3})  # fmt: skip
    decisions = {d.stage: d for d in step.decisions}
    assert decisions["sink"].recommended == 4
    assert (decisions["sink"].action, decisions["sink"].target) == ("scale_up", 3)
    assert "(bounded to [1, 3]: the most instances the stage can have)" in decisions["sink"].reason
    assert decisions["keyed"].action == "hold" and decisions["keyed"].target == 1
    assert decisions["src"].action == "hold"
    assert "set when the job starts" in decisions["src"].reason
    # A host that cannot move its sink leaves it out: reported, never applied.
    held = decide(given, ds2(target_utilization=1.0), GuardState(), config, 100.0,
                  scalable={"keyed": 256})  # fmt: skip
    sink = next(d for d in held.decisions if d.stage == "sink")
    assert sink.recommended == 4 and sink.action == "hold"
    assert "not scaled by the autoscaler" in sink.reason


def test_guard_per_stage_bounds_override_the_default() -> None:
    config = guard_settings(stages={"x": {"min_parallelism": 1, "max_parallelism": 3}})
    assert one(rec("x", 1, 10), config)[0].target == 3
    assert one(rec("y", 1, 10), config)[0].target == 8  # the default bounds: [1, 8]


def test_guard_warm_up_after_a_rescale() -> None:
    config = guard_settings(warmup=10.0)
    state = GuardState().rescaled("x", 100.0)
    held, state = one(rec(), config, state, now=105.0)
    assert held.action == "hold" and "warming up after a rescale (5 s left)" in held.reason
    acted, _ = one(rec(), config, state, now=110.0)
    assert acted.action == "scale_up"
    # Another stage's rescale does not warm this one up.
    other, _ = one(rec("y"), config, GuardState().rescaled("x", 100.0), now=101.0)
    assert other.action == "scale_up"


def test_guard_backs_off_after_failures_doubling_up_to_the_cap() -> None:
    config = guard_settings(failure_backoff=30.0, max_failure_backoff=100.0)
    state = GuardState()
    blocked = []
    for failures in range(1, 5):
        state = state.failed("x", 0.0, config)
        history = state.of("x")
        assert history.failures == failures
        blocked.append(history.blocked_until)
    assert blocked == [30.0, 60.0, 100.0, 100.0]  # 30, 60, then 120 capped at 100
    held, state = one(rec(), config, state, now=99.0)
    assert (
        held.action == "hold" and "backing off after 4 failed rescale(s) (1 s left)" in held.reason
    )
    acted, _ = one(rec(), config, state, now=100.0)
    assert acted.action == "scale_up"
    # A rescale that works forgets the failures.
    assert GuardState().failed("x", 0.0, config).rescaled("x", 5.0).of("x").failures == 0


def test_guard_failure_backs_off_without_a_warm_up() -> None:
    # Nothing changed in a refused rescale: the back-off holds the stage, not the warm-up.
    config = guard_settings(warmup=50.0, failure_backoff=10.0)
    state = GuardState().failed("x", 0.0, config)
    held, state = one(rec(), config, state, now=5.0)
    assert "backing off after 1 failed rescale(s) (5 s left)" in held.reason
    assert "warming up" not in held.reason
    acted, _ = one(rec(), config, state, now=10.0)
    assert acted.action == "scale_up"
    # A failure after a rescale that worked keeps that rescale's warm-up.
    after = GuardState().rescaled("x", 0.0).failed("x", 1.0, config)
    warming, _ = one(rec(), config, after, now=20.0)
    assert "warming up after a rescale (30 s left)" in warming.reason


def test_guard_state_survives_a_round_trip_through_json_and_goes_on_alike() -> None:
    """What the operator keeps in the CR status: the state read back decides exactly as the
    state it was written from (back-off, warm-up, a streak part-way)."""
    config = guard_settings(warmup=10.0, activation=3, failure_backoff=30.0)
    state = GuardState().rescaled("x", 50.0).failed("x", 90.0, config)
    _, state = one(rec("y"), config, state, now=95.0)  # y: a streak of 1 of 3
    written = json.loads(json.dumps(state.to_json()))
    assert written["x"]["blockedUntil"] == 120.0 and written["x"]["rescaledAt"] == 50.0
    assert written["y"] == {"rescaledAt": None, "direction": "scale_up", "streak": [4],
                            "failures": 0, "blockedUntil": None}  # fmt: skip
    read = GuardState.from_json(written)
    assert read == state
    for now in (100.0, 121.0):
        assert guard([rec("x"), rec("y")], read, config, now, "ds2") == guard(
            [rec("x"), rec("y")], state, config, now, "ds2"
        )


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ([], "a mapping of stages"),
        ({"x": 3}, "stage 'x': expected a mapping"),
        ({"x": {"direction": "sideways"}}, "stage 'x': direction must be one of"),
        ({"x": {"failures": -1}}, "stage 'x': failures must be a count"),
        ({"x": {"streak": [2, "3"]}}, "streak must be a list of parallelisms"),
        ({"x": {"rescaledAt": "yesterday"}}, "rescaledAt must be a time in seconds"),
        ({"x": {"blockedUntil": float("inf")}}, "blockedUntil must be a time in seconds"),
    ],
)
def test_guard_state_from_bad_json_is_refused_with_the_reason(bad: object, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        GuardState.from_json(bad)


@pytest.mark.parametrize(
    ("current", "recommended", "action"),
    [
        (10, 11, "hold"),  # 1 ≤ 10 % of 10
        (10, 9, "hold"),
        (10, 12, "scale_up"),
        (20, 18, "hold"),  # 2 ≤ 10 % of 20
        (20, 17, "scale_down"),
        (1, 2, "scale_up"),  # 10 % of 1 is less than one instance
        (2, 1, "scale_down"),
    ],
)
def test_guard_change_threshold(current: int, recommended: int, action: str) -> None:
    config = guard_settings(change_threshold=0.1, bounds={"max_parallelism": 64})
    decision, _ = one(rec(current=current, recommended=recommended), config)
    assert decision.action == action
    if action == "hold":
        assert "within the change threshold 10%" in decision.reason
        assert decision.target == current


def test_guard_activation_needs_consecutive_ticks() -> None:
    config = guard_settings(activation=3)
    state = GuardState()
    first, state = one(rec(recommended=4), config, state, now=1)
    second, state = one(rec(recommended=6), config, state, now=2)
    assert first.action == second.action == "hold"
    assert "scale-up to 4 seen 1/3 ticks in a row" in first.reason
    assert "scale-up to 6 seen 2/3 ticks in a row" in second.reason
    third, state = one(rec(recommended=5), config, state, now=3)
    # Up takes the latest answer.
    assert (third.action, third.target) == ("scale_up", 5)
    assert state.of("x").streak == ()


def test_guard_activation_restarts_after_a_hold_or_a_turn() -> None:
    config = guard_settings(activation=2, scale_down_activation=2)
    state = GuardState()
    _, state = one(rec(recommended=4), config, state, now=1)
    _, state = one(rec(recommended=2), config, state, now=2)  # no change: the streak ends
    held, state = one(rec(recommended=4), config, state, now=3)
    assert held.action == "hold" and "1/2" in held.reason
    _, state = one(rec(recommended=1), config, state, now=4)  # the other way: starts over
    turned, state = one(rec(recommended=4), config, state, now=5)
    assert turned.action == "hold" and "1/2" in turned.reason
    acted, _ = one(rec(recommended=4), config, state, now=6)
    assert acted.action == "scale_up"


def test_guard_scale_down_is_slower_and_takes_the_highest_of_the_ticks() -> None:
    config = guard_settings(activation=1, scale_down_activation=3)
    state = GuardState()
    answers_seen = []
    for now, recommended in enumerate([2, 5, 3], start=1):
        decision, state = one(rec(current=8, recommended=recommended), config, state, now=now)
        answers_seen.append((decision.action, decision.target))
    assert answers_seen == [("hold", 8), ("hold", 8), ("scale_down", 5)]
    # With the defaults a scale-up needs 2 ticks and a scale-down 6.
    defaults = AutoscalerSettings()
    assert (defaults.activation, defaults.scale_down_activation) == (2, 6)


def test_guard_decides_every_stage_in_one_tick_and_none_while_a_rescale_runs() -> None:
    config = guard_settings()
    decisions, _ = guard([rec("a"), rec("b", 3, 1)], GuardState(), config, 1.0, "ds2")
    assert [(d.action, d.target) for d in decisions] == [("scale_up", 4), ("scale_down", 1)]
    running, state = guard([rec("a"), rec("b")], GuardState(), config, 1.0, "ds2", rescaling="c")
    assert [d.action for d in running] == ["hold", "hold"]
    assert all("a rescale of c is running" in d.reason for d in running)
    # A stage held for another's rescale keeps its history as it was.
    assert state.of("b") == StageHistory()


def test_guard_held_stage_keeps_its_streak_while_another_rescales() -> None:
    config = guard_settings(activation=2)
    _, state = one(rec("b"), config, GuardState(), now=1)
    assert state.of("b").streak == (4,)
    held, state = one(rec("b"), config, state, now=2, rescaling="a")
    assert held.action == "hold" and state.of("b").streak == (4,)
    acted, _ = one(rec("b"), config, state, now=3)
    assert acted.action == "scale_up"


def test_guard_dry_run_reports_every_stage() -> None:
    config = guard_settings(dry_run=True)
    decisions, _ = guard([rec("a"), rec("b")], GuardState(), config, 1.0, "ds2")
    assert [d.action for d in decisions] == ["scale_up", "scale_up"]
    assert all("dry run, not applied: scale up 2→4" in d.reason for d in decisions)


def test_guard_never_scales_sources() -> None:
    decision, state = one(rec("src", 1, 5, scalable=False), guard_settings())
    assert (decision.action, decision.target) == ("hold", 1)
    assert "not scaled by the autoscaler" in decision.reason
    assert state.of("src") == StageHistory()


def test_guard_decisions_carry_the_policy_and_inputs() -> None:
    recommendation = Recommendation("x", 1, 3, "x: why", {"busy": 1.0})
    decisions, _ = guard([recommendation], GuardState(), guard_settings(), 42.0, "threshold")
    d = decisions[0]
    assert (d.stage, d.at, d.policy, d.inputs) == ("x", 42.0, "threshold", {"busy": 1.0})
    assert d.to_json()["inputs"] == {"busy": 1.0}


# --- settings --------------------------------------------------------------------------------


def test_settings_reject_min_above_max() -> None:
    with pytest.raises(ValidationError, match=r"min_parallelism \(5\) must not exceed "
                       r"max_parallelism \(2\)"):  # fmt: skip
        StageBounds(min_parallelism=5, max_parallelism=2)
    with pytest.raises(ValidationError, match="must not exceed"):
        AutoscalerSettings.model_validate({"stages": {"x": {"min_parallelism": 9}}})


@pytest.mark.parametrize(
    "field", ["interval", "metrics_window", "warmup", "catch_up", "failure_backoff"]
)
def test_settings_reject_negative_windows(field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        AutoscalerSettings.model_validate({field: -1})


def test_settings_reject_a_busy_band_upside_down() -> None:
    message = r"scale_down_busy \(0.9\) must be below scale_up_busy \(0.9\)"
    with pytest.raises(ValidationError, match=message):
        AutoscalerSettings(scale_down_busy=0.9, scale_up_busy=0.9)
    with pytest.raises(ValidationError, match="must be below"):
        AutoscalerSettings(scale_down_busy=0.95)


def test_settings_reject_a_cap_below_the_first_back_off() -> None:
    with pytest.raises(ValidationError, match="max_failure_backoff must not be below"):
        AutoscalerSettings(failure_backoff=60, max_failure_backoff=30)


def test_settings_reject_unknown_fields_and_are_frozen() -> None:
    with pytest.raises(ValidationError, match="catchup"):
        AutoscalerSettings.model_validate({"catchup": 10})
    with pytest.raises(ValidationError):
        AutoscalerSettings().interval = 1.0


def test_settings_bounds_of_a_stage() -> None:
    config = AutoscalerSettings.model_validate(
        {"bounds": {"max_parallelism": 4}, "stages": {"x": {"min_parallelism": 2}}}
    )
    assert config.bounds_of("x") == StageBounds(min_parallelism=2, max_parallelism=8)
    assert config.bounds_of("y") == StageBounds(min_parallelism=1, max_parallelism=4)


def test_settings_table_lists_every_setting() -> None:
    table = settings_table()
    for name in AutoscalerSettings.model_fields:
        assert f"| `{name}` |" in table, name
    for name in StageBounds.model_fields:
        assert f"| `bounds.{name}` |" in table, name
    rows = table.splitlines()
    assert rows[0] == "| setting | default | what it does |"
    assert len(rows) == 2 + len(AutoscalerSettings.model_fields) + len(StageBounds.model_fields)
    assert "| `catch_up` | `300.0` |" in table
    assert all(row.count("|") == 4 for row in rows)


def test_rate_text() -> None:
    assert [rate_text(v) for v in (850, 410_000, 1_200_000, 12_500)] == [
        "850/s",
        "410k/s",
        "1.2M/s",
        "12.5k/s",
    ]
