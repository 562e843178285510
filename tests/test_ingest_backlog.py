"""The backlog ingest clients report (keyshift.runtime.ingest_backlog): the header field's wire
form and its failures, and the endpoint's per-client aggregate with expiry. The endpoint's
handling of the field over gRPC is tested in tests/test_ingest.py."""

from __future__ import annotations

from typing import Any

import pytest

from keyshift.runtime.ingest_backlog import (
    BACKLOG_VERSION,
    BacklogTotal,
    BadBacklog,
    ClientBacklog,
    ClientBacklogs,
)


def test_a_backlog_goes_through_its_wire_form_unchanged() -> None:
    backlog = ClientBacklog("query-1", 12_000, 2.5)
    header = backlog.to_header()
    assert header["version"] == BACKLOG_VERSION == 1
    assert ClientBacklog.from_header(header) == backlog
    assert ClientBacklog.from_header({**header, "oldest_seconds": 3}).oldest_seconds == 3.0


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ([1, 2], "backlog must be a JSON object, got list"),
        ({"client": "q", "rows": 1, "oldest_seconds": 0}, "'version' None is not supported"),
        ({"version": 2, "client": "q", "rows": 1, "oldest_seconds": 0}, "reads version 1"),
        ({"version": True, "client": "q", "rows": 1, "oldest_seconds": 0}, "not supported"),
        ({"version": 1, "client": 7, "rows": 1, "oldest_seconds": 0}, "'client' must be a str"),
        ({"version": 1, "client": "", "rows": 1, "oldest_seconds": 0}, "non-empty string"),
        ({"version": 1, "client": "q", "rows": 1.5, "oldest_seconds": 0}, "whole number"),
        ({"version": 1, "client": "q", "rows": -1, "oldest_seconds": 0}, "'rows' must be >= 0"),
        ({"version": 1, "client": "q", "rows": 1}, "'oldest_seconds' must be a number"),
        ({"version": 1, "client": "q", "rows": 1, "oldest_seconds": -2}, "finite number >= 0"),
        ({"version": 1, "client": "q", "rows": 1, "oldest_seconds": float("inf")}, "finite"),
    ],
)
def test_a_malformed_backlog_says_what_is_wrong(field: Any, message: str) -> None:
    with pytest.raises(BadBacklog, match=message):
        ClientBacklog.from_header(field)


def test_the_latest_report_per_client_counts_and_ages_until_it_expires() -> None:
    backlogs = ClientBacklogs(ttl=30.0)
    assert backlogs.total(0.0) == BacklogTotal(0, 0.0)
    backlogs.report(ClientBacklog("a", 1000, 2.0), now=100.0)
    backlogs.report(ClientBacklog("b", 500, 1.0), now=100.0)
    backlogs.report(ClientBacklog("a", 4000, 3.0), now=105.0)  # replaces a's first report
    total = backlogs.total(110.0)
    assert total.rows == 4500
    # Rows age while unpushed, as far as the endpoint knows: a's oldest was 3 s old 5 s ago
    # (8 s now), b's 1 s old 10 s ago (11 s now).
    assert total.oldest_seconds == pytest.approx(11.0)
    # b has not reported for more than 30 s: its client is gone, its backlog with it.
    assert backlogs.total(131.0) == BacklogTotal(4000, pytest.approx(29.0))  # type: ignore[arg-type]
    assert backlogs.total(136.0) == BacklogTotal(0, 0.0)


def test_a_client_that_caught_up_has_no_oldest_row() -> None:
    backlogs = ClientBacklogs()
    backlogs.report(ClientBacklog("a", 0, 0.0), now=10.0)
    assert backlogs.total(40.0) == BacklogTotal(0, 0.0)


def test_expiry_must_be_positive() -> None:
    with pytest.raises(ValueError, match="ttl must be positive"):
        ClientBacklogs(ttl=0)
