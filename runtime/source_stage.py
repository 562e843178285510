"""The source stage loop: make records (generator) or take them from clients (ingest), run the
chained map/filter functions, check them against the schema, compute key groups, and send each
record to its keyed owner by the current assignment epoch.

Called by `keyshift.runtime.instance` for instances of the job's source stages (each source of
a job runs this loop with its own config, schema and routes; its instances stamp their records
with their job-wide source id, `JobSpec.source_id`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from keyshift.runtime import nexmark
from keyshift.runtime.edge_router import Outputs
from keyshift.runtime.generator import KeyGenerator, Pacer, instance_total, rate_at
from keyshift.runtime.ingest import (
    REMEMBERED_BATCH_IDS,
    EventTimeCheck,
    IngestLimits,
    IngestService,
)
from keyshift.runtime.ingest_log import IngestLog, ingest_log_url
from keyshift.runtime.job import (
    GENERATED_FIELDS,
    NEXMARK_FIELDS,
    GeneratorSource,
    IngestSource,
    NexmarkSource,
)
from keyshift.runtime.metrics import MetricName
from keyshift.runtime.protocol import (
    Barrier,
    Checkpoint,
    CheckpointComplete,
    SourceCheckpointAck,
    Watermark,
)
from keyshift.runtime.records import (
    EVENT_TIME,
    now_us,
    record_schema,
)
from keyshift.runtime.stage_context import InstanceContext
from keyshift.runtime.storage import StorageError
from keyshift.runtime.transport import (
    PortInUseError,
    start_server,
)
from keyshift.runtime.watermarks import WatermarkGenerator

log = logging.getLogger("keyshift.source")


class Emitter:
    """Turns a batch of new records into routed sends: transforms, event times, key groups,
    routing; and the watermark after them."""

    def __init__(self, ctx: InstanceContext, outputs: Outputs) -> None:
        self.ctx = ctx
        self.outputs = outputs
        self.emitted = 0
        self.source_id = ctx.spec.source_id(ctx.stage, ctx.index)
        self.watermarks = Watermarks(ctx, outputs)
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
        out, routed = self.outputs.prepare(batch, self.watermarks.stamp)
        metrics.count(MetricName.BUSY_SECONDS, time.perf_counter() - started)
        self.outputs.send(routed)
        metrics.count(MetricName.RECORDS_OUT, out)
        metrics.count(MetricName.RECORDS_IN, made)
        self.emitted += made
        self.ctx.extra_stats["emitted"] = self.emitted
        self.watermarks.emitted()

    def follow_commands(self, waiting: bool) -> None:
        """Follow the coordinator's commands between batches; `waiting`: records are there
        to emit (the instance is not idle, however long its sends have been held up)."""
        self.watermarks.tick(waiting)
        while (command := self.ctx.next_command()) is not None:
            if isinstance(command, Checkpoint):
                self.barrier(command)
            elif isinstance(command, CheckpointComplete):
                self.on_complete(command.sources.get(str(self.source_id), 0))
            else:
                self.outputs.handle(command)

    def barrier(self, command: Checkpoint) -> None:
        """Checkpoint here, between two batches: what was emitted so far is in it."""
        self.outputs.barrier(Barrier(id=command.id, previous=command.previous))
        ack = SourceCheckpointAck(id=command.id, source=self.source_id, position=self.emitted)
        self.ctx.emit(ack)


class Watermarks:
    """A source instance's event time and watermark (keyshift.runtime.watermarks), when its
    stage has `event_time` settings: records take their event time from the named field, and
    every keyed instance hears the watermark after the records it covers (a new one at once),
    and that the instance is idle when it has emitted nothing for the idle timeout."""

    def __init__(self, ctx: InstanceContext, outputs: Outputs) -> None:
        self.ctx = ctx
        self.outputs = outputs
        self.highest: int | None = None  # the latest event time stamped, not yet observed
        settings = ctx.spec.source_step(ctx.stage).stage.event_time
        self.field = settings.field if settings is not None else None
        self.generator = (
            None
            if settings is None
            else WatermarkGenerator(
                bound_us=round(settings.max_out_of_orderness_ms * 1000),
                idle_timeout=(
                    None if settings.idle_timeout_ms is None else settings.idle_timeout_ms / 1000
                ),
                last_active=time.monotonic(),
            )
        )

    def stamp(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """Records whose event time is a field of theirs carry it as their event time."""
        if self.field is not None:
            index = batch.schema.get_field_index(EVENT_TIME)
            batch = batch.set_column(index, EVENT_TIME, batch.column(self.field))
        if self.generator is not None and batch.num_rows:
            highest = int(pc.max(batch.column(EVENT_TIME)).as_py())
            self.highest = highest if self.highest is None else max(self.highest, highest)
        return batch

    def emitted(self) -> None:
        """After the records are sent: the watermark they move."""
        if self.generator is None or self.highest is None:
            return
        self.generator.observe(self.highest, time.monotonic())
        self.highest = None
        self.send()

    def tick(self, waiting: bool) -> None:
        """Between batches: note an idle spell (nothing to emit for the timeout; `waiting`:
        records are there), and tell new keyed instances the watermark."""
        if self.generator is None:
            return
        if self.outputs.paused or waiting:
            # A blocked send (a replacement still restoring, a slow receiver) is no idle
            # spell: declared idle, the instance would let its receivers' watermark pass the
            # records it sends once it can.
            self.generator.held_up(time.monotonic())
        else:
            self.generator.check_idle(time.monotonic())
        self.send()

    def send(self) -> None:
        assert self.generator is not None
        self.outputs.watermark(
            Watermark(watermark=self.generator.watermark, idle=self.generator.idle)
        )
        if self.generator.watermark is not None:
            self.ctx.watermark_us = self.generator.watermark


def run(ctx: InstanceContext) -> None:
    config = ctx.spec.source_step(ctx.stage).stage.config
    outputs = Outputs(ctx, ctx.spec.source_routes(ctx.stage))
    emitter = Emitter(ctx, outputs)
    if isinstance(config, IngestSource):
        run_ingest(ctx, config, emitter)
    else:
        run_generator(ctx, config, emitter)
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
    position = restored_position(ctx, emitter.source_id) if ctx.restore else None
    service = IngestService(
        spec.source_step(ctx.stage).fields,
        emitter.source_id,
        max_pending=spec.batching.credits,
        # The first word of a reason is the metric's label.
        on_reject=lambda reason, sample, count: ctx.reject(f"ingest {reason}", sample, count),
        durable=durable,
        position=position,
        limits=IngestLimits.of(config),
        non_finite=spec.allow_non_finite,
        event_times=event_time_check(ctx),
        on_bad_times=ctx.bad_event_times,
    )
    emitter.start_at(service.next_seq)
    emitter.on_complete = service.trim
    server, port = _listen(ctx, config.port, durable, service)
    ctx.extra_stats["ingest_address"] = f"{ctx.host}:{port}"
    linger = spec.batching.linger_ms / 1000.0
    try:
        while True:
            ctx.check()
            emitter.follow_commands(waiting=service.pending_rows() > 0)
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


def restored_position(ctx: InstanceContext, source_id: int) -> int:
    """Where source instance `source_id` goes on from: its checkpointed position after a crash,
    else 0."""
    return int(ctx.restore.sources.get(str(source_id), 0)) if ctx.restore else 0


def event_time_check(ctx: InstanceContext) -> EventTimeCheck:
    """What the ingest endpoint asks of a row's event time: its field's, when the source takes
    it from one; else, with event time on, no null `event_time`."""
    settings = ctx.spec.source_step(ctx.stage).stage.event_time
    if settings is None:
        return EventTimeCheck()
    return EventTimeCheck(field=settings.field, nulls_bad=settings.field is None)


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


BatchMaker = Callable[[int, int, np.ndarray], pa.RecordBatch]
"""(first sequence number, count, due times in epoch µs) -> the records of a built-in source."""


def key_value_batches(ctx: InstanceContext, config: GeneratorSource) -> BatchMaker:
    """The generator's records: a key and a value, their event time the time they fell due."""
    source_id = ctx.spec.source_id(ctx.stage, ctx.index)
    generator = KeyGenerator(config, source_id=source_id)
    schema = record_schema(GENERATED_FIELDS)

    def make(seq: int, n: int, times: np.ndarray) -> pa.RecordBatch:
        keys, values = generator.records(seq, n)
        return pa.RecordBatch.from_arrays(
            [
                pa.array(keys),
                pa.array(values),
                pa.array(times),
                *_record_ids(source_id, seq, n, times),
            ],
            schema=schema,
        )

    return make


