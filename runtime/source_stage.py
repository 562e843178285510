"""The source stage loop: make records (generator), run the chained map/filter functions, check
them against the schema, compute key groups, and send each record to its keyed owner.

Called by `keyshift.runtime.instance` for instances of the job's source stage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from keyshift.runtime.generator import KeyGenerator, Pacer, instance_total, rate_at
from keyshift.runtime.instance import InstanceContext
from keyshift.runtime.job import GeneratorSource, JobSpec, resolve_function
from keyshift.runtime.keyspace import key_groups
from keyshift.runtime.metrics import MetricName
from keyshift.runtime.records import (
    EVENT_TIME,
    GROUP,
    INGEST_TIME,
    METADATA_FIELDS,
    SEQ,
    SOURCE,
    encode,
    now_us,
    record_schema,
    split_by_owner,
)
from keyshift.runtime.schema_check import check_records

log = logging.getLogger("keyshift.source")
Transform = tuple[str, Callable[..., Any]]


def _transforms(spec: JobSpec) -> list[Transform]:
    return [
        ("map", resolve_function(t.map)) if t.map else ("filter", resolve_function(t.filter or ""))
        for t in spec.source.transforms
    ]


def apply_transforms(
    ctx: InstanceContext, batch: pa.RecordBatch, transforms: list[Transform]
) -> pa.RecordBatch:
    """Run map/filter per record; reject what fails or does not fit; keep the rest in order."""
    fields = ctx.spec.fields
    results: list[dict[str, Any]] = []
    for record in batch.to_pylist():
        current: Any = record
        try:
            for kind, fn in transforms:
                if kind == "map":
                    meta = {f: current[f] for f in METADATA_FIELDS}
                    current = fn(current)
                    if isinstance(current, dict):
                        current = {**current, **meta}
                elif not fn(current):
                    current = None
                    break
        except Exception as exc:
            ctx.reject(f"function_error {type(exc).__name__}: {exc}", record)
            continue
        if current is not None:
            results.append(current)
    checked = check_records(results, fields)
    for bad, reason in checked.rejected:
        ctx.reject(f"schema {reason}", bad)
    kept = checked.kept
    columns = dict(checked.columns)
    for name, kind in (
        (EVENT_TIME, pa.int64()),
        (INGEST_TIME, pa.int64()),
        (SOURCE, pa.int32()),
        (SEQ, pa.int64()),
    ):
        columns[name] = pa.array([results[i][name] for i in kept], type=kind)
    return pa.RecordBatch.from_pydict(
        {**columns, GROUP: pa.array(np.zeros(len(kept), dtype=np.int32))},
        schema=record_schema(fields),
    )


def run(ctx: InstanceContext) -> None:
    spec = ctx.spec
    config = spec.source.config
    if not isinstance(config, GeneratorSource):
        raise NotImplementedError("the ingest source arrives with the PySpark connectors")
    parallelism = spec.source.parallelism
    generator = KeyGenerator(config, source_id=ctx.index)
    pacer = Pacer(
        config.profile, 1.0 / parallelism, instance_total(config.total, ctx.index, parallelism)
    )
    transforms = _transforms(spec)
    outlets = ctx.connect(spec.keyed.name)
    owners = ctx.assignment().owners
    keyed_parallelism = len(outlets)
    schema = record_schema({"key": "int", "value": "float"})
    max_records = spec.batching.max_records
    linger = spec.batching.linger_ms / 1000.0
    metrics = ctx.metrics
    seq = 0
    start = time.monotonic()
    last_emit = start
    while not pacer.done(seq):
        ctx.check()
        if ctx.drain.is_set():
            break
        now = time.monotonic()
        elapsed = now - start
        target = rate_at(config.profile, elapsed)
        metrics.source_target_rate.set(target / parallelism if target is not None else 0)
        due = pacer.due(elapsed, seq)
        if due is None:
            n = max_records
        elif due >= max_records or (due > 0 and now - last_emit >= linger):
            n = min(due, max_records)
        else:
            wait = max(
                0.0005, min(linger - (now - last_emit), pacer.seconds_until_next(elapsed, seq))
            )
            time.sleep(wait)
            metrics.count(MetricName.IDLE_SECONDS, wait)
            continue
        t0 = time.perf_counter()
        keys, values = generator.records(seq, n)
        stamp = now_us()
        times = np.full(n, stamp, dtype=np.int64)
        batch = pa.RecordBatch.from_arrays(
            [
                pa.array(keys),
                pa.array(values),
                pa.array(times),
                pa.array(times),
                pa.array(np.full(n, ctx.index, dtype=np.int32)),
                pa.array(np.arange(seq, seq + n, dtype=np.int64)),
                pa.array(np.zeros(n, dtype=np.int32)),
            ],
            schema=schema,
        )
        seq += n
        if transforms:
            batch = apply_transforms(ctx, batch, transforms)
        groups = key_groups(batch.column(spec.keyed.key_by), spec.max_key_groups)
        batch = batch.set_column(batch.schema.get_field_index(GROUP), GROUP, pa.array(groups))
        parts = [
            (owner, encode(part))
            for owner, part in split_by_owner(batch, owners[groups], keyed_parallelism)
        ]
        metrics.count(MetricName.BUSY_SECONDS, time.perf_counter() - t0)
        for owner, payload in parts:
            ctx.send(outlets[owner], payload)
        metrics.count(MetricName.RECORDS_OUT, batch.num_rows)
        metrics.count(MetricName.RECORDS_IN, n)
        last_emit = now
    ctx.extra_stats["emitted"] = seq
    for outlet in outlets:
        outlet.finish()
