"""The operator's restart strategy for a checkpointed job whose coordinator failed
(keyshift.operator.k8s_restarts), the local recoveries it counts, the CR phase it leads to,
and the recoveries in the CR's status; pure. The live run, with the operator and real
processes, is in tests/test_control_plane_restarts.py."""

from __future__ import annotations

from typing import Any

import pytest

from keyshift.operator.k8s_operator import observed_phase, recovery_status
from keyshift.operator.k8s_restarts import Restarts
from keyshift.runtime.restart_strategy import RestartStrategy


def test_a_failed_job_is_recovering_while_restarted_and_failed_once_given_up() -> None:
    strategy = RestartStrategy(max_attempts=1)
    failed = {"phase": "failed", "errors": ["instance k/0 failed: boom"], "incarnation": "a"}
    restarts = Restarts()
    assert restarts.observe(strategy, failed, 100.0)  # the first restart is at once
    assert observed_phase(failed, restarts) == (
        "Recovering", None, "restarting from the latest checkpoint after: instance k/0 failed: boom"
    )  # fmt: skip
    assert not restarts.observe(strategy, failed, 101.0)  # that coordinator is restarted once
    assert not restarts.observe(strategy, {"phase": "running", "incarnation": "b"}, 102.0)
    again = {**failed, "incarnation": "b"}
    assert not restarts.observe(strategy, again, 103.0)
    phase, reason, message = observed_phase(again, restarts)
    assert (phase, reason) == ("Failed", "RestartsExhausted")
    assert message.startswith("instance k/0 failed: boom; not restarted again: 2 failures")
    assert observed_phase(again) == ("Failed", "JobFailed", "instance k/0 failed: boom")
    assert Restarts.from_json(restarts.to_json()) == restarts
    # A job restarted by hand starts afresh.
    assert not restarts.observe(strategy, {"phase": "starting", "incarnation": "c"}, 104.0)
    assert restarts.gave_up is None

    waits = Restarts(failures=[90.0])  # the second failure in a row waits initial_delay
    assert not waits.observe(RestartStrategy(initial_delay=5), failed, 100.0)
    assert waits.due == 105.0 and observed_phase(failed, waits)[0] == "Recovering"
    assert not waits.observe(RestartStrategy(initial_delay=5), failed, 104.9)
    assert waits.observe(RestartStrategy(initial_delay=5), failed, 105.0)


def test_local_recoveries_count_and_the_coordinators_giving_up_is_final() -> None:
    strategy = RestartStrategy(max_attempts=2, initial_delay=5)
    local = {"failed_at": 90.0, "mode": "local", "checkpoint": 3}
    running = {"phase": "running", "incarnation": "a", "recoveries": {"total": 1, "last": local}}
    restarts = Restarts()
    assert not restarts.observe(strategy, running, 91.0)
    assert not restarts.observe(strategy, running, 92.0)  # counted once
    assert restarts.failures == [90.0]
    failed = {**running, "phase": "failed", "errors": ["instance k/0 failed: boom"]}
    assert not restarts.observe(strategy, failed, 100.0)  # the second in a row: it waits
    assert restarts.due == 105.0 and restarts.failures == [90.0, 100.0]

    # The coordinator's strategy gave up on a loss it would have recovered locally.
    gave_up = {"phase": "failed", "incarnation": "b", "errors": ["instance k/1 was lost: died"],
               "gave_up": "3 failures in a row, ...", "recoveries": {"last": local}}  # fmt: skip
    restarts = Restarts(failures=[90.0])
    assert not restarts.observe(strategy, gave_up, 200.0)
    assert restarts.due is None and restarts.failures == [90.0]
    assert observed_phase(gave_up, restarts) == (
        "Failed", "RestartsExhausted",
        "instance k/1 was lost: died; not restarted again: 3 failures in a row, ...",
    )  # fmt: skip


@pytest.mark.parametrize(
    "memory", [{"failures": "often"}, {"failures": [1.0], "due": "soon"}, {"handled": 3}, []]
)
def test_an_unreadable_restart_memory_is_refused(memory: Any) -> None:
    with pytest.raises(ValueError, match="not a restart memory"):
        Restarts.from_json(memory)


def test_the_recoveries_in_the_status_are_the_coordinators_record() -> None:
    last = {"checkpoint": 7, "reason": "instance k/1 was lost", "seconds": 1.5, "failed_at": 1.0,
            "mode": "local"}  # fmt: skip
    assert recovery_status({"recoveries": {"total": 2, "last": last}}) == {
        "total": 2, "lastCheckpoint": 7, "lastReason": "instance k/1 was lost", "lastSeconds": 1.5,
        "lastMode": "local",
    }  # fmt: skip
    # Recorded before local recoveries existed: a global restart.
    del last["mode"]
    assert recovery_status({"recoveries": {"total": 2, "last": last}})["lastMode"] == "global"
    assert recovery_status({}) == {
        "total": 0, "lastCheckpoint": None, "lastReason": "", "lastSeconds": None,
        "lastMode": None,
    }  # fmt: skip
