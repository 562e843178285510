"""The sink stage loop: measure end-to-end latency, and append updates to the ordered output
log (or hand them to a user's function). While a named reader of the log lags too far behind,
the loop takes no records (keyshift.runtime.log_retention): the job is backpressured. A job
with checkpoints publishes its log up to each completed checkpoint's offset, and all of it
when the job finishes (keyshift.runtime.output_log): readers never see output a recovery
would make again.

Called by `keyshift.runtime.instance` for instances of the job's sink stage.
"""

from __future__ import annotations

import json
import time
from collections import deque

import numpy as np

from keyshift.runtime.checkpointing import CHECKPOINT_COMPLETE, SINK_ACK, BarrierAligner
from keyshift.runtime.instance import InstanceContext
from keyshift.runtime.job import FunctionSink, resolve_function
from keyshift.runtime.log_retention import LogRetention
from keyshift.runtime.metrics import MetricName
from keyshift.runtime.output_log import OutputLogWriter
from keyshift.runtime.records import GROUP, INGEST_TIME, decode, now_us
from keyshift.runtime.transport import BARRIER, END, LEAVE, Delivery

FLUSH_INTERVAL = 1.0
BLOCKED_WAIT = 0.05  # seconds between looks at the readers' progress while they lag
RECENT_SAMPLES = 256


def run(ctx: InstanceContext) -> None:
    spec = ctx.spec
    config = spec.sink.config
    if isinstance(config, FunctionSink):
        function = resolve_function(config.function)
        writer = None
    else:
        function = None
        writer = OutputLogWriter(config.path, ctx.index, config.format, config.segment_records)
        retention = LogRetention(writer, config.path, config.readers, config.max_unread_records)
        offset = ctx.restore.outputs.get(str(ctx.index)) if ctx.restore else None
        if offset is not None:
            # What came after the checkpoint is made again by the replay from its positions.
            writer.truncate(offset)
        if spec.checkpoints is not None:
            writer.publish(writer.end_offset)  # an earlier run's output, or the checkpoint's
    ctx.wait_topology()
    ended: set[str] = set()
    aligner = BarrierAligner()
    held: deque[Delivery] = deque()  # what aligned senders sent during the last alignment
    recent: deque[tuple[float, float]] = deque(maxlen=RECENT_SAMPLES)
    ctx.extra_stats["latency_recent"] = recent
    metrics = ctx.metrics
    last_flush = time.monotonic()
    # The keyed stage's membership changes with rescales: the log is complete once every
    # current upstream instance has ended its stream (retired ones are no longer upstream).
    while not ctx.upstream_names(spec.keyed.name) <= ended:
        ctx.check()
        while (command := ctx.next_command()) is not None:
            # Topology updates are read through ctx.upstream_names.
            if command.get("type") == CHECKPOINT_COMPLETE and writer is not None:
                published = command["outputs"].get(str(ctx.index))
                if published is not None:
                    writer.publish(int(published))
        if writer is not None:
            retention.poll()
            if retention.blocked():
                writer.flush()  # the readers can only catch up on what is in segments
                time.sleep(BLOCKED_WAIT)
                metrics.count(MetricName.BACKPRESSURED_SECONDS, BLOCKED_WAIT)
                continue
        t_wait = time.perf_counter()
        delivery = held.popleft() if held else ctx.inbox.get(timeout=0.1)
        metrics.count(MetricName.IDLE_SECONDS, time.perf_counter() - t_wait)
        if writer is not None and time.monotonic() - last_flush >= FLUSH_INTERVAL:
            writer.flush()
            last_flush = time.monotonic()
        if delivery is None:
            continue
        if aligner.holds(delivery.sender):
            aligner.hold(delivery)
            continue
        if delivery.kind == BARRIER:
            aligner.arrive(delivery.sender, json.loads(delivery.payload))
            delivery.release()
        elif delivery.kind == END:
            ended.add(delivery.sender)
        if delivery.kind in (BARRIER, END):
            live = ctx.upstream_names(spec.keyed.name) - ended
            if aligner.aligned(live):
                barrier = aligner.barrier
                assert barrier is not None
                # The output so far is the checkpoint's: it must be in segments, at an offset.
                if writer is not None:
                    writer.flush()
                offset = writer.end_offset if writer is not None else None
                ctx.emit({"type": SINK_ACK, "id": barrier["id"], "offset": offset})
                held.extend(aligner.finish())
            continue
        if delivery.kind == LEAVE:
            continue  # a retired keyed instance closed its stream; its data is all here
        t0 = time.perf_counter()
        batch = decode(delivery.payload)
        delivery.release()
        batch = batch.drop_columns([GROUP])
        if function is not None:
            function(batch)
        else:
            assert writer is not None
            writer.append(batch)
            ctx.extra_stats["output_offset"] = writer.end_offset
        emitted = now_us()
        latency = np.maximum((emitted - batch.column(INGEST_TIME).to_numpy()) / 1e6, 0.0)
        weights = batch.column("n").to_numpy() if "n" in batch.schema.names else None
        metrics.latency.observe_many(latency, weights)
        # Recent per-batch worst latencies, for latency-over-time views (benchmarks, reports).
        recent.append((emitted / 1e6, float(latency.max()) if len(latency) else 0.0))
        metrics.count(MetricName.RECORDS_IN, batch.num_rows)
        metrics.count(MetricName.BUSY_SECONDS, time.perf_counter() - t0)
    if writer is not None:
        writer.close()
        if spec.checkpoints is not None:
            writer.publish(writer.end_offset)  # the job is done: all of it is final
        ctx.extra_stats["output_offset"] = writer.end_offset
