"""The keyed stage loop: apply each incoming batch to keyed state (vectorized aggregates or a
per-record function) and send one update per changed key to the sink instance of its group.

Called by `keyshift.runtime.instance` for instances of the job's keyed stage.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pyarrow as pa

from keyshift.runtime.instance import InstanceContext
from keyshift.runtime.job import AggregateOperator, JobSpec, resolve_function
from keyshift.runtime.metrics import MetricName
from keyshift.runtime.records import (
    ARROW_TYPES,
    EVENT_TIME,
    GROUP,
    INGEST_TIME,
    SEQ,
    SOURCE,
    decode,
    encode,
    split_by_owner,
)
from keyshift.runtime.state import KEY_COL, AggregateState, ProcessState


def make_state(spec: JobSpec) -> AggregateState | ProcessState:
    key_type = ARROW_TYPES[spec.fields[spec.keyed.key_by]]
    op = spec.keyed.operator
    if isinstance(op, AggregateOperator):
        return AggregateState(op.function, spec.max_key_groups, key_type)
    return ProcessState(resolve_function(op.function), spec.max_key_groups, key_type)


def process_output_schema(key_type: pa.DataType) -> pa.Schema:
    return pa.schema(
        [
            pa.field(KEY_COL, key_type),
            pa.field("value", pa.string()),
            pa.field(EVENT_TIME, pa.int64()),
            pa.field(INGEST_TIME, pa.int64()),
            pa.field(SOURCE, pa.int32()),
            pa.field(SEQ, pa.int64()),
            pa.field(GROUP, pa.int32()),
        ]
    )


def run(ctx: InstanceContext) -> None:
    spec = ctx.spec
    state = make_state(spec)
    ctx.state_size = lambda: (state.key_count, state.bytes_estimate())
    op = spec.keyed.operator
    value_field = op.field if isinstance(op, AggregateOperator) else None
    key_field = spec.keyed.key_by
    outlets = ctx.connect(spec.sink.name)
    sink_parallelism = len(outlets)
    upstream = ctx.upstream_count(spec.source.name)
    ended = 0
    metrics = ctx.metrics
    out_schema = process_output_schema(state.key_type)
    while ended < upstream:
        ctx.check()
        t_wait = time.perf_counter()
        delivery = ctx.inbox.get(timeout=0.1)
        metrics.count(MetricName.IDLE_SECONDS, time.perf_counter() - t_wait)
        if delivery is None:
            continue
        if delivery.payload is None:
            ended += 1
            continue
        t0 = time.perf_counter()
        batch = decode(delivery.payload)
        delivery.release()
        if isinstance(state, AggregateState):
            out = state.apply(batch, key_field, value_field).batch
        else:
            rows, _ = state.apply(batch, key_field)
            for row in rows:
                row["value"] = json.dumps(row["value"])
            out = pa.RecordBatch.from_pylist(rows, schema=out_schema)
        metrics.count(MetricName.RECORDS_IN, batch.num_rows)
        if out.num_rows:
            groups = out.column(GROUP).to_numpy()
            owners = (groups % sink_parallelism).astype(np.int64)
            parts = [(o, encode(p)) for o, p in split_by_owner(out, owners, sink_parallelism)]
        else:
            parts = []
        metrics.count(MetricName.BUSY_SECONDS, time.perf_counter() - t0)
        for owner, payload in parts:
            ctx.send(outlets[owner], payload)
        metrics.count(MetricName.RECORDS_OUT, out.num_rows)
    for outlet in outlets:
        outlet.finish()
