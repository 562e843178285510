"""User functions for tests/test_poison_rows.py: a map that makes some records a stage could
not process (a float beyond the double range, a string UTF-8 cannot encode, NaN); the job
must reject them alone."""

from __future__ import annotations

from typing import Any


def poison_some(record: dict[str, Any]) -> dict[str, Any]:
    """Every 5th record (by seq) gets a value no stage can take: which one cycles with seq."""
    seq = record["seq"]
    tag, value = "ok", 1.0
    if seq % 5 == 0:
        tag, value = [("ok", 10**400), ("\ud800", 1.0), ("ok", float("nan"))][seq // 5 % 3]
    return {"key": record["key"], "value": value, "tag": tag}
