"""An instance's periodic reports are its coordinator's heartbeat: keyshift.runtime.stage_context's
InstanceContext reporting to a real Coordinator served on loopback in this process. A report
that fails to gather is logged and the next one follows, so a healthy instance is never taken as
lost by its silence (a keyed instance once was: reading its group hit counts while its stage
thread updated them raised, and the reporting thread died with it).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from keyshift.runtime.coordinator import SERVICE, Coordinator
from keyshift.runtime.identity import Identity
from keyshift.runtime.protocol import RegisterRequest, ReportRequest
from keyshift.runtime.stage_context import InstanceContext
from keyshift.runtime.transport import Inbox, JsonClient
from tests.conftest import wait_for


def test_a_report_that_fails_is_logged_and_the_reports_go_on(
    one_keyed_coordinator: tuple[Coordinator, str], caplog: pytest.LogCaptureFixture
) -> None:
    coord, address = one_keyed_coordinator
    reply = coord.register(RegisterRequest(stage="counts", index=0, data_address="-"))
    control = JsonClient(address, SERVICE)
    identity = Identity.from_json(reply.identity)
    ctx = InstanceContext(coord.spec, "counts", 0, control, Inbox(), identity=identity)
    failed = threading.Event()

    def hits() -> np.ndarray:
        if not failed.is_set():
            failed.set()
            raise RuntimeError("number of non-zero array elements changed")
        return np.ones(coord.spec.max_key_groups, dtype=np.int64)

    ctx.group_hits = hits
    reporter = threading.Thread(target=ctx.report_periodically)
    reporter.start()
    try:
        wait_for(failed.is_set, 10, "a report to fail")
        before = coord.members["counts"][0].last_report
        wait_for(lambda: coord.members["counts"][0].last_report > before, 10, "the next report")
    finally:
        ctx.stop.set()
        reporter.join(timeout=10)
        control.close()
    assert "report failed; the next one follows" in caplog.text


def test_a_periodic_report_arriving_after_the_finished_one_leaves_the_final_stats(
    one_keyed_coordinator: tuple[Coordinator, str],
) -> None:
    """The reporting thread gathers its stats, the loop ends and the finished report goes, then
    the periodic one arrives: the source's final count stays (a drained job's `emitted`)."""
    coord, _ = one_keyed_coordinator
    reply = coord.register(RegisterRequest(stage="counts", index=0, data_address="-"))

    def report(emitted: int, finished: bool) -> None:
        coord.report(
            ReportRequest(
                stage="counts",
                index=0,
                identity=reply.identity,
                stats={"emitted": emitted},
                finished=finished,
            )
        )

    report(100, finished=False)
    report(250, finished=True)
    report(240, finished=False)
    assert coord.members["counts"][0].stats["emitted"] == 250
