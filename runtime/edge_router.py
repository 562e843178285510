"""The key_by edge into a keyed stage, at the sending end: run the map/filter functions chained
into the sender, check the records against the schema the keyed stage reads, compute their key
groups, and send each record to the owner of its group by the keyed stage's assignment epoch.

Every stage that feeds keyed stages owns an `EdgeRouter` per keyed stage it feeds, in its
`Outputs`: the source loop (`keyshift.runtime.source_stage`) and a keyed instance whose updates
go on to other keyed stages (`keyshift.runtime.keyed_stage`). A rescale of a keyed stage it
feeds reaches it as `reroute` (to that stage's router), `pause` and `resume` (the whole sender:
it stops sending anything) from `keyshift.runtime.rescale`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from keyshift.runtime.job import Chained, FieldType, Route, resolve_function
from keyshift.runtime.joins import wrap
from keyshift.runtime.keyspace import Assignment, key_groups
from keyshift.runtime.protocol import (
    Ack,
    Barrier,
    Command,
    Pause,
    Reroute,
    Resume,
    Topology,
    Watermark,
)
from keyshift.runtime.records import (
    EVENT_TIME,
    GROUP,
    INGEST_TIME,
    METADATA_FIELDS,
    RESERVED_FIELDS,
    SEQ,
    SOURCE,
    record_schema,
    split_by_owner,
)
from keyshift.runtime.schema_check import check_records, event_time_problem
from keyshift.runtime.stage_context import InstanceContext
from keyshift.runtime.transport import (
    BARRIER,
    BATCH,
    END,
    MARKER,
    WATERMARK,
    Outlet,
    TransportError,
)

log = logging.getLogger("keyshift.routing")
Function = tuple[str, Callable[..., Any]]
Stamp = Callable[[pa.RecordBatch], pa.RecordBatch]  # sets each record's event time


def resolve_transforms(transforms: tuple[Chained, ...]) -> list[Function]:
    return [(t.kind, resolve_function(t.function)) for t in transforms]


def apply_transforms(
    ctx: InstanceContext,
    batch: pa.RecordBatch,
    transforms: list[Function],
    fields: Mapping[str, FieldType],
    time_field: str | None = None,
) -> pa.RecordBatch:
    """Run map/filter/flat_map per record; reject what fails or does not fit `fields`; keep
    the rest in order, each with the metadata of the record it came from (a flat_map's
    records share it). A record whose event-time field (`time_field`, at a source that takes
    event times from one) is missing, null or no int is a bad event time
    (`InstanceContext.bad_event_times`)."""
    # Filters alone keep rows as they are; event times taken from a field are checked per
    # record, so that source takes the general path.
    if (
        time_field is None
        and all(kind == "filter" for kind, _ in transforms)
        and batch.schema.equals(record_schema(fields))
    ):
        return _filter_rows(ctx, batch, transforms)
    results: list[Any] = []
    for record in batch.to_pylist():
        current: list[Any] = [record]
        try:
            for kind, fn in transforms:
                if kind == "filter":
                    current = [r for r in current if fn(r)]
                    continue
                made = []
                for r in current:
                    meta = {f: r[f] for f in METADATA_FIELDS}
                    outputs = fn(r) if kind == "flat_map" else [fn(r)]
                    # Any mapping becomes a dict here, inside the try: one whose reads fail
                    # is this record's error, not the stage's.
                    made += [{**o, **meta} if isinstance(o, Mapping) else o for o in outputs]
                current = made
        except Exception as exc:
            ctx.reject(f"function_error {type(exc).__name__}: {exc}", record)
            continue
        results += [r for r in current if r is not None]  # a map's None drops its record
    if time_field is not None:
        results = _without_bad_times(ctx, results, time_field)
    checked = check_records(results, fields, ctx.spec.allow_non_finite)
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


def _without_bad_times(ctx: InstanceContext, results: list[Any], time_field: str) -> list[Any]:
    kept, bad, reasons = [], [], []
    for record in results:
        reason = event_time_problem(record, time_field)
        if reason is None:
            kept.append(record)
        else:
            # As the function made it: the metadata it was given is the runtime's.
            bad.append({k: v for k, v in record.items() if k not in RESERVED_FIELDS})
            reasons.append(reason)
    ctx.bad_event_times(bad, reasons)
    return kept


def _filter_rows(
    ctx: InstanceContext, batch: pa.RecordBatch, filters: list[Function]
) -> pa.RecordBatch:
    """Filters alone decide which records go on, and a filter does not make records: what they
    keep are the batch's own rows, already of the schema, so nothing is checked or rebuilt
    (checking and rebuilding were most of a NEXMark source's time). A filter that raises
    rejects its record, as in `apply_transforms`."""
    keep = np.zeros(batch.num_rows, dtype=bool)
    for i, record in enumerate(batch.to_pylist()):
        try:
            keep[i] = all(fn(record) for _, fn in filters)
        except Exception as exc:
            ctx.reject(f"function_error {type(exc).__name__}: {exc}", record)
    return batch.filter(pa.array(keep))


def switch_outlets(
    ctx: InstanceContext, outlets: dict[int, Outlet], epoch: int, joined: Mapping[str, str]
) -> None:
    """A reroute's switch on one edge: the epoch marker on every stream open now (what this
    sender sent before it is the old routing's), then streams to the instances that joined."""
    marker = json.dumps({"epoch": epoch}).encode()
    for outlet in outlets.values():
        ctx.send(outlet, marker, kind=MARKER)
    for index, address in joined.items():
        if int(index) not in outlets:
            outlets[int(index)] = ctx.outlet(address)


class EdgeRouter:
    """Sends each record to the instance of keyed stage `target` that owns its key group, by
    assignment epoch.

    On a `reroute` it first sends an epoch MARKER on every stream to the stage, after the last
    batch it routed by the old epoch, then switches. Streams stay open until the sender ends
    (their END means "this sender is done"; a retired sender's LEAVE only closes them), except
    to instances that left the topology.
    """

    def __init__(self, ctx: InstanceContext, target: str, routes: list[Route]) -> None:
        self.ctx = ctx
        self.target = target
        step = ctx.spec.keyed_step(target)
        self.fields = step.fields
        self.key_by = step.stage.key_by
        # Each way into the stage: its transforms, and into a join its side (both ways from
        # one sender into a join go on the same streams, one after the other per batch).
        self.ways = [(resolve_transforms(route.transforms), route.side) for route in routes]
        self.sides = step.sides
        # A source stamps its records' event times from this field, after the functions.
        sources = {step.stage.name: step.stage for step in ctx.spec.source_steps()}
        settings = sources[ctx.stage].event_time if ctx.stage in sources else None
        self.time_field = settings.field if settings is not None else None
        self.outlets = ctx.connect(target)
        self.assignment = ctx.assignment(target)
        self.dead: set[int] = set()
        self.stranded: list[pa.RecordBatch] = []

    def prepare(
        self, batch: pa.RecordBatch, stamp: Stamp = lambda batch: batch
    ) -> tuple[pa.RecordBatch, list[tuple[int, pa.RecordBatch]]]:
        """The records as the keyed stage reads them (transformed, checked, `stamp`ed with
        their event times, into a join wrapped as its side, with their key groups), and their
        parts by owner."""
        parts = []
        for transforms, side in self.ways:
            fields = self.fields if side is None else self.sides[side].fields
            way = (
                apply_transforms(self.ctx, batch, transforms, fields, self.time_field)
                if transforms
                else batch
            )
            way = stamp(way)
            if side is not None:
                way = wrap(way, side, self.sides[side].key_by, self.sides[side].fields)
            parts.append(way)
        batch = parts[0] if len(parts) == 1 else pa.concat_batches(parts)
        groups = key_groups(batch.column(self.key_by), self.ctx.spec.max_key_groups)
        batch = batch.set_column(batch.schema.get_field_index(GROUP), GROUP, pa.array(groups))
        return batch, self.route(batch, groups)

    def route(self, batch: pa.RecordBatch, groups: np.ndarray) -> list[tuple[int, pa.RecordBatch]]:
        owners = self.assignment.owners[groups]
        # By the assignment, not the open streams: an owner that left keeps its records here.
        parallelism = int(owners.max()) + 1 if len(owners) else 1
        return split_by_owner(batch, owners, parallelism)

    def send(self, parts: list[tuple[int, pa.RecordBatch]]) -> None:
        for owner, payload in parts:
            outlet = self.outlets.get(owner)
            if owner in self.dead or outlet is None:
                # Dead, or gone from the topology before the reroute that gives its groups away.
                self.stranded.append(payload)
                continue
            if not self.deliver(owner, outlet, payload):
                # The coordinator reroutes its groups to survivors, and these records follow
                # them then. (What it had received is gone with it.)
                self.stranded.append(payload)

    def deliver(
        self, owner: int, outlet: Outlet, payload: bytes | pa.RecordBatch, kind: bytes = BATCH
    ) -> bool:
        """Send to keyed instance `owner`; False if it died. A dead receiver is the
        coordinator's to handle (a reroute, an abort, or a recovery): this sender goes on."""
        try:
            self.ctx.send(outlet, payload, kind=kind)
        except TransportError as exc:
            log.warning("%s/%d is gone (%s); holding its records", self.target, owner, exc)
            self.dead.add(owner)
            return False
        return True

    def barrier(self, barrier: Barrier) -> None:
        """A checkpoint barrier on every live stream: what was sent before it is in it."""
        encoded = json.dumps(barrier.wire()).encode()
        for index, outlet in list(self.outlets.items()):
            if index not in self.dead:
                self.deliver(index, outlet, encoded, kind=BARRIER)

    def topology(self, command: Topology) -> None:
        """Close the streams to instances that left the stage."""
        current = command.addresses(self.target)
        for index in [i for i in self.outlets if i not in current]:
            self.outlets.pop(index).abort()

    def reroute(self, command: Reroute) -> None:
        new = Assignment.from_json(command.assignment)
        for index in set(command.lost) | self.dead:
            if index in self.outlets:
                self.outlets.pop(index).abort()
        self.dead.clear()
        switch_outlets(self.ctx, self.outlets, new.epoch, command.keyed)
        self.assignment = new
        stranded, self.stranded = self.stranded, []
        for batch in stranded:
            self.send(self.route(batch, batch.column(GROUP).to_numpy()))
        self.ctx.emit(Ack(step="reroute", epoch=new.epoch))

    def finish(self, kind: bytes = END) -> None:
        for outlet in self.outlets.values():
            outlet.finish(kind=kind)


Routed = tuple[EdgeRouter, list[tuple[int, pa.RecordBatch]]]


class Outputs:
    """A sending stage's routers, one per keyed stage it feeds, and whether a rescale of one of
    them has paused it."""

    def __init__(self, ctx: InstanceContext, routes: tuple[Route, ...]) -> None:
        self.ctx = ctx
        ways: dict[str, list[Route]] = {}
        for route in routes:
            ways.setdefault(route.target, []).append(route)
        self.routers = {target: EdgeRouter(ctx, target, of) for target, of in ways.items()}
        self.paused = False
        # The last watermark message each keyed instance got, by its stage and index.
        self.watermarks: dict[tuple[str, int], bytes] = {}

    def prepare(
        self, batch: pa.RecordBatch, stamp: Stamp = lambda batch: batch
    ) -> tuple[int, list[Routed]]:
        """`batch` as every route sends it: the records out (after each route's filters), and
        each router's parts by owner."""
        out = 0
        routed = []
        for router in self.routers.values():
            records, parts = router.prepare(batch, stamp)
            out += records.num_rows
            routed.append((router, parts))
        return out, routed

    def send(self, routed: list[Routed]) -> None:
        for router, parts in routed:
            router.send(parts)

    def handle(self, command: Command) -> bool:
        """Follow a command meant for a keyed stage's senders; False if it is not one."""
        if isinstance(command, Reroute) and command.stage in self.routers:
            self.routers[command.stage].reroute(command)
        elif isinstance(command, Topology):
            for router in self.routers.values():
                router.topology(command)
        elif isinstance(command, Pause | Resume):
            self.paused = isinstance(command, Pause)
            self.ctx.emit(Ack(step=command.type, epoch=command.epoch))
        else:
            return False
        return True

    def barrier(self, barrier: Barrier) -> None:
        for router in self.routers.values():
            router.barrier(barrier)

    def watermark(self, message: Watermark) -> None:
        """`message` to every keyed instance fed that has not had it yet (called again between
        batches, it reaches instances that joined meanwhile)."""
        payload = json.dumps(message.wire()).encode()
        # Only to the instances that own key groups now: one that is leaving owns none, and may
        # have stopped reading (a watermark for it would wait for credit forever).
        for stage, router in self.routers.items():
            for index in np.unique(router.assignment.owners).tolist():
                outlet = router.outlets.get(index)
                sent = self.watermarks.get((stage, index))
                if (
                    outlet is not None
                    and index not in router.dead
                    and sent != payload
                    and router.deliver(index, outlet, payload, kind=WATERMARK)
                ):
                    self.watermarks[(stage, index)] = payload

    def finish(self, kind: bytes = END) -> None:
        for router in self.routers.values():
            router.finish(kind)
