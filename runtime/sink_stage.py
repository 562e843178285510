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

Called by `keyshift.runtime.instance` for instances of the job's sink stage.
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

from keyshift.runtime.checkpointing import BarrierAligner
from keyshift.runtime.job import FunctionSink, resolve_function
from keyshift.runtime.log_retention import LogRetention
from keyshift.runtime.metrics import MetricName
from keyshift.runtime.output_log import OutputLogWriter, OutputStorageError
from keyshift.runtime.protocol import Barrier, CheckpointComplete, SinkCheckpointAck, parse
from keyshift.runtime.records import GROUP, INGEST_TIME, decode, now_us
from keyshift.runtime.stage_context import InstanceContext
from keyshift.runtime.storage import Backoff, retrying
from keyshift.runtime.transport import BARRIER, END, LEAVE, Delivery

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
        self.publish_to: int | None = None  # a completed checkpoint's offset not yet published

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
    config = spec.sink.config
    if isinstance(config, FunctionSink):
        function = resolve_function(config.function)
        writer = None
    else:
        function = None
        # A disk that is full now is waited for, here as while running.
        output = retrying(
            lambda: OutputLogWriter(config.path, ctx.index, config.format, config.segment_records),
            "opening the output log",
        )
        writer = output
        retention = LogRetention(writer, config.path, config.readers, config.max_unread_records)
        offset = ctx.restore.outputs.get(str(ctx.index)) if ctx.restore else None
        if offset is not None:
            # What came after the checkpoint is made again by the replay from its positions.
            retrying(partial(output.truncate, offset), "truncating the output log")
        if spec.checkpoints is not None:
            # An earlier run's output, or the checkpoint's.
            retrying(lambda: output.publish(output.end_offset), "publishing the output log")
    ctx.wait_topology()
    upstream = spec.sink_inputs()
    ended: set[str] = set()
    aligner = BarrierAligner()
    held: deque[Delivery] = deque()  # what aligned senders sent during the last alignment
    stall = OutputStall(ctx)
    failed: set[int] = set()  # checkpoints this sink failed: their later barriers are ignored

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

    def catch_up() -> None:
        """The writes the log owes besides records: publishing a completed checkpoint's
        offset, and trimming what the readers have read."""
        assert writer is not None
        if stall.publish_to is not None:
            writer.publish(stall.publish_to)
            stall.publish_to = None
        retention.poll()

    def resume() -> None:
        assert writer is not None
        writer.flush()
        catch_up()

    recent: deque[tuple[float, float]] = deque(maxlen=RECENT_SAMPLES)
    ctx.extra_stats["latency_recent"] = recent
    metrics = ctx.metrics
    last_flush = time.monotonic()
    # The keyed stage's membership changes with rescales: the log is complete once every
    # current upstream instance has ended its stream (retired ones are no longer upstream).
    while not ctx.upstream_names(*upstream) <= ended:
        ctx.check()
        while (command := ctx.next_command()) is not None:
            # Topology updates are read through ctx.upstream_names.
            if isinstance(command, CheckpointComplete) and writer is not None:
                published = command.outputs.get(str(ctx.index))
                if published is not None:
                    stall.publish_to = int(published)
        if writer is not None and stalled():
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
        if writer is not None:
            if not stall.attempt(catch_up):
                continue
            if retention.blocked():
                # The readers can only catch up on what is in segments.
                if not stall.attempt(writer.flush):
                    continue
                time.sleep(BLOCKED_WAIT)
                metrics.count(MetricName.BACKPRESSURED_SECONDS, BLOCKED_WAIT)
                continue
        t_wait = time.perf_counter()
        delivery = held.popleft() if held else ctx.inbox.get(timeout=0.1)
        metrics.count(MetricName.IDLE_SECONDS, time.perf_counter() - t_wait)
        if writer is not None and time.monotonic() - last_flush >= FLUSH_INTERVAL:
            stall.attempt(writer.flush)
            last_flush = time.monotonic()
        if delivery is None:
            continue
        if aligner.holds(delivery.sender):
            aligner.hold(delivery)
            continue
        if delivery.kind == BARRIER:
            barrier = parse(Barrier, json.loads(delivery.payload))
            delivery.release()
            if barrier.id in failed:
                continue  # this sink failed that checkpoint during a stall
            aligner.arrive(delivery.sender, barrier)
        elif delivery.kind == END:
            ended.add(delivery.sender)
        if delivery.kind in (BARRIER, END):
            live = ctx.upstream_names(*upstream) - ended
            if aligner.aligned(live):
                aligned = aligner.barrier
                assert aligned is not None
                # The output so far is the checkpoint's: it must be in segments, at an offset.
                if writer is None or stall.attempt(writer.flush):
                    offset = writer.end_offset if writer is not None else None
                    ctx.emit(SinkCheckpointAck(id=aligned.id, offset=offset))
                else:
                    fail_checkpoint(aligned.id)
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
            # Refused by the disk, the batch stays in the writer's buffer: the stall retries it.
            stall.attempt(partial(writer.append, batch))
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
        last = writer
        retrying(last.close, "writing the end of the output log")
        if spec.checkpoints is not None:
            # The job is done: all of it is final.
            retrying(lambda: last.publish(last.end_offset), "publishing the output log")
        ctx.extra_stats["output_offset"] = writer.end_offset
