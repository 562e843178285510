"""The sink stage loop: measure end-to-end latency, and append updates to the ordered output
log (or hand them to a user's function). While a named reader of the log lags too far behind,
the loop takes no records (keyshift.runtime.log_retention): the job is backpressured. A job
with checkpoints publishes its log up to each completed checkpoint's offset, and all of it
when the job finishes (keyshift.runtime.output_log): readers never see output a recovery
would make again.

A write the log's disk refuses (full) stalls the sink instead of failing it (OutputStall): it
keeps the records it could not write, takes no more (what arrives waits unread, its credits
kept, so the job is backpressured), fails the checkpoints it sees meanwhile with the reason,
says so in its stats (`storage_error`) and tries the write again with backoff; once it
succeeds, the sink goes on where it stopped, nothing lost or doubled.

Called by `keyshift.runtime.instance` for instances of the job's sink stages (each sink's
instances run this loop for their own sink: its config, log, partitions and inputs).
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa

from keyshift.runtime.checkpointing import BarrierAligner
from keyshift.runtime.job import FunctionSink, LogSink, resolve_function
from keyshift.runtime.keyspace import Assignment
from keyshift.runtime.metrics import MetricName
from keyshift.runtime.output_log import OutputStorageError
from keyshift.runtime.protocol import (
    Ack,
    Barrier,
    CheckpointComplete,
    Command,
    InDone,
    MovePartitions,
    OpenPartitions,
    OutDone,
    Rescaling,
    Retire,
    SinkCheckpointAck,
    parse,
)
from keyshift.runtime.records import INGEST_TIME, now_us
from keyshift.runtime.sink_partitions import SinkPartitions
from keyshift.runtime.stage_context import InstanceContext
from keyshift.runtime.storage import Backoff, retrying
from keyshift.runtime.transport import BARRIER, END, LEAVE, MARKER, Delivery

log = logging.getLogger("keyshift.sink")

FLUSH_INTERVAL = 1.0
BLOCKED_WAIT = 0.05  # seconds between looks at the readers' progress while they lag
RECENT_SAMPLES = 256
STALL_PAUSE_LIMIT = 5.0  # seconds: the longest pause between writes to a full disk


class OutputStall:
    """The output log's writes while its disk refuses them: the failure, its backoff, and the
    deliveries that arrived meanwhile (unread, in order)."""

    def __init__(self, ctx: InstanceContext) -> None:
        self.ctx = ctx
        self.error: str | None = None
        self.backoff = Backoff(0.1, STALL_PAUSE_LIMIT)
        self.waiting: deque[Delivery] = deque()

    def attempt(self, write: Callable[[], Any]) -> bool:
        """Make a write to the log; False (and stalled) when the disk refused it."""
        try:
            write()
        except OutputStorageError as exc:
            if self.error is None:
                log.error("output log stalled, taking no records: %s", exc)
            self.error = str(exc)
            self.ctx.extra_stats["storage_error"] = self.error
            self.ctx.metrics.storage_failed("output_log")
            self.backoff.failed()
            return False
        if self.error is not None:
            log.info("output log writes again after: %s", self.error)
            self.error = None
            self.ctx.extra_stats.pop("storage_error", None)
            self.backoff.reset()
        return True


def run(ctx: InstanceContext) -> None:
    spec = ctx.spec
    config = spec.sink_stage(ctx.stage).config
    function = resolve_function(config.function) if isinstance(config, FunctionSink) else None
    log_config = config if isinstance(config, LogSink) else None
    topology = ctx.wait_topology()
    restore = ctx.restore.of_sink(ctx.stage).outputs if ctx.restore else {}
    parts = SinkPartitions(
        log_config, ctx.index, Assignment.from_json(topology.partitions[ctx.stage]), restore
    )
    if spec.checkpoints is not None:
        # An earlier run's output, or the checkpoint's.
        for writer in parts.writers.values():
            retrying(partial(writer.publish, writer.end_offset), "publishing the output log")
    writing = log_config is not None
    upstream = spec.sink_inputs(ctx.stage)
    ended: set[str] = set()
    aligner = BarrierAligner()
    held: deque[Delivery] = deque()  # what aligned senders sent during the last alignment
    stall = OutputStall(ctx)
    failed: set[int] = set()  # checkpoints this sink failed: their later barriers are ignored
    rescaling = False  # a rescale of the sink runs: stay up, even once every sender has ended
    retire = False

    def fail_checkpoint(checkpoint: int) -> None:
        failed.add(checkpoint)
        ctx.emit(SinkCheckpointAck(id=checkpoint, error=f"output log: {stall.error}"))

    def stalled() -> bool:
        """Whether the log is stalled now; a stall fails the checkpoint being aligned (its
        offset cannot be written), and what its alignment held is taken up again after."""
        if stall.error is None:
            return False
        if aligner.barrier is not None:
            fail_checkpoint(aligner.barrier.id)
            held.extendleft(reversed(aligner.finish()))
        return True

    def resume() -> None:
        parts.flush()
        parts.catch_up()

    def write(part: int, batch: pa.RecordBatch) -> None:
        if function is not None:
            function(batch)
        else:
            # Refused by the disk, the batch stays in the writer's buffer: the stall retries it.
            stall.attempt(partial(parts.writers[part].append, batch))

    def follow(command: Command) -> None:
        nonlocal rescaling, retire
        if isinstance(command, CheckpointComplete):
            parts.completed(command.outputs.get(ctx.stage, {}))
        elif isinstance(command, MovePartitions):
            parts.prepare(command)
            ctx.emit(Ack(step="move_partitions", epoch=command.epoch))
        elif isinstance(command, OpenPartitions):
            for part, batch in parts.open(command.partitions):
                write(part, batch)
            ctx.emit(InDone(epoch=command.epoch, stats={"partitions_in": len(command.partitions)}))
        elif isinstance(command, Rescaling):
            rescaling = command.active
            # Senders that ended before this instance joined never sent it their END.
            ended.update(set(command.ended) & ctx.upstream_names(*upstream))
        elif isinstance(command, Retire):
            retire = True
        # Topology updates are read through ctx.upstream_names.

    def hand_over() -> None:
        """Close the partitions leaving here once nothing more of them can come."""
        move = parts.move
        if move is not None and parts.close_leaving(
            ctx.upstream_names(*upstream) - ended, stall.attempt
        ):
            ctx.emit(OutDone(epoch=move.epoch, stats={"partitions_out": len(move.leaving)}))

    recent: deque[tuple[float, float]] = deque(maxlen=RECENT_SAMPLES)
    ctx.extra_stats["latency_recent"] = recent
    metrics = ctx.metrics
    last_flush = time.monotonic()
    # The keyed stage's membership changes with rescales: the log is complete once every
    # current upstream instance has ended its stream (retired ones are no longer upstream).
    while not (ctx.upstream_names(*upstream) <= ended and not parts.moving and not rescaling):
        ctx.check()
        while (command := ctx.next_command()) is not None:
            follow(command)
        hand_over()
        ctx.extra_stats.update(parts.stats())
        if retire and not parts.moving:
            break
        if writing and stalled():
            if stall.backoff.due() and stall.attempt(resume):
                held.extend(stall.waiting)  # what arrived during the stall, in order
                stall.waiting.clear()
            else:
                # Take what arrives, unread: a barrier among it fails its checkpoint now, with
                # the reason, rather than after the checkpoint's timeout.
                t_wait = time.perf_counter()
                delivery = ctx.inbox.get(timeout=BLOCKED_WAIT)
                metrics.count(MetricName.BACKPRESSURED_SECONDS, time.perf_counter() - t_wait)
                if delivery is not None:
                    if delivery.kind == BARRIER:
                        checkpoint = parse(Barrier, json.loads(delivery.payload)).id
                        if checkpoint not in failed:
                            fail_checkpoint(checkpoint)
                    stall.waiting.append(delivery)
                continue
        if writing:
            if not stall.attempt(parts.catch_up):
                continue
            if parts.blocked():
                # The readers can only catch up on what is in segments.
                if not stall.attempt(parts.flush):
                    continue
                time.sleep(BLOCKED_WAIT)
                metrics.count(MetricName.BACKPRESSURED_SECONDS, BLOCKED_WAIT)
                continue
        t_wait = time.perf_counter()
        delivery = held.popleft() if held else ctx.inbox.get(timeout=0.1)
        metrics.count(MetricName.IDLE_SECONDS, time.perf_counter() - t_wait)
        if writing and time.monotonic() - last_flush >= FLUSH_INTERVAL:
            t_flush = time.perf_counter()
            stall.attempt(parts.flush)
            # Writing segments is the sink's work too: DS2's true rate counts it.
            metrics.count(MetricName.BUSY_SECONDS, time.perf_counter() - t_flush)
            last_flush = time.monotonic()
        if delivery is None:
            continue
        if aligner.holds(delivery.sender):
            aligner.hold(delivery)
            continue
        if delivery.kind == MARKER:
            parts.marker(delivery.sender, delivery.payload)
            delivery.release()
            continue
        if delivery.kind == BARRIER:
            barrier = parse(Barrier, json.loads(delivery.payload))
            delivery.release()
            if barrier.id in failed:
                continue  # this sink failed that checkpoint during a stall
            aligner.arrive(delivery.sender, barrier)
        elif delivery.kind == END:
            ended.add(delivery.sender)
            parts.marker(delivery.sender, None)
        if delivery.kind in (BARRIER, END):
            live = ctx.upstream_names(*upstream) - ended
            if aligner.aligned(live):
                aligned = aligner.barrier
                assert aligned is not None
                # The output so far is the checkpoint's: it must be in segments, at an offset.
                if stall.attempt(parts.flush):
                    ctx.emit(SinkCheckpointAck(id=aligned.id, offsets=parts.end_offsets))
                else:
                    fail_checkpoint(aligned.id)
                held.extend(aligner.finish())
            continue
        if delivery.kind == LEAVE:
            continue  # a retired keyed instance closed its stream; its data is all here
        t0 = time.perf_counter()
        batch = delivery.records
        assert batch is not None  # the transport decoded it: its kind is BATCH
        delivery.release()
        emitted = now_us()
        for part, records in parts.split(batch):
            write(part, records)
        ctx.extra_stats.update(parts.stats())
        latency = np.maximum((emitted - batch.column(INGEST_TIME).to_numpy()) / 1e6, 0.0)
        weights = batch.column("n").to_numpy() if "n" in batch.schema.names else None
        metrics.latency.observe_many(latency, weights)
        # Recent per-batch worst latencies, for latency-over-time views (benchmarks, reports).
        recent.append((emitted / 1e6, float(latency.max()) if len(latency) else 0.0))
        metrics.count(MetricName.RECORDS_IN, batch.num_rows)
        metrics.count(MetricName.BUSY_SECONDS, time.perf_counter() - t0)
    # All of it is final once the job is done (a retired instance owns nothing any more).
    parts.finish(publish=spec.checkpoints is not None)
    ctx.extra_stats.update(parts.stats())
