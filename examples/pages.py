"""Stateless functions for examples/pages.yaml (and its Python twin examples/pages_pipeline.py).

A generated click {key, value} becomes a page view: the user is the key, the page is one of
100 derived from the user and the click, and only views that lasted (value >= 0.2) count.
"""

from __future__ import annotations

from typing import Any

PAGES = 100


def to_view(record: dict[str, Any]) -> dict[str, Any]:
    """Map: a click as a page view {user, page, seconds}."""
    user = int(record["key"])
    return {
        "user": user,
        "page": (user * 31 + int(record["value"] * 1000)) % PAGES,
        "seconds": float(record["value"]) * 60,
    }


def lasted(record: dict[str, Any]) -> bool:
    """Filter: views of at least 12 seconds."""
    return bool(record["seconds"] >= 12)
