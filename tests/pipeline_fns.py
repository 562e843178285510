"""Module-level functions for tests/test_pipeline.py: jobs name them as "module:qualname", so
they must live in an importable module, not in the test file's local scopes."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

NOT_A_FUNCTION = 42


def enrich(record: dict[str, Any]) -> dict[str, Any]:
    """Map: key by user, keep the amount, tag big amounts."""
    return {"user": record["key"] % 1000, "amount": record["value"], "big": record["value"] > 0.5}


def keep(record: dict[str, Any]) -> bool:
    """Filter: drop records with even keys."""
    return bool(record["key"] % 2)


def running_total(state: float | None, record: dict[str, Any]) -> tuple[float, float]:
    """Process: a running total per key, emitted on every record."""
    total = (state or 0.0) + record["value"]
    return total, total


def collect(batch: pa.RecordBatch) -> None:
    """Sink: accept and drop every batch."""


class Enricher:
    def enrich(self, record: dict[str, Any]) -> dict[str, Any]:
        return record


def region(record: dict[str, Any]) -> dict[str, Any]:
    """Map after a keyed stage: a user's update goes on keyed by the user's region."""
    return {"key": record["key"] % 7, "value": record["value"]}


SHIFT = 1_000_000


def twice(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Flat_map: a record twice (the second under a shifted key), none for keys divisible by 5."""
    if record["key"] % 5 == 0:
        return []
    value = record["value"]
    return [{"key": record["key"], "value": value}, {"key": record["key"] + SHIFT, "value": value}]
