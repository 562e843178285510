"""User functions for tests/test_poison_rows.py: a map that makes some records a stage could
not process (a float beyond the double range, a string UTF-8 cannot encode, NaN); the job
must reject them alone."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any


class Fields(Mapping[str, Any]):
    """A read-only mapping that is no dict (and has no record metadata of its own)."""

    def __init__(self, **values: Any) -> None:
        self._values = values

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


def poison_some(record: dict[str, Any]) -> Mapping[str, Any]:
    """Every 5th record (by seq) gets a value no stage can take: which one cycles with seq.
    Of the others, every 5th is a valid record returned as a Mapping that is no dict."""
    seq = record["seq"]
    tag, value = "ok", 1.0
    if seq % 5 == 0:
        tag, value = [("ok", 10**400), ("\ud800", 1.0), ("ok", float("nan"))][seq // 5 % 3]
    elif seq % 5 == 1:
        return Fields(key=record["key"], value=value, tag=tag)
    return {"key": record["key"], "value": value, "tag": tag}
