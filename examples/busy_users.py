"""Stateless functions for examples/busy_users.yaml (and its Python twin
examples/busy_users_pipeline.py): the filter between the keyed stage and the sink."""

from __future__ import annotations

from typing import Any

BUSY = 10


def busy(update: dict[str, Any]) -> bool:
    """Filter: per-user's update {key: user, value: count, ...} of a user with `BUSY` clicks
    or more."""
    return int(update["value"]) >= BUSY
