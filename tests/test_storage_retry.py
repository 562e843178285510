"""How keyshift tries failing storage again (keyshift.runtime.storage's Backoff and
`retrying`): pauses that double up to a limit, retryable failures waited out, other errors
and a stop raised at once."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from keyshift.runtime.storage import Backoff, StorageError, retrying


def test_pauses_double_up_to_the_limit_and_start_again_after_a_success() -> None:
    backoff = Backoff(0.5, 3.0)
    assert backoff.due()
    assert [backoff.failed() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert not backoff.due()
    backoff.reset()
    assert backoff.due() and backoff.failed() == 0.5


def failing(errors: list[StorageError]) -> Callable[[], str]:
    """A call that raises `errors` in turn, then answers."""

    def call() -> str:
        if errors:
            raise errors.pop(0)
        return "answer"

    return call


def test_retrying_waits_out_retryable_failures() -> None:
    errors = [StorageError("down", retryable=True), StorageError("still down", retryable=True)]
    assert retrying(failing(errors), "a test", backoff=Backoff(0.01, 0.02)) == "answer"
    assert not errors


def test_retrying_raises_other_errors_and_stops_when_told() -> None:
    corrupt = StorageError("corrupt")
    with pytest.raises(StorageError, match="corrupt"):
        retrying(failing([corrupt, corrupt]), "a test", backoff=Backoff(0.01))
    stop = threading.Event()
    stop.set()
    with pytest.raises(StorageError, match="down"):
        retrying(failing([StorageError("down", retryable=True)]), "a test", stop)
