"""The source stage loop: make records (generator) or take them from clients (ingest), run the
chained map/filter functions, check them against the schema, compute key groups, and send each
record to its owner in each keyed stage the source feeds, by that stage's assignment epoch
(`keyshift.runtime.edge_router`).

Called by `keyshift.runtime.instance` for instances of the job's source stage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc
import numpy as np
import pyarrow as pa

from keyshift.runtime.edge_router import Outputs
from keyshift.runtime.generator import KeyGenerator, Pacer, instance_total, rate_at
from keyshift.runtime.ingest import REMEMBERED_BATCH_IDS, IngestLimits, IngestService
from keyshift.runtime.ingest_log import IngestLog, ingest_log_url
from keyshift.runtime.job import GeneratorSource, IngestSource
from keyshift.runtime.metrics import MetricName
from keyshift.runtime.protocol import (
    Barrier,
    Checkpoint,
    CheckpointComplete,
    SourceCheckpointAck,
)
from keyshift.runtime.records import (
    now_us,
    record_schema,
)
from keyshift.runtime.stage_context import InstanceContext
from keyshift.runtime.storage import StorageError
from keyshift.runtime.transport import (
    PortInUseError,
    start_server,
)

log = logging.getLogger("keyshift.source")


class Emitter:
    """Turns a batch of new records into routed sends: transforms, key groups, routing."""

    def __init__(self, ctx: InstanceContext, outputs: Outputs) -> None:
        self.ctx = ctx
        self.outputs = outputs
        self.emitted = 0
        # A source that keeps what it emitted until a checkpoint covers it lets go of it here.
        self.on_complete: Callable[[int], None] = lambda position: None

    def start_at(self, position: int) -> None:
        """Count from `position` (a recovery's, or an ingest log's next sequence number); the
        coordinator learns it at once, so even a source that ends without emitting has one."""
        self.emitted = position
        self.ctx.extra_stats["emitted"] = position

    def emit(self, batch: pa.RecordBatch, started: float) -> None:
        metrics = self.ctx.metrics
        made = batch.num_rows
        out, routed = self.outputs.prepare(batch)
        metrics.count(MetricName.BUSY_SECONDS, time.perf_counter() - started)
        self.outputs.send(routed)
        metrics.count(MetricName.RECORDS_OUT, out)
        metrics.count(MetricName.RECORDS_IN, made)
        self.emitted += made
        self.ctx.extra_stats["emitted"] = self.emitted

    def follow_commands(self) -> None:
        while (command := self.ctx.next_command()) is not None:
            if isinstance(command, Checkpoint):
                self.barrier(command)
            elif isinstance(command, CheckpointComplete):
                self.on_complete(command.sources.get(str(self.ctx.index), 0))
            else:
                self.outputs.handle(command)

    def barrier(self, command: Checkpoint) -> None:
        """Checkpoint here, between two batches: what was emitted so far is in it."""
        self.outputs.barrier(Barrier(id=command.id, previous=command.previous))
        self.ctx.emit(SourceCheckpointAck(id=command.id, position=self.emitted))


def run(ctx: InstanceContext) -> None:
    config = ctx.spec.source.config
    outputs = Outputs(ctx, ctx.spec.source_routes())
    emitter = Emitter(ctx, outputs)
    if isinstance(config, GeneratorSource):
        run_generator(ctx, config, emitter)
    else:
        run_ingest(ctx, config, emitter)
    outputs.finish()


def run_ingest(ctx: InstanceContext, config: IngestSource, emitter: Emitter) -> None:
    """Rows pushed by clients (keyshift.runtime.ingest_client; the PySpark writer) flow on.
    With checkpoints, what is accepted is logged durably first and replayed after a crash."""
    spec = ctx.spec
    durable = None
    if spec.checkpoints is not None:
        settings = spec.checkpoints
        url = ingest_log_url(settings.storage, ctx.stage, ctx.index)
        try:
            durable = IngestLog(
                url,
                settings.storage_options,
                REMEMBERED_BATCH_IDS,
                on_failure=lambda: ctx.metrics.storage_failed("ingest_log"),
            )
        except StorageError as exc:
            raise RuntimeError(f"the ingest source keeps its log at {url}: {exc}") from None
    position = int(ctx.restore.sources.get(str(ctx.index), 0)) if ctx.restore else None
    service = IngestService(
        spec.fields,
        ctx.index,
        max_pending=spec.batching.credits,
        # The first word of a reason is the metric's label.
        on_reject=lambda reason, sample, count: ctx.reject(f"ingest {reason}", sample, count),
        durable=durable,
        position=position,
        limits=IngestLimits.of(config),
        non_finite=spec.allow_non_finite,
    )
    emitter.start_at(service.next_seq)
    emitter.on_complete = service.trim
    server, port = _listen(ctx, config.port, durable, service)
    ctx.extra_stats["ingest_address"] = f"{ctx.host}:{port}"
    linger = spec.batching.linger_ms / 1000.0
    try:
        while True:
            ctx.check()
            emitter.follow_commands()
            if ctx.drain.is_set():
                service.close()
                while (batch := service.take(0)) is not None:
                    emitter.emit(batch, time.perf_counter())
                return
            if emitter.outputs.paused:
                time.sleep(linger)
                continue
            ctx.metrics.source_backlog.set(service.pending_rows())
            clients = service.client_backlogs.total(time.monotonic())
            ctx.metrics.client_backlog.set(clients.rows)
            ctx.metrics.client_backlog_age.set(clients.oldest_seconds)
            ctx.extra_stats["client_backlog"] = clients.rows
            ctx.extra_stats["staged_rows"] = service.staged_rows()
            waited = time.perf_counter()
            batch = service.take(max(linger, 0.01))
            ctx.metrics.count(MetricName.IDLE_SECONDS, time.perf_counter() - waited)
            if batch is not None:
                emitter.emit(batch, time.perf_counter())
    finally:
        server.stop(grace=0.5)


def _listen(
    ctx: InstanceContext, port: int, durable: IngestLog | None, service: IngestService
) -> tuple[grpc.Server, int]:
    """Serve the ingest endpoint. Without a configured port, a restarted instance listens
    where it did before if it can, so its clients (a Spark writer) find it again."""
    previous = durable.last_port() if durable is not None and port == 0 else None
    server = None
    if previous is not None:
        try:
            server, port = start_server(
                f"{ctx.host}:{previous}", [service.handler()], security=ctx.security
            )
        except PortInUseError:
            log.warning("ingest port %d is taken now; clients must be told the new one", previous)
    if server is None:
        server, port = start_server(
            f"{ctx.host}:{port}", [service.handler()], security=ctx.security
        )
    if durable is not None and port != previous:
        durable.remember_port(port)
    return server, port


def run_generator(ctx: InstanceContext, config: GeneratorSource, emitter: Emitter) -> None:
    spec = ctx.spec
    parallelism = spec.source.parallelism
    generator = KeyGenerator(config, source_id=ctx.index)
    pacer = Pacer(
        config.profile, 1.0 / parallelism, instance_total(config.total, ctx.index, parallelism)
    )
    schema = record_schema({"key": "int", "value": "float"})
    max_records = spec.batching.max_records
    linger = spec.batching.linger_ms / 1000.0
    metrics = ctx.metrics
    # After a crash the source replays from the checkpoint's position, on the profile's clock
    # as of that position.
    seq = int(ctx.restore.sources.get(str(ctx.index), 0)) if ctx.restore else 0
    emitter.start_at(seq)
    resumed = pacer.elapsed_at(seq)
    start = time.monotonic() - resumed
    started_us = now_us() - int(resumed * 1e6)
    last_emit = start
    while not pacer.done(seq):
        ctx.check()
        emitter.follow_commands()
        if ctx.drain.is_set():
            break
        now = time.monotonic()
        elapsed = now - start
        target = rate_at(config.profile, elapsed)
        metrics.source_target_rate.set(target / parallelism if target is not None else 0)
        due = pacer.due(elapsed, seq)
        metrics.source_backlog.set(due or 0)
        if emitter.outputs.paused:
            due = 0
        if due is None:
            n = max_records
        elif due >= max_records or (due > 0 and now - last_emit >= linger):
            n = min(due, max_records)
        else:
            # Records are due but the batch may still grow: wake when its linger ends. Nothing
            # due: wake when the next record is (a linger that has passed has nothing to flush).
            until = linger - (now - last_emit) if due else pacer.seconds_until_next(elapsed, seq)
            wait = max(0.0005, until)
            time.sleep(wait)
            metrics.count(MetricName.IDLE_SECONDS, wait)
            continue
        t0 = time.perf_counter()
        keys, values = generator.records(seq, n)
        # Each record carries the time it fell due, not the time it could be sent.
        first, last = pacer.arrival(seq + 1, elapsed), pacer.arrival(seq + n, elapsed)
        times = started_us + (np.linspace(first, last, n) * 1e6).astype(np.int64)
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
        emitter.emit(batch, t0)
        last_emit = now
