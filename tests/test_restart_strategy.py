"""The restart strategy (keyshift.runtime.restart_strategy): the delays of a series of failures,
its bound, the reset after a quiet spell, the job file's settings, bad values refused with
the field named, and which failures the coordinator and the hosts count (local recoveries
included). The hosts' use of it runs in tests/test_recovery.py (local host) and
tests/test_control_plane_restarts.py (the operator)."""

from __future__ import annotations

from typing import Any

import pytest

from keyshift.runtime.job import JobError, parse_job
from keyshift.runtime.restart_strategy import RestartStrategy, counting_local, recorded_failures


def delays(strategy: RestartStrategy, times: list[float]) -> list[float | None]:
    """The delay decided for a failure at each of `times`, each after the ones before."""
    return [strategy.decide(times[:i], now).delay for i, now in enumerate(times)]


def test_failures_in_a_row_wait_longer_and_longer_up_to_the_ceiling_then_give_up() -> None:
    strategy = RestartStrategy(initial_delay=1, max_delay=5, multiplier=2, max_attempts=6)
    assert delays(strategy, [float(t) for t in range(7)]) == [0.0, 1.0, 2.0, 4.0, 5.0, 5.0, None]
    gave_up = strategy.decide([float(t) for t in range(6)], 6.0)
    assert gave_up.attempt == 7
    assert "7 failures in a row" in gave_up.why and "allows 6 restarts" in gave_up.why


def test_a_failure_long_after_the_previous_one_starts_a_new_series() -> None:
    strategy = RestartStrategy(max_attempts=2, reset_after=100)
    assert strategy.decide([0.0, 10.0], 20.0).delay is None
    fresh = strategy.decide([0.0, 10.0], 110.0)
    assert (fresh.delay, fresh.attempt) == (0.0, 1)
    # Only the failures since the last quiet spell count.
    assert strategy.decide([0.0, 200.0], 210.0).attempt == 2


def test_huge_series_do_not_overflow() -> None:
    strategy = RestartStrategy(multiplier=100, max_attempts=10_000, max_delay=60)
    assert strategy.decide([float(t) for t in range(5000)], 5000.0).delay == 60.0


def test_the_job_file_takes_the_settings_and_defaults_them() -> None:
    spec = parse_job({"name": "t", "restart": {"initial_delay": 0.5, "max_attempts": 3}})
    assert spec.restart == RestartStrategy(initial_delay=0.5, max_attempts=3)
    assert parse_job({"name": "t"}).restart == RestartStrategy()


@pytest.mark.parametrize(
    ("restart", "named"),
    [
        ({"initial_delay": 0}, "restart.initial_delay"),
        ({"max_delay": -1}, "restart.max_delay"),
        ({"multiplier": 0.5}, "restart.multiplier"),
        ({"max_attempts": 0}, "restart.max_attempts"),
        ({"max_attempts": 2.5}, "restart.max_attempts"),
        ({"reset_after": 0}, "restart.reset_after"),
        ({"initial_delay": 10, "max_delay": 5}, "max_delay (5 s) must be at least initial_delay"),
        ({"attempts": 3}, "restart.attempts"),
        ("often", "restart"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(restart: object, named: str) -> None:
    with pytest.raises(JobError) as info:
        parse_job({"name": "t", "restart": restart})
    assert named in str(info.value)


def test_the_coordinator_counts_every_recorded_recovery_since_the_run_began() -> None:
    record: list[dict[str, Any]] = [
        {"failed_at": 5.0, "mode": "global"},  # an earlier run's
        {"failed_at": 30.0, "mode": "local"},
        {"failed_at": 20.0, "mode": "global"},
        {"checkpoint": 3},  # recorded before failures were timed
    ]
    assert recorded_failures(record, since=10.0) == [20.0, 30.0]
    strategy = RestartStrategy(initial_delay=1, max_attempts=2)
    assert strategy.decide(recorded_failures(record, 10.0), 31.0).delay is None  # the third


def test_the_hosts_count_each_local_recovery_once_besides_their_restarts() -> None:
    local = {"failed_at": 15.0, "mode": "local"}
    assert counting_local([10.0, 20.0], local) == [10.0, 15.0, 20.0]
    assert counting_local([10.0, 15.0], local) == [10.0, 15.0]  # seen on an earlier status
    # A global recovery is the host's own restart (or Kubernetes'), counted when it is made.
    assert counting_local([10.0], {"failed_at": 15.0, "mode": "global"}) == [10.0]
    assert counting_local([10.0], None) == [10.0]
    assert RestartStrategy(max_attempts=2).kept([1.0, 2.0, 3.0, 4.0]) == [2.0, 3.0, 4.0]
