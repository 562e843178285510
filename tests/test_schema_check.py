"""Tests of keyshift.runtime.schema_check: bad records are rejected with a reason, good ones kept
in order and turned into Arrow columns of the job's types.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pyarrow as pa
import pytest

from keyshift.runtime.schema_check import check_records, non_finite_reason, why_invalid

FIELDS = {"user": "str", "clicks": "int", "amount": "float", "mobile": "bool"}


def good(i: int) -> dict[str, Any]:
    return {"user": f"u{i}", "clicks": i, "amount": i / 2, "mobile": i % 2 == 0}


def test_valid_rows_are_all_kept_in_order() -> None:
    records = [good(i) for i in range(6)]
    checked = check_records(records, FIELDS)
    assert checked.kept == list(range(6))
    assert checked.rejected == []
    assert list(checked.columns) == list(FIELDS)
    assert checked.columns["user"].to_pylist() == [f"u{i}" for i in range(6)]
    assert checked.columns["clicks"].to_pylist() == list(range(6))
    assert checked.columns["amount"].to_pylist() == [i / 2 for i in range(6)]
    assert checked.columns["mobile"].to_pylist() == [i % 2 == 0 for i in range(6)]


def test_output_column_types() -> None:
    checked = check_records([good(1)], FIELDS)
    types = {name: column.type for name, column in checked.columns.items()}
    assert types == {
        "user": pa.string(),
        "clicks": pa.int64(),
        "amount": pa.float64(),
        "mobile": pa.bool_(),
    }
    assert all(isinstance(c, pa.Array) for c in checked.columns.values())


def test_no_records_give_empty_typed_columns() -> None:
    checked = check_records([], FIELDS)
    assert checked.kept == [] and checked.rejected == []
    assert {n: (len(c), c.type) for n, c in checked.columns.items()} == {
        "user": (0, pa.string()),
        "clicks": (0, pa.int64()),
        "amount": (0, pa.float64()),
        "mobile": (0, pa.bool_()),
    }


def test_int_is_accepted_for_float_field() -> None:
    checked = check_records([{"x": 3}, {"x": 2.5}, {"x": -(2**40)}], {"x": "float"})
    assert checked.kept == [0, 1, 2]
    column = checked.columns["x"]
    assert column.type == pa.float64()
    assert column.to_pylist() == [3.0, 2.5, float(-(2**40))]
    assert all(isinstance(v, float) for v in column.to_pylist())


def test_extra_keys_are_ignored_and_any_mapping_is_a_record() -> None:
    records = [
        {**good(1), "extra": object()},
        OrderedDict(good(2)),
    ]
    checked = check_records(records, FIELDS)
    assert checked.kept == [0, 1]
    assert checked.columns["user"].to_pylist() == ["u1", "u2"]


def _without(record: dict[str, Any], name: str) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k != name}


BAD: list[tuple[str, Any, str]] = [
    ("missing str", _without(good(0), "user"), "missing field 'user'"),
    ("missing int", _without(good(0), "clicks"), "missing field 'clicks'"),
    ("None str", {**good(0), "user": None}, "missing field 'user'"),
    ("None float", {**good(0), "amount": None}, "missing field 'amount'"),
    ("None bool", {**good(0), "mobile": None}, "missing field 'mobile'"),
    ("str in int", {**good(0), "clicks": "3"}, "field 'clicks' should be int, got str"),
    ("float in int", {**good(0), "clicks": 3.0}, "field 'clicks' should be int, got float"),
    ("bool in int", {**good(0), "clicks": True}, "field 'clicks' should be int, got bool"),
    ("bool in float", {**good(0), "amount": False}, "field 'amount' should be float, got bool"),
    ("str in float", {**good(0), "amount": "1.5"}, "field 'amount' should be float, got str"),
    ("int in str", {**good(0), "user": 7}, "field 'user' should be str, got int"),
    ("bytes in str", {**good(0), "user": b"u"}, "field 'user' should be str, got bytes"),
    ("int in bool", {**good(0), "mobile": 1}, "field 'mobile' should be bool, got int"),
    ("str in bool", {**good(0), "mobile": "yes"}, "field 'mobile' should be bool, got str"),
    ("list", [1, 2, 3], "not a record (got list)"),
    ("None", None, "not a record (got NoneType)"),
    ("str", "user=u1", "not a record (got str)"),
    ("int", 5, "not a record (got int)"),
]


@pytest.mark.parametrize(
    ("record", "reason"), [(r, why) for _, r, why in BAD], ids=[b[0] for b in BAD]
)
def test_each_kind_of_bad_record_is_rejected_with_reason(record: Any, reason: str) -> None:
    assert why_invalid(record, FIELDS) == reason
    checked = check_records([good(1), record, good(2)], FIELDS)
    assert checked.kept == [0, 2]
    assert len(checked.rejected) == 1
    rejected, why = checked.rejected[0]
    assert rejected is record
    assert why == reason
    assert checked.columns["clicks"].to_pylist() == [1, 2]


def test_first_bad_field_in_schema_order_is_the_reason() -> None:
    record = {"user": 1, "clicks": None, "amount": 1.0, "mobile": True}
    assert why_invalid(record, FIELDS) == "field 'user' should be str, got int"


def test_mixed_batch_keeps_valid_rows_around_bad_ones() -> None:
    records: list[Any] = []
    expected_kept = []
    expected_reasons = []
    for i in range(30):
        if i % 4 == 1:
            records.append({**good(i), "clicks": str(i)})
            expected_reasons.append("field 'clicks' should be int, got str")
        elif i % 7 == 3:
            records.append(None)
            expected_reasons.append("not a record (got NoneType)")
        else:
            records.append(good(i))
            expected_kept.append(i)
    checked = check_records(records, FIELDS)
    assert checked.kept == expected_kept
    assert [why for _, why in checked.rejected] == expected_reasons
    assert [r for r, _ in checked.rejected] == [
        records[i] for i in range(30) if i not in expected_kept
    ]
    assert checked.columns["user"].to_pylist() == [f"u{i}" for i in expected_kept]
    assert checked.columns["amount"].to_pylist() == [i / 2 for i in expected_kept]
    assert len(checked.kept) + len(checked.rejected) == len(records)


def test_all_rejected_gives_empty_columns() -> None:
    checked = check_records([None, {}, {"user": "x"}], FIELDS)
    assert checked.kept == []
    assert [why for _, why in checked.rejected] == [
        "not a record (got NoneType)",
        "missing field 'user'",
        "missing field 'clicks'",
    ]
    assert all(len(c) == 0 for c in checked.columns.values())


@pytest.mark.parametrize(
    ("kind", "value"), [("int", 2**63), ("int", -(2**63) - 1), ("float", 2**70)]
)
def test_out_of_range_int_is_rejected_not_raised(kind: str, value: int) -> None:
    checked = check_records([{"x": 1}, {"x": value}, {"x": 2}], {"x": kind})
    # An int field must reject the value; a float field may reject it or keep it as a float.
    if kind == "int" or checked.rejected:
        assert checked.kept == [0, 2]
        assert [r for r, _ in checked.rejected] == [{"x": value}]
    else:
        assert checked.columns["x"].to_pylist() == [1.0, float(value), 2.0]


def test_int64_bounds_are_accepted() -> None:
    checked = check_records([{"x": 2**63 - 1}, {"x": -(2**63)}], {"x": "int"})
    assert checked.kept == [0, 1]
    assert checked.columns["x"].to_pylist() == [2**63 - 1, -(2**63)]


@pytest.mark.parametrize(
    ("kind", "value", "non_finite", "reason"),
    [
        ("str", "na\u00efve \u2603", (), None),
        ("str", "bad \ud800", (), "field 'x' is not valid UTF-8 (it holds a lone surrogate)"),
        ("float", float("nan"), ("x",), None),
        ("float", float("inf"), (), non_finite_reason("x")),
        ("float", -1.5, (), None),
        ("bool", False, (), None),
    ],
)
def test_plain_python_values_are_checked_as_thoroughly_as_others(
    kind: str, value: Any, non_finite: tuple[str, ...], reason: str | None
) -> None:
    """Values of exactly int/float/str/bool take a shorter path (the common case, and most of
    the source's time): it keeps every check of the general one."""
    assert why_invalid({"x": value}, {"x": kind}, non_finite) == reason