def nexmark_batches(ctx: InstanceContext, config: NexmarkSource) -> BatchMaker:
    """NEXMark's events (keyshift.runtime.nexmark): this instance's share of the event numbers,
    each with the model's event time."""
    model = config.model()
    parallelism = ctx.spec.source_step(ctx.stage).stage.parallelism
    schema = record_schema(NEXMARK_FIELDS)
    source_id = ctx.spec.source_id(ctx.stage, ctx.index)

    def make(seq: int, n: int, times: np.ndarray) -> pa.RecordBatch:
        made = nexmark.events(model, nexmark.event_numbers(ctx.index, parallelism, seq, n))
        return pa.RecordBatch.from_arrays(
            [*made.columns, *_record_ids(source_id, seq, n, times)], schema=schema
        )

    return make


def _record_ids(source_id: int, seq: int, n: int, times: np.ndarray) -> list[pa.Array]:
    """Ingest time, source, sequence number and (not yet computed) key group of new records
    (the source id is looked up once: looked up in the job's model per batch, it was ~5 % of
    a small batch's cost)."""
    return [
        pa.array(times),
        pa.array(np.full(n, source_id, dtype=np.int32)),
        pa.array(np.arange(seq, seq + n, dtype=np.int64)),
        pa.array(np.zeros(n, dtype=np.int32)),
    ]


