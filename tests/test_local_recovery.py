"""Local recovery's settings and choices (keyshift.runtime.local_recovery): the job file's
`recovery` switch, which losses are recovered locally rather than by the global restart, and
the restart strategy's delay on a recovery under way; pure. The fence is tested in
tests/test_transport.py, the recoveries themselves with real processes in
tests/test_recovery.py (local host) and tests/test_control_plane_restarts.py (Kubernetes,
against the API emulator)."""

from __future__ import annotations

from typing import Any

import pytest

from keyshift.runtime.job import JobError, local_recovery, parse_job
from keyshift.runtime.local_recovery import LOCAL_RECOVERY_TIMEOUT, LocalRecovery, refusal
from keyshift.runtime.protocol import ProtocolError, Rewind, parse_command

CHECKPOINTS = {"checkpoints": {"interval": 1, "storage": "/tmp/nowhere"}}


def test_a_checkpointed_job_recovers_locally_unless_it_asks_for_the_global_restart() -> None:
    assert local_recovery(parse_job({"name": "t", **CHECKPOINTS}))
    assert not local_recovery(parse_job({"name": "t", **CHECKPOINTS, "recovery": "global"}))
    assert not local_recovery(parse_job({"name": "t"}))  # no checkpoint to rewind to


@pytest.mark.parametrize("value", ["sometimes", 1, None])
def test_a_bad_recovery_is_refused_naming_the_field(value: Any) -> None:
    with pytest.raises(JobError, match="recovery"):
        parse_job({"name": "t", **CHECKPOINTS, "recovery": value})


LOCAL = dict(enabled=True, keyed=True, phase="running", rescaling=False, draining=False,
             finished=False, ingest=False)  # fmt: skip


def test_a_lost_keyed_instance_of_a_running_job_is_recovered_locally() -> None:
    assert refusal(**LOCAL) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"enabled": False}, "recovery: global"),
        ({"keyed": False}, "a source or sink is not"),
        ({"phase": "starting"}, "the job is starting"),
        ({"rescaling": True}, "a rescale runs"),
        ({"draining": True}, "draining"),
        ({"finished": True}, "have finished"),
        ({"ingest": True}, "ingest source"),
    ],
)
def test_other_losses_restart_the_job_globally_saying_why(change: dict[str, Any], why: str) -> None:
    refused = refusal(**{**LOCAL, **change})
    assert refused is not None and why in refused


def test_a_rewind_opens_a_later_generation() -> None:
    rewind = Rewind(generation=2, checkpoint=7)
    assert parse_command(rewind.wire()) == rewind
    with pytest.raises(ProtocolError, match="generation"):
        parse_command({"type": "rewind", "generation": 0, "checkpoint": 7})


def test_the_restart_strategys_delay_holds_the_replacement_and_the_deadline() -> None:
    recovery = LocalRecovery(1, "lost", {"k/0": 42}, {"k/1"}, delay=2.0, started=100.0)
    recovery.rewound.add("k/1")
    assert (recovery.due, recovery.deadline) == (102.0, 102.0 + LOCAL_RECOVERY_TIMEOUT)
    assert not recovery.complete({"k/0", "k/1"}, 101.9)  # rewound and registered: not yet due
    assert recovery.complete({"k/0", "k/1"}, 102.0)
    assert not recovery.complete({"k/1"}, 103.0)  # the replacement has not registered
