"""The keyed stage loop: apply incoming batches to keyed state (vectorized aggregates or a
per-record function), send one update per changed key on (to the sink instance owning its
output partition, and/or through the chained map/filter functions to its owner in each keyed
stage it feeds, by its `Outputs`), and take part in live migrations
(`keyshift.runtime.migration`) while records keep flowing.

Called by `keyshift.runtime.instance` for instances of the job's keyed stages.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from keyshift.runtime.checkpoint_store import CheckpointMeta
from keyshift.runtime.checkpointing import BarrierAligner, KeyedCheckpointer
from keyshift.runtime.edge_router import Outputs, Routed
from keyshift.runtime.handover import Preloader
from keyshift.runtime.job import (
    AggregateOperator,
    JobSpec,
    JoinOperator,
    KeyedStep,
    ProcessOperator,
    WindowOperator,
    resolve_function,
)
from keyshift.runtime.joins import Join, make_join, pairs
from keyshift.runtime.keyspace import Assignment
from keyshift.runtime.late_records import LateRecordsWriter
from keyshift.runtime.metrics import MetricName
from keyshift.runtime.migration import MoveIn, MoveOut, ProtocolError
from keyshift.runtime.protocol import (
    Abort,
    Ack,
    Barrier,
    Command,
    InDone,
    KeyedCheckpointAck,
    MigrateIn,
    MigrateOut,
    OutDone,
    Preload,
    PushRate,
    Reroute,
    Rescaling,
    Retire,
    Topology,
    Watermark,
    WatermarkHold,
    parse,
)
from keyshift.runtime.records import (
    ARROW_TYPES,
    EVENT_TIME,
    GROUP,
    INGEST_TIME,
    SEQ,
    SOURCE,
    now_us,
    with_record_ids,
)
from keyshift.runtime.rocksdb_state import (
    RocksAggregateState,
    RocksProcessState,
    RocksStore,
    open_database,
    prepare_directory,
)
from keyshift.runtime.sessions import SessionFunction, SessionWindows
from keyshift.runtime.sink_router import SinkRouter
from keyshift.runtime.stage_context import FetchRequest, InstanceContext, Rewinding
from keyshift.runtime.state import (
    KEY_COL,
    AggregateState,
    ProcessFunction,
    ProcessState,
    aggregate_output_schema,
)
from keyshift.runtime.state_integrity import StateSeal
from keyshift.runtime.state_values import ValueCodec
from keyshift.runtime.timers import EVENT, INVALID_REASON, PROCESSING, KeyedTimers, TimerKind
from keyshift.runtime.transport import (
    BARRIER,
    BATCH,
    END,
    FORWARD,
    FORWARD_DONE,
    LEAVE,
    MARKER,
    STATE,
    WATERMARK,
    TransportError,
)
from keyshift.runtime.watermarks import WatermarkTracker
from keyshift.runtime.windows import (
    EventWindows,
    GroupFloors,
    KeyedWindows,
    WindowFunction,
    WindowShape,
    composite_groups,
    take_back,
    window_contents,
    window_output_schema,
)

IDLE_WAIT = 0.05
PUSH_SLICE = 0.05  # seconds of state pushing between two batches of records, at most
log = logging.getLogger("keyshift.keyed")


def make_timers(spec: JobSpec, step: KeyedStep, join: Join | None) -> KeyedTimers | None:
    """The timers of a process stage whose function has an `on_timer`, or of a join (whose
    functions are the join's)."""
    op = step.stage.operator
    if join is not None:
        key_type = ARROW_TYPES[step.fields[step.stage.key_by]]
        return KeyedTimers(join, join.on_timer, step.stage.key_by, key_type, event_time=True)
    if not isinstance(op, ProcessOperator) or op.on_timer is None:
        return None
    key_field = step.stage.key_by
    return KeyedTimers(
        resolve_function(op.function),
        resolve_function(op.on_timer),
        key_field,
        ARROW_TYPES[step.fields[key_field]],
        event_time=spec.source.event_time is not None,
    )


def make_state(
    spec: JobSpec, step: KeyedStep, seal: StateSeal, owner: str, timers: KeyedTimers | None
) -> AggregateState | ProcessState | RocksAggregateState | RocksProcessState:
    """Keyed stage `step`'s state store for instance `owner` ("<stage>-<index>"); with
    timers, a key's timers are stored in its value (keyshift.runtime.timers)."""
    op = step.stage.operator
    # A window's state is keyed by (key, window) in one string (keyshift.runtime.windows); a
    # key's sessions are one value under the key (keyshift.runtime.sessions).
    windowed = isinstance(op, WindowOperator) and not op.session
    key_type = pa.string() if windowed else ARROW_TYPES[step.fields[step.stage.key_by]]
    # Pickled values are only safe to keep when every state byte that arrives is authenticated.
    codec = ValueCodec(allow_pickle=seal.authenticated)
    settings = step.stage.state
    kept = _state_function(op, timers, step.stage.key_by, spec.max_key_groups)
    if settings.backend == "rocksdb":
        directory = prepare_directory(Path(settings.path) / spec.name / owner, owner)
        db = open_database(directory, settings.block_cache_mb, settings.write_buffer_mb)
        # Its checkpoints are native (keyshift.runtime.rocksdb_checkpoint) and need no change
        # marks; a hand-over from a checkpoint does (keyshift.runtime.handover), so a
        # checkpointed job keeps them, cleared at every checkpoint's barrier.
        track = spec.checkpoints is not None
        # A window's keys are found in their key's group, not their own hash's.
        groups_of = (
            partial(
                composite_groups, ARROW_TYPES[step.fields[step.stage.key_by]], spec.max_key_groups
            )
            if windowed
            else None
        )
        if isinstance(kept, str):
            return RocksAggregateState(kept, spec.max_key_groups, key_type, db, track, groups_of)
        return RocksProcessState(kept, spec.max_key_groups, key_type, db, codec, track, groups_of)
    if isinstance(kept, str):
        return AggregateState(kept, spec.max_key_groups, key_type)
    return ProcessState(kept, spec.max_key_groups, key_type, codec)


def _state_function(
    op: AggregateOperator | ProcessOperator | WindowOperator | JoinOperator,
    timers: KeyedTimers | None,
    key_field: str,
    max_key_groups: int,
) -> str | ProcessFunction:
    """The built-in aggregate a keyed operator keeps, or the per-record function of its
    process state (a window's reduce or process keeps [records, accumulator] per window, a
    session window a key's sessions; a process function with timers, and a join, are called
    through them)."""
    if isinstance(op, AggregateOperator):
        return op.function
    if isinstance(op, WindowOperator) and op.session:
        return SessionFunction.of(op, key_field, max_key_groups)
    if isinstance(op, WindowOperator):
        return op.aggregate if op.aggregate is not None else WindowFunction.of(op)
    if isinstance(op, JoinOperator):
        assert timers is not None  # make_timers makes a join's
        return timers
    return timers or resolve_function(op.function)


def make_windows(
    op: WindowOperator, state: Any, key_field: str, key_type: pa.DataType, max_key_groups: int
) -> EventWindows:
    """A window stage's windows over the store `make_state` made for it."""
    if op.session:
        assert isinstance(state.function, SessionFunction)  # make_state's store for sessions
        return SessionWindows(state.function, key_field, key_type, state, max_key_groups)
    return KeyedWindows(
        WindowShape(*op.size_and_slide_us()),
        window_contents(op, state),
        key_field,
        key_type,
        state,
        max_key_groups,
        op.allowed_lateness_us(),
    )


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


def sink_schema(spec: JobSpec, sink: str | None = None) -> pa.Schema:
    """The columns of the records sink `sink` (the job's first sink: `sink`) receives (and
    its output log holds): the updates of the keyed stages feeding it (one schema: a union
    needs one)."""
    last = spec.keyed_step(spec.sink_inputs(sink)[0])
    key_type = ARROW_TYPES[last.fields[last.stage.key_by]]
    op = last.stage.operator
    if isinstance(op, WindowOperator):
        schema = window_output_schema(op.aggregate, key_type)
    elif isinstance(op, AggregateOperator):
        schema = aggregate_output_schema(op.function, key_type)
    else:
        schema = process_output_schema(key_type)
    return schema.remove(schema.get_field_index(GROUP))


class KeyedStage:
    """One keyed instance: its state, its outputs, and its side of any migration."""

    def __init__(self, ctx: InstanceContext) -> None:
        self.ctx = ctx
        # Before the state opens: a rewind told while the topology is awaited leaves nothing
        # open, and once it is here nothing below waits for it.
        ctx.wait_topology()
        spec = ctx.spec
        self.spec = spec
        step = spec.keyed_step(ctx.stage)
        self.seal = StateSeal.from_environment()
        op = step.stage.operator
        self.join = make_join(op) if isinstance(op, JoinOperator) else None
        self.timers = make_timers(spec, step, self.join)
        self.state = make_state(spec, step, self.seal, f"{ctx.stage}-{ctx.index}", self.timers)
        ctx.state_size = lambda: (self.state.key_count, self.state.bytes_estimate())
        ctx.group_hits = self.state.group_hits
        self.value_field = op.field if isinstance(op, AggregateOperator) else None
        self.key_field = step.stage.key_by
        self.windows = (
            make_windows(
                op,
                self.state,
                self.key_field,
                ARROW_TYPES[step.fields[self.key_field]],
                spec.max_key_groups,
            )
            if isinstance(op, WindowOperator)
            else None
        )
        # What was complete at the instance a group came from is complete here (windows and
        # joins alike: keyshift.runtime.windows' GroupFloors).
        self.handed_over: EventWindows | GroupFloors | None = (
            self.windows
            if self.windows is not None
            else GroupFloors(spec.max_key_groups)
            if self.join is not None
            else None
        )
        self.late_records = (
            LateRecordsWriter(spec.late_records, ctx.stage, ctx.index)
            if (self.windows is not None or self.join is not None) and spec.late_records is not None
            else None
        )
        self.out_schema = process_output_schema(self.state.key_type)
        # The stages whose instances send here (a union when several), and where the updates
        # go: to other keyed stages (routed by their assignments, as a source routes) and/or
        # to the sinks.
        self.upstream = step.inputs
        sinks = {sink.name for sink in spec.sinks()}
        keyed = tuple(route for route in step.outputs if route.target not in sinks)
        self.outputs = Outputs(ctx, keyed)
        self.sinks = [
            SinkRouter(ctx, route.target, route.transforms)
            for route in step.outputs
            if route.target in sinks
        ]
        self.owned = ctx.assignment(ctx.stage).owners == ctx.index
        self.ended: set[str] = set()
        self.backlog: deque[tuple[str, bytes, Any]] = deque()
        self.move_out: MoveOut | None = None
        self.last_out: MoveOut | None = None
        self.move_in: MoveIn | None = None
        self.preload: Preloader | None = None  # a hand-over's groups from a checkpoint
        self.retire = False
        self.rescaling = False
        self.aligner = BarrierAligner()
        self.watermark = WatermarkTracker(set(self.senders()))
        settings = spec.checkpoints
        self.checkpointer = (
            KeyedCheckpointer(settings, f"{ctx.stage}-{ctx.index}") if settings else None
        )
        if ctx.restore is not None and self.checkpointer is not None:
            restore = ctx.restore.of_stage(ctx.stage)
            keys = self.checkpointer.restore(restore, self.state, self.owned)
            # Event time goes on from the checkpoint's, not from the replay's first records.
            self.watermark.current = ctx.restore.watermarks.get(ctx.stage)
            self.ctx.watermark_us = self.watermark.current
            log.info(
                "restored %d keys from checkpoint %d, at watermark %s",
                keys,
                ctx.restore.id,
                self.watermark.current,
            )
            self.restore_handed_over(restore)
            self.index_timers(np.flatnonzero(self.owned))
        ctx.fetch_served.set()

    def restore_handed_over(self, restore: CheckpointMeta) -> None:
        """Each group's windows that fired before the checkpoint, as fired, and records its
        join dropped, as dropped: below the watermark its instance had then (the stage's is
        the lowest of them)."""
        if self.handed_over is None:
            return
        owners = Assignment.from_json(restore.assignment).owners
        for index, mark in restore.instance_watermarks.get(self.ctx.stage, {}).items():
            self.handed_over.hand_over(np.flatnonzero(owners == int(index)), mark)
        if self.windows is not None:
            self.windows.rebuild(np.flatnonzero(self.owned).tolist(), self.watermark.current)

    def index_timers(self, groups: np.ndarray) -> None:
        """Index the timers these groups' keys hold (restored, or moved in)."""
        if (
            self.timers is not None
            and len(groups)
            and isinstance(self.state, ProcessState | RocksProcessState)
        ):
            self.timers.index(self.state.snapshot_groups(groups.tolist()), self.state.codec)

    # -- records ---------------------------------------------------------------------------

    def apply(self, batch: pa.RecordBatch) -> None:
        """Apply records to state and send the updates on to the sinks."""
        if batch.num_rows == 0:
            return
        t0 = time.perf_counter()
        received = batch.num_rows
        out: pa.RecordBatch | None
        if self.windows is not None:
            out = self.apply_to_windows(batch)
        elif isinstance(self.state, AggregateState | RocksAggregateState):
            out = self.state.apply(batch, self.key_field, self.value_field).batch
        else:
            if self.join is not None:
                # Parked records of a group moving in were judged before its old owner's
                # watermark was known: what that one dropped is late here too.
                batch = self.drop_late_joined(batch, None)
            if self.timers is not None:
                self.timers.at(self.watermark.current)
            rows, _ = self.state.apply(batch, self.key_field)
            out = self.process_rows(rows)
        self.ctx.metrics.count(MetricName.RECORDS_IN, received)
        self.send_out(out, t0)
        # A timer registered for a time the watermark has passed already fires now.
        self.fire_timers(EVENT)

    def process_rows(self, rows: list[dict[str, Any]]) -> pa.RecordBatch:
        """A process function's outputs as a batch; timer registrations it made that were
        refused are counted as invalid records."""
        if self.join is not None:
            rows = pairs(rows)
        else:
            for row in rows:
                row["value"] = json.dumps(row["value"])
        if self.timers is not None:
            refused = self.timers.take_invalid()
            if refused:
                self.ctx.reject(f"{INVALID_REASON} registrations refused", refused[0], len(refused))
        return pa.RecordBatch.from_pylist(rows, schema=self.out_schema)

    def fire_timers(self, kind: TimerKind) -> None:
        """Run `on_timer` for the due timers of `kind` of the groups that fire here, and send
        what it outputs."""
        if self.timers is None or not isinstance(self.state, ProcessState | RocksProcessState):
            return
        if kind == EVENT:
            limit = self.watermark.current
            if limit is None:
                return
        else:
            limit = now_us()
        if self.timers.queue.next_due(kind) is None:
            return
        t0 = time.perf_counter()
        self.timers.at(self.watermark.current)
        rows = self.timers.fire(self.state, kind, limit, self.ready())
        # Timers that send nothing (a join dropping records) were work too: busy time.
        self.send_out(self.process_rows(rows) if rows else None, t0)

    def drop_late(self, batch: pa.RecordBatch, watermark: int | None) -> pa.RecordBatch:
        """Window rows (keyshift.runtime.windows) but those too late for their window at
        `watermark` or at the instance their group came from (past its end and the allowed
        lateness): counted, and written to the late-records log if the job has one."""
        assert self.windows is not None
        groups = batch.column(GROUP).to_numpy()
        late = self.windows.too_late(batch, self.windows.threshold(watermark, groups))
        return self.set_aside(batch, late, self.windows.as_records)

    def drop_late_joined(self, batch: pa.RecordBatch, watermark: int | None) -> pa.RecordBatch:
        """A join's records but those too late for it at `watermark` or at the instance their
        group came from (their window fired, or partners they should meet may be gone):
        counted, and written to the late-records log if the job has one (as the join reads
        them: key, side, record)."""
        assert self.join is not None and self.handed_over is not None
        threshold = self.handed_over.threshold(watermark, batch.column(GROUP).to_numpy())
        late = self.join.late(batch.column(EVENT_TIME).to_numpy(), threshold)
        return self.set_aside(batch, late, lambda rows: rows)

    def set_aside(
        self,
        batch: pa.RecordBatch,
        late: np.ndarray,
        as_records: Callable[[pa.RecordBatch], pa.RecordBatch],
    ) -> pa.RecordBatch:
        """`batch` but its `late` rows, which are counted and written to the late-records
        log (as `as_records` has them) if the job has one."""
        if not late.any():
            return batch
        self.too_late(as_records(batch.filter(pa.array(late))))
        return batch.filter(pa.array(~late))

    def too_late(self, records: pa.RecordBatch) -> None:
        """Records too late for their windows: counted, and logged if the job keeps a log."""
        self.ctx.metrics.count(MetricName.LATE_RECORDS, records.num_rows)
        if self.late_records is not None:
            self.late_records.write(records)

    def apply_to_windows(self, batch: pa.RecordBatch) -> pa.RecordBatch | None:
        """Window rows into their windows' state. They were judged too late or not against the
        watermark when they arrived (`records`): parked records of a group moving in are
        applied later, when the watermark may have passed their window, which has not fired
        (a group's windows fire here once it is in). Only the old owner's watermark, known by
        then, is checked again: what it fired is complete. A window that has fired (here or
        at the old owner) and is still within its allowed lateness sends its updated result:
        the updates to send."""
        assert self.windows is not None
        batch = self.drop_late(batch, None)
        if not batch.num_rows:
            return None
        thresholds = self.windows.thresholds(self.watermark.current, self.ready())
        updated, late = self.windows.absorb(batch, thresholds)
        if late is not None:
            self.too_late(late)
        return updated

    def send_out(self, out: pa.RecordBatch | None, started: float) -> None:
        """Updates to the sink instance of each one's key group and to the keyed stages fed."""
        parts: list[list[tuple[int, bytes]]] = []  # per sink fed
        sent = 0
        routed: list[Routed] = []
        if out is None or not out.num_rows:
            self.ctx.metrics.count(MetricName.BUSY_SECONDS, time.perf_counter() - started)
            return
        for sink in self.sinks:
            parts.append(sink.route(out))
            sent += out.num_rows
        if self.outputs.routers:
            routed_out, routed = self.outputs.prepare(with_record_ids(out))
            sent += routed_out
        self.ctx.metrics.count(MetricName.BUSY_SECONDS, time.perf_counter() - started)
        # Counted with the input, before a full downstream holds the send: DS2's selectivity is
        # out / in over a window, and a batch counted in but not yet out read it ~10 % low.
        self.ctx.metrics.count(MetricName.RECORDS_OUT, sent)
        for sink, sink_parts in zip(self.sinks, parts, strict=True):
            sink.send(sink_parts)
        self.outputs.send(routed)

    def senders(self) -> frozenset[str]:
        """The instances of the stages upstream now (their rescales change them)."""
        return self.ctx.upstream_names(*self.upstream)

    def records(self, batch: pa.RecordBatch, sender: str) -> None:
        """A batch from upstream: split it by what this instance does with each group."""
        if self.windows is not None:
            batch = self.drop_late(self.windows.expand(batch), self.watermark.current)
        elif self.join is not None:
            batch = self.drop_late_joined(batch, self.watermark.current)
        if not batch.num_rows:
            return
        groups = batch.column(GROUP).to_numpy()
        rest = np.ones(batch.num_rows, dtype=bool)
        if self.move_out is not None:
            leaving = self.move_out.leaving(groups)
            if leaving.any():
                self.move_out.forward(batch.filter(pa.array(leaving)), groups[leaving])
                rest &= ~leaving
        if self.move_in is not None:
            pending = self.move_in.pending(groups) & rest
            if pending.any():
                self.move_in.receive(batch.filter(pa.array(pending)), forwarded=False)
                rest &= ~pending
        foreign = rest & ~self.owned[groups]
        if foreign.any():
            group = int(groups[np.flatnonzero(foreign)[0]])
            raise ProtocolError(
                f"{foreign.sum()} records of key group {group} from {sender}, which this "
                "instance neither owns nor is receiving"
            )
        self.apply(batch if rest.all() else batch.filter(pa.array(rest)))

    # -- control ---------------------------------------------------------------------------

    def command(self, command: Command) -> None:
        if isinstance(command, Topology):
            self.outputs.handle(command)
            for sink in self.sinks:
                sink.handle(command)
            # A retired sender's barrier never comes: an alignment waiting for it ends here.
            self.checkpoint_if_aligned()
            present = {f"{s}/{i}" for s in self.upstream for i in command.stages.get(s, {})}
            self.watermark_moved(
                self.watermark.forget_lost(self.upstream, present, command.retired)
            )
            return
        if isinstance(command, Reroute) and any(sink.handle(command) for sink in self.sinks):
            return  # a rescale of a sink
        if self.outputs.handle(command):
            self.forward_watermark()  # to instances that joined a stage downstream
            return  # a rescale of a keyed stage downstream
        if isinstance(command, Preload):
            if self.checkpointer is None:
                raise ProtocolError("a preload from a checkpoint, but the job takes no checkpoints")
            self.discard_preload()
            store = self.checkpointer.checkpoint_store()
            self.preload = Preloader(self.ctx, store, command, self.state)
        elif isinstance(command, MigrateIn):
            if self.move_in is not None:
                raise ProtocolError("migrate_in while another move in is running")
            incoming = np.asarray([g for gs in command.groups.values() for g in gs], np.int64)
            preloaded = self.claim_preload(command.handover, incoming)
            self.move_in = MoveIn(self.ctx, self.state, command, self.apply, self.seal, preloaded)
            self.owned |= self.move_in.source_of >= 0
            self.ctx.emit(Ack(step="migrate_in", epoch=self.move_in.epoch))
        elif isinstance(command, MigrateOut):
            if self.move_out is not None:
                raise ProtocolError("migrate_out while another move out is running")
            current = self.watermark.current
            marks = self.checkpointer.marks_since if self.checkpointer is not None else None
            move = MoveOut(self.ctx, self.state, command, self.seal, current, marks)
            self.move_out = move
            if self.handed_over is not None and current is not None:
                # Windows fired here (and join records dropped) are late at the new owners too.
                move.tell(WATERMARK, json.dumps(Watermark(watermark=current).wire()).encode())
            # Downstream, nothing may go past this instance's watermark until the new owners
            # have sent what the moving groups still hold (parked records, unfired windows).
            self.forward_watermark(hold=WatermarkHold(epoch=move.epoch, until=sorted(move.outlets)))
            for ended in self.ended:
                move.marker(ended, None)
            self.owned &= move.target < 0
            self.forward_queued(move)
            self.ctx.emit(Ack(step="migrate_out", epoch=move.epoch))
        elif isinstance(command, PushRate):
            # A rate for a move that has finished here already changes nothing.
            if self.move_out is not None and self.move_out.epoch == command.epoch:
                self.move_out.pace(command.keys_per_s)
        elif isinstance(command, Abort):
            lost = set(command.lost)
            if self.move_out is not None:
                kept = self.move_out.abandon(lost)
                self.owned |= kept
                # Their timers and windows left the indexes while they were moving out; those
                # that came due meanwhile fire now, the watermark may not move again.
                self.index_timers(np.flatnonzero(kept))
                if self.windows is not None:
                    take_back(self.windows, np.flatnonzero(kept), self.move_out.left_at)
                    self.fire_windows()
                self.fire_timers(EVENT)
            if self.move_in is not None:
                self.move_in.abandon(lost)
            # Groups whose state died with a lost instance go on here, from empty.
            adopted = command.adopt.get(str(self.ctx.index), [])
            self.owned[np.asarray(adopted, dtype=np.int64)] = True
            self.ctx.emit(Ack(step="abort", epoch=command.epoch))
        elif isinstance(command, Retire):
            self.retire = True
        elif isinstance(command, Rescaling):
            self.rescaling = command.active
            if not command.active:
                self.discard_preload()
            # Senders that ended before this instance joined never sent it their END.
            self.ended |= set(command.ended) & self.senders()

    def claim_preload(self, handover: int | None, incoming: np.ndarray) -> bool:
        """Whether a move in builds on the preload: when it names the preload's checkpoint.
        One that does not (the rescale fell back to a direct transfer) drops the preload."""
        preload = self.preload
        if handover is None:
            self.discard_preload()
            return False
        if preload is None or preload.checkpoint != handover or not preload.claim(incoming):
            raise ProtocolError(
                f"a move in builds on checkpoint {handover}, which this instance has not "
                "preloaded its groups from"
            )
        return True

    def discard_preload(self) -> None:
        if self.preload is not None:
            self.preload.discard(self.state)
            self.preload = None

    def poll_preload(self) -> None:
        if self.preload is not None and (event := self.preload.poll(self.state)) is not None:
            self.ctx.emit(event)

    def forward_queued(self, move: MoveOut) -> None:
        """Re-route what already waits in the inbox: moving records leave now, the rest stay
        queued in order (records of moving groups must not wait behind the backlog)."""
        # Only what is queued now: released credits let senders refill the inbox meanwhile.
        for _ in range(self.ctx.inbox.depth()):
            delivery = self.ctx.inbox.get(timeout=0)
            if delivery is None:
                break
            payload = delivery.content()
            if delivery.kind == BATCH and isinstance(payload, pa.RecordBatch):
                batch = payload
                groups = batch.column(GROUP).to_numpy()
                leaving = move.leaving(groups)
                if leaving.any():
                    moving = batch.filter(pa.array(leaving))
                    if self.windows is not None:
                        # What stays is expanded when it is delivered, as any batch is.
                        moving = self.windows.expand(moving)
                    move.forward(moving, moving.column(GROUP).to_numpy())
                    batch = batch.filter(pa.array(~leaving))
                payload = batch
            self.backlog.append((delivery.sender, delivery.kind, payload))
            delivery.release()

    def fetch(self, request: FetchRequest) -> None:
        """A new owner's fetch, for the running move out or one that has just finished (a
        fetch may cross the last pushed chunk on the wire)."""
        epoch = request.body.epoch
        move = self.move_out if self.move_out is not None else self.last_out
        if move is None or move.epoch != epoch:
            raise ProtocolError(f"a fetch for epoch {epoch} arrived with no such move out")
        move.fetch(request)

    def finish_moves(self) -> None:
        if self.move_out is not None and self.move_out.done():
            move = self.move_out
            move.close()
            self.last_out = move
            self.move_out = None
            self.ctx.emit(OutDone(epoch=move.epoch, stats=dict(move.stats), fallback=move.fallback))
            self.forward_watermark()  # no longer held where the move left it
        if self.move_in is not None:
            self.move_in.handle_replies()
            if self.move_in.done():
                move_in = self.move_in
                self.move_in = None
                if self.windows is not None:
                    # As fired or not by their old owners' watermarks (hand_over).
                    self.windows.rebuild(np.flatnonzero(move_in.source_of >= 0).tolist(), None)
                    self.fire_windows()
                # Timers of the groups that came in fire here from now on: those due, before
                # the watermark hold downstream is released.
                self.index_timers(np.flatnonzero(move_in.source_of >= 0))
                self.fire_timers(EVENT)
                self.forward_watermark(release=move_in.epoch)
                move_in.close()
                self.ctx.emit(InDone(epoch=move_in.epoch, stats=dict(move_in.stats)))
        live: Counter[str] = Counter()
        for move_stats in (m.stats for m in (self.move_out, self.move_in) if m is not None):
            live.update(move_stats)
        if self.move_in is not None:
            live["records_parked_now"] = self.move_in.parked_records()
        self.ctx.metrics.parked_now.set(live["records_parked_now"])
        self.ctx.extra_stats["migration"] = dict(live)

    # -- loop ------------------------------------------------------------------------------

    def deliver(self, sender: str, kind: bytes, payload: Any) -> None:
        if kind == BATCH:
            self.records(payload, sender)
        elif kind == MARKER:
            if self.move_out is not None:
                self.move_out.marker(sender, payload)
        elif kind == FORWARD:
            if self.move_in is None:
                raise ProtocolError(f"forwarded records from {sender} with no move in")
            self.move_in.receive(payload, forwarded=True)
        elif kind == STATE:
            if self.move_in is None:
                raise ProtocolError(f"state from {sender} with no move in")
            self.move_in.state_chunk(payload, sender)
        elif kind == FORWARD_DONE:
            if self.move_in is None:
                raise ProtocolError(f"forward-done from {sender} with no move in")
            self.move_in.forwarding_done(sender)
        elif kind == BARRIER:
            self.aligner.arrive(sender, parse(Barrier, json.loads(payload)))
            self.checkpoint_if_aligned()
        elif kind == WATERMARK:
            self.watermark_message(sender, parse(Watermark, json.loads(payload)))
        elif kind == LEAVE and sender.rsplit("/", 1)[0] in self.upstream:
            self.watermark_moved(self.watermark.leave(sender))
        elif kind == END and sender in self.senders():
            self.ended.add(sender)
            self.watermark_moved(self.watermark.end(sender))
            if self.move_out is not None:
                self.move_out.marker(sender, None)
            self.checkpoint_if_aligned()

    def watermark_message(self, sender: str, mark: Watermark) -> None:
        """A watermark from upstream, or from the old owner of groups moving here."""
        stage, index = sender.rsplit("/", 1)
        if stage == self.ctx.stage:
            handed, move = self.handed_over, self.move_in
            if mark.watermark is not None and handed is not None and move is not None:
                # Its windows that fired (and join records it dropped) are late here.
                handed.hand_over(np.flatnonzero(move.source_of == int(index)), mark.watermark)
            return
        if mark.hold is not None:
            until = {f"{stage}/{i}" for i in mark.hold.until}
            self.watermark.hold(stage, mark.hold.epoch, sender, mark.watermark, until)
        moved = False
        if mark.release is not None:
            moved = self.watermark.release(stage, mark.release, sender)
        moved |= self.watermark.advance(sender, mark.watermark, mark.idle)
        self.watermark_moved(moved)

    def forward_watermark(
        self, hold: WatermarkHold | None = None, release: int | None = None
    ) -> None:
        """Tell the keyed stages fed how far this instance's event time is (after the results
        of the windows it has fired)."""
        if not self.outputs.routers or self.outputs.paused:
            return  # a paused sender sends nothing; its resume sends the watermark then
        current = self.watermark.current
        if self.move_out is not None and current is not None:
            # An aborted move brings its groups back with the windows and timers that came due
            # while they were away, and those fire here then: nothing downstream may be past
            # them, so the watermark sent stays where the move left it until the move is done.
            left_at = self.move_out.left_at
            current = None if left_at is None else min(current, left_at)
        if current is not None and current >= WatermarkTracker.FINAL:
            current = None  # their END tells them that
        if current is None and hold is None and release is None:
            return
        self.outputs.watermark(Watermark(watermark=current, hold=hold, release=release))

    def watermark_moved(self, moved: bool) -> None:
        """The instance's watermark, the minimum over its live sources', went forward."""
        current = self.watermark.current
        if not moved or current is None:
            return
        if current < WatermarkTracker.FINAL:
            self.ctx.watermark_us = current
        self.fire_windows()
        self.fire_timers(EVENT)
        self.forward_watermark()

    def fire_windows(self) -> None:
        """Send the results of the windows the watermark has passed."""
        current = self.watermark.current
        if self.windows is not None and current is not None:
            t0 = time.perf_counter()
            self.send_out(self.windows.fire(current, self.ready()), t0)

    def ready(self) -> np.ndarray:
        """The groups whose windows fire here: owned, and not still moving in (their windows
        wait for all their records: until in_done)."""
        ready: np.ndarray = self.owned
        if self.move_in is not None:
            ready = ready & (self.move_in.source_of < 0)
        return ready

    def checkpoint_if_aligned(self) -> None:
        """Once every live sender's barrier is in: snapshot the owned groups (their upload
        runs beside the loop and acks when it ends), pass the barrier on downstream, and go on
        with what the aligned senders sent meanwhile."""
        if not self.aligner.aligned(self.senders() - self.ended):
            return
        barrier = self.aligner.barrier
        assert barrier is not None
        if self.checkpointer is None:
            raise ProtocolError("a checkpoint barrier arrived, but the job takes no checkpoints")
        # An upload still running belongs to a checkpoint the coordinator gave up on: this
        # one needs to know whether that one's files were stored before it can build on them.
        self.acknowledge(self.checkpointer.wait())
        current = self.watermark.current
        watermark = current if current is not None and current < WatermarkTracker.FINAL else None
        self.checkpointer.start(barrier, self.state, self.owned, watermark)
        self.outputs.barrier(barrier)
        for sink in self.sinks:
            sink.barrier(barrier)
        for delivery in self.aligner.finish():
            self.backlog.append((delivery.sender, delivery.kind, delivery.content()))
            delivery.release()

    def acknowledge(self, ack: KeyedCheckpointAck | None) -> None:
        """Tell the coordinator how a checkpoint's upload ended."""
        if ack is None:
            return
        if ack.error:
            self.ctx.metrics.storage_failed("checkpoint")
        else:
            # How much of the checkpoint the records waited for: in the status, for benchmarks.
            self.ctx.extra_stats["checkpoint"] = {
                "id": ack.id,
                "seconds": round(ack.seconds, 3),
                "snapshot_seconds": round(ack.snapshot_seconds, 3),
                "written": ack.written,
            }
        self.ctx.emit(ack)

    def run(self) -> None:
        ctx = self.ctx
        metrics = ctx.metrics
        while not (
            self.senders() <= self.ended
            and self.move_out is None
            and self.move_in is None
            and not self.rescaling
        ):
            ctx.check()
            while (command := ctx.next_command()) is not None:
                self.command(command)
            while request := ctx.fetches.get_nowait() if not ctx.fetches.empty() else None:
                if request.take():
                    self.fetch(request)
            if self.move_out is not None:
                self.move_out.flush()
                self.move_out.push_for(PUSH_SLICE)
            self.poll_preload()
            self.finish_moves()
            if self.checkpointer is not None:
                self.acknowledge(self.checkpointer.finished())
            if self.retire and self.move_out is None and self.move_in is None:
                break
            if self.outputs.paused:
                # A rescale of a stage downstream moves its state with nothing flowing.
                time.sleep(IDLE_WAIT)
                metrics.count(MetricName.IDLE_SECONDS, IDLE_WAIT)
                continue
            self.fire_timers(PROCESSING)
            if self.backlog:
                self.deliver(*self.backlog.popleft())
                continue
            busy_moving = self.move_out is not None and (
                bool(self.move_out.push_order) or any(self.move_out.outbox.values())
            )
            t_wait = time.perf_counter()
            delivery = ctx.inbox.get(timeout=0 if busy_moving else IDLE_WAIT)
            metrics.count(MetricName.IDLE_SECONDS, time.perf_counter() - t_wait)
            if delivery is None:
                continue
            if self.aligner.holds(delivery.sender):
                self.aligner.hold(delivery)  # its credit stays taken: the sender waits
                continue
            delivery.release()
            self.deliver(delivery.sender, delivery.kind, delivery.content())
        if self.checkpointer is not None:
            self.acknowledge(self.checkpointer.wait())
        # A retired instance only leaves: a later one of its name may join the stage again.
        kind = LEAVE if self.retire else END
        if self.late_records is not None:
            self.late_records.close()
        self.outputs.finish(kind)
        for sink in self.sinks:
            sink.finish(kind)

    def close(self) -> None:
        """Close the state's database (RocksDB), for the next generation to open it again
        (a rewind); memory state is only dropped."""
        self.ctx.state_size = None  # the reports' thread reads it
        self.ctx.group_hits = None
        if isinstance(self.state, RocksStore):
            self.state.close()


def run(ctx: InstanceContext) -> None:
    stage = KeyedStage(ctx)
    try:
        stage.run()
    except (Rewinding, TransportError):  # a broken stream may be followed by a rewind
        stage.close()
        raise