def run_generator(
    ctx: InstanceContext, config: GeneratorSource | NexmarkSource, emitter: Emitter
) -> None:
    """A built-in source: records made by a pure function of their sequence number, as due by
    the load profile."""
    spec = ctx.spec
    parallelism = spec.source_step(ctx.stage).stage.parallelism
    make = (
        key_value_batches(ctx, config)
        if isinstance(config, GeneratorSource)
        else nexmark_batches(ctx, config)
    )
    pacer = Pacer(
        config.profile, 1.0 / parallelism, instance_total(config.total, ctx.index, parallelism)
    )
    max_records = spec.batching.max_records
    linger = spec.batching.linger_ms / 1000.0
    metrics = ctx.metrics
    # After a crash the source replays from the checkpoint's position, on the profile's clock
    # as of that position.
    seq = restored_position(ctx, emitter.source_id)
    emitter.start_at(seq)
    resumed = pacer.elapsed_at(seq)
    start = time.monotonic() - resumed
    started_us = now_us() - int(resumed * 1e6)
    last_emit = start
    while not pacer.done(seq):
        ctx.check()
        emitter.follow_commands(waiting=pacer.due(time.monotonic() - start, seq) != 0)
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
        # Each record carries the time it fell due, not the time it could be sent.
        first, last = pacer.arrival(seq + 1, elapsed), pacer.arrival(seq + n, elapsed)
        times = started_us + (np.linspace(first, last, n) * 1e6).astype(np.int64)
        batch = make(seq, n, times)
        seq += n
        emitter.emit(batch, t0)
        last_emit = now
