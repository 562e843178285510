"""Checks records against the job's schema and turns the valid ones into Arrow columns.

Records produced by user functions and rows ingested from clients (keyshift.runtime.ingest) may
not fit the job's `fields`. Each bad record is rejected with a reason; the valid records around
it are kept. Whatever `why_invalid` accepts can be made into Arrow columns and processed by every
stage: strings are valid Unicode (no lone surrogates, which UTF-8 cannot encode), floats are
finite unless the field is in the job's `allow_non_finite`, and ints fit their field's type.
`event_time_problem` judges the one field a source takes its records' event times from.
Used by the source stage instances and the ingest endpoint.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from keyshift.runtime.records import ARROW_TYPES

# numbers.Integral/Real also admit numpy scalars, which users' functions often return.
_ACCEPTS: Mapping[str, tuple[type, ...]] = {
    "int": (numbers.Integral,),
    "float": (numbers.Real,),
    "str": (str,),
    "bool": (bool, np.bool_),
}
_INT64 = (-(2**63), 2**63 - 1)
# The plain Python type of each field kind: a value of exactly that type skips the abstract
# checks above, which cost most of the check (a record of 20 fields took ~0.25 ms).
_EXACT: Mapping[str, Any] = {"int": int, "float": float, "str": str, "bool": bool}


@dataclass
class Checked:
    columns: dict[str, pa.Array]
    kept: list[int]  # positions of the valid records in the input
    rejected: list[tuple[Mapping[str, Any] | Any, str]] = field(default_factory=list)


def why_invalid(
    record: Any, fields: Mapping[str, str], non_finite: Collection[str] = ()
) -> str | None:
    """The reason a record does not fit `fields`, or None when it does. Float fields named in
    `non_finite` may hold NaN and infinities; other float fields must be finite."""
    if not isinstance(record, Mapping):
        return f"not a record (got {type(record).__name__})"
    for name, kind in fields.items():
        if name not in record or record[name] is None:
            return f"missing field {name!r}"
        value = record[name]
        if type(value) is _EXACT[kind]:
            if kind == "int" and not _INT64[0] <= value <= _INT64[1]:
                return f"field {name!r} is out of the 64-bit integer range"
            if kind == "float" and not math.isfinite(value) and name not in non_finite:
                return non_finite_reason(name)
            if kind == "str" and not value.isascii() and not _encodable(value):
                return f"field {name!r} is not valid UTF-8 (it holds a lone surrogate)"
            continue
        # bool is an int in Python; a bool in an int field is almost always a mistake.
        if not isinstance(value, _ACCEPTS[kind]) or (kind != "bool" and isinstance(value, bool)):
            return f"field {name!r} should be {kind}, got {type(value).__name__}"
        in_range = not isinstance(value, numbers.Integral) or _INT64[0] <= int(value) <= _INT64[1]
        if kind == "int" and not in_range:
            return f"field {name!r} is out of the 64-bit integer range"
        if kind == "float" and (problem := _float_problem(name, value, name in non_finite)):
            return problem
        if isinstance(value, str) and not _encodable(value):
            return f"field {name!r} is not valid UTF-8 (it holds a lone surrogate)"
    return None


def event_time_problem(record: Any, name: str) -> str | None:
    """Why a record's event time, its int field `name`, is missing, null or not a timestamp;
    None when it is one (or the record is no mapping: `why_invalid` says so)."""
    if not isinstance(record, Mapping):
        return None
    return why_invalid({name: record.get(name)}, {name: "int"})


def _float_problem(name: str, value: Any, non_finite: bool) -> str | None:
    try:
        number = float(value)
    except OverflowError:  # an int beyond the double range
        return f"field {name!r} is out of the float range"
    if not non_finite and not math.isfinite(number):
        return non_finite_reason(name)
    return None


def non_finite_reason(name: str) -> str:
    """The reason a NaN or infinity in a float field that does not allow them is rejected."""
    return f"field {name!r} is not a finite number (add it to allow_non_finite to accept NaN/inf)"


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _as_float(value: Any) -> float:
    return float(value)


def check_records(
    records: Sequence[Any], fields: Mapping[str, str], non_finite: Collection[str] = ()
) -> Checked:
    kept: list[int] = []
    rejected: list[tuple[Any, str]] = []
    for i, record in enumerate(records):
        reason = why_invalid(record, fields, non_finite)
        if reason is None:
            kept.append(i)
        else:
            rejected.append((record, reason))
    columns = {
        name: pa.array(
            [_as_float(records[i][name]) if kind == "float" else records[i][name] for i in kept],
            type=ARROW_TYPES[kind],
        )
        for name, kind in fields.items()
    }
    return Checked(columns=columns, kept=kept, rejected=rejected)
