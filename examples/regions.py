"""Stateless functions for examples/regions.yaml (and its Python twin
examples/regions_pipeline.py): a user's click count, as the first keyed stage updates it, goes
on keyed by the user's region."""

from __future__ import annotations

from typing import Any

REGIONS = 10


def to_region(update: dict[str, Any]) -> dict[str, Any]:
    """Map: per-user's update {key: user, value: count} as {region, clicks}."""
    return {"region": int(update["key"]) % REGIONS, "clicks": int(update["value"])}
