"""A rescale paced to a latency objective (`max_latency_ms`): the pure AIMD controller, and the
option's validation for every entry point (Rescale RPC, CLI and StreamingJob all go through
`options_for`). The live rescales are in tests/test_rescale.py."""

from __future__ import annotations

from typing import Any

import pytest

from keyshift.operator.streamingjob import StreamingJobSpec
from keyshift.runtime.pacing import FLOOR_KEYS_PER_S, PERIOD_S, PushPacer, recent_p99
from keyshift.runtime.rescale import RescaleError, options_for


def samples(at: float, latency: float, n: int = 100) -> list[tuple[float, float]]:
    return [(at + i / n / 2, latency) for i in range(n)]


def test_recent_p99_reads_only_samples_after_since() -> None:
    old = samples(0.0, 9.0)
    new = samples(10.0, 0.02)
    assert recent_p99(old + new, since=5.0) == pytest.approx(0.02)
    assert recent_p99(old, since=5.0) is None
    assert recent_p99([], since=0.0) is None


def test_the_rate_grows_additively_under_the_objective_and_halves_above_it() -> None:
    pacer = PushPacer(objective_s=0.1, step_keys_per_s=4000)
    pacer.start(0.0)
    assert pacer.rate_keys_per_s == 4000
    # Within a period nothing is decided.
    assert pacer.decide(PERIOD_S / 2, samples(0.1, 0.05)) is None
    assert pacer.decide(PERIOD_S, samples(0.1, 0.05)) == 8000
    assert pacer.decide(2 * PERIOD_S, samples(PERIOD_S + 0.1, 0.05)) == 12000
    assert pacer.decide(3 * PERIOD_S, samples(2 * PERIOD_S + 0.1, 0.5)) == 6000
    assert pacer.rates == [4000, 8000, 12000, 6000]
    assert pacer.worst_p99_s == pytest.approx(0.5) and pacer.met() is False


def test_an_impossible_objective_bottoms_out_at_the_floor_so_the_move_completes() -> None:
    pacer = PushPacer(objective_s=0.001, step_keys_per_s=32768)
    pacer.start(0.0)
    for period in range(1, 20):
        pacer.decide(period * PERIOD_S, samples((period - 1) * PERIOD_S + 0.1, 0.2))
    assert pacer.rate_keys_per_s == FLOOR_KEYS_PER_S
    assert pacer.rates[-1] == FLOOR_KEYS_PER_S and min(pacer.rates) == FLOOR_KEYS_PER_S
    # At the floor, a period above the objective changes nothing more.
    assert pacer.decide(30 * PERIOD_S, samples(29 * PERIOD_S + 0.1, 0.2)) is None


def test_a_period_without_samples_keeps_the_rate_and_judges_nothing() -> None:
    pacer = PushPacer(objective_s=0.1, step_keys_per_s=2000)
    pacer.start(0.0)
    assert pacer.decide(PERIOD_S, []) is None
    assert pacer.met() is None and pacer.worst_p99_s is None
    # The move's tail after the last decision still counts in the worst p99.
    assert pacer.finish(samples(PERIOD_S + 0.1, 0.08)) == pytest.approx(0.08)
    assert pacer.met() is True


def test_max_latency_ms_applies_to_the_strategies_that_keep_records_flowing() -> None:
    for strategy in ("hot-first", "batched"):
        assert options_for(strategy, {"max_latency_ms": 250})["max_latency_ms"] == 250.0


@pytest.mark.parametrize(
    ("strategy", "options", "message"),
    [
        ("all-at-once", {"max_latency_ms": 100}, "'max_latency_ms' does not apply to all-at-once"),
        ("lazy", {"max_latency_ms": 100}, "'max_latency_ms' does not apply to lazy"),
        ("hot-first", {"max_latency_ms": 0}, "'max_latency_ms' must be a positive number"),
        ("hot-first", {"max_latency_ms": -5}, "must be a positive number, got -5"),
        ("hot-first", {"max_latency_ms": "fast"}, "must be a positive number, got 'fast'"),
        (
            "batched",
            {"max_latency_ms": 100, "trickle_keys_per_s": 500},
            "'max_latency_ms' and 'trickle_keys_per_s' exclude each other",
        ),
    ],
)
def test_bad_max_latency_ms_is_refused_with_the_reason(
    strategy: str, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(RescaleError, match=message):
        options_for(strategy, options)


def test_a_streamingjob_checks_max_latency_ms_against_its_strategy() -> None:
    def problems(migration: dict[str, Any]) -> list[str]:
        spec = {"image": "x", "job": {"name": "clicks"}, "migration": migration}
        return StreamingJobSpec.model_validate(spec).problems()

    assert problems({"options": {"max_latency_ms": 200}}) == []
    (problem,) = problems({"strategy": "lazy", "options": {"max_latency_ms": 200}})
    assert "'max_latency_ms' does not apply to lazy" in problem
