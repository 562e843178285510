"""The map/filter functions chained on an edge into a keyed stage (runtime/edge_router.py's
`apply_transforms`), in this process: filters alone keep the batch's own rows, in order, and a
filter that raises rejects its record only, as a map's error does."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pyarrow as pa

from keyshift.runtime.edge_router import apply_transforms
from keyshift.runtime.job import resolve_function
from keyshift.runtime.records import record_schema
from keyshift.runtime.stage_context import InstanceContext

FIELDS: dict[str, Any] = {"key": "int", "value": "float", "tag": "str"}
N = 12


class Rejects:
    """What apply_transforms needs of an instance's context: its spec's `allow_non_finite`
    and where rejected records go."""

    class spec:  # stands in for InstanceContext.spec
        allow_non_finite = ()

    def __init__(self) -> None:
        self.rejected: list[tuple[str, Any]] = []

    def reject(self, reason: str, record: Any) -> None:
        self.rejected.append((reason, record))

    def context(self) -> InstanceContext:
        return cast(InstanceContext, self)


def batch() -> pa.RecordBatch:
    seq = np.arange(N, dtype=np.int64)
    return pa.RecordBatch.from_arrays(
        [pa.array(seq * 7), pa.array(seq * 0.5), pa.array([f"t{i}" for i in range(N)]),
         pa.array(seq * 1000), pa.array(seq * 1000 + 1), pa.array(np.zeros(N, np.int32)),
         pa.array(seq), pa.array(np.zeros(N, np.int32))],
        schema=record_schema(FIELDS),
    )  # fmt: skip


def even_key(record: dict[str, Any]) -> bool:
    return bool(record["key"] % 2 == 0)


def fails_on_fourth(record: dict[str, Any]) -> bool:
    if record["seq"] % 4 == 0:
        raise ValueError(f"no record {record['seq']}")
    return True


def test_filters_alone_keep_their_rows_and_reject_what_raises() -> None:
    ctx = Rejects()
    filters = [("filter", even_key), ("filter", fails_on_fourth)]
    out = apply_transforms(ctx.context(), batch(), filters, FIELDS)
    assert out.schema.equals(record_schema(FIELDS))
    assert out.column("seq").to_pylist() == [2, 6, 10]
    assert out.to_pylist() == batch().take([2, 6, 10]).to_pylist()
    assert [reason for reason, _ in ctx.rejected] == [
        f"function_error ValueError: no record {i}" for i in (0, 4, 8)
    ]


def test_filters_before_a_map_give_what_the_general_path_gives() -> None:
    """A filter then an identity map takes the general path (check and rebuild): the same rows."""
    ctx = Rejects()
    alone = apply_transforms(ctx.context(), batch(), [("filter", even_key)], FIELDS)
    identity = resolve_function("tests.test_edge_router:same")
    general = apply_transforms(
        ctx.context(), batch(), [("filter", even_key), ("map", identity)], FIELDS
    )
    assert alone.equals(general)
    assert not ctx.rejected


def same(record: dict[str, Any]) -> dict[str, Any]:
    return {name: record[name] for name in FIELDS}
