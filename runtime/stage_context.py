"""What every stage loop is given: the `InstanceContext` (spec, metrics, inbox, outlets, the
coordinator's commands, reports) and the on-demand state fetches queued for the keyed loop.

Built by `keyshift.runtime.instance` for its one stage; used by the stage loops
(`source_stage`, `keyed_stage`, `sink_stage`) and `migration`. It imports none of them, so
the instance process and its loops form no import circle.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from keyshift.runtime.auth import Security
from keyshift.runtime.checkpoint_store import CheckpointMeta
from keyshift.runtime.identity import Identity
from keyshift.runtime.job import JobSpec
from keyshift.runtime.keyspace import Assignment
from keyshift.runtime.late_records import BAD_EVENT_TIME, BadEventTimesWriter
from keyshift.runtime.metrics import InstanceMetrics, MetricName
from keyshift.runtime.protocol import (
    Command,
    Drain,
    Event,
    FetchBody,
    InstanceCall,
    ProtocolError,
    ReportRequest,
    Rewind,
    Stop,
    Topology,
    parse_command,
)
from keyshift.runtime.transport import (
    BATCH,
    Inbox,
    JsonClient,
    NoCredit,
    Outlet,
    TransportError,
)

log = logging.getLogger("keyshift.instance")
REPORT_INTERVAL = 0.5
SAMPLE_LOG_INTERVAL = 10.0
GROUP_REPORT_EVERY = 2  # reports; per-group loads feed the coordinator's assignment planner
MIGRATE_SERVICE = "keyshift.Migrate"


@dataclass
class FetchRequest:
    """An on-demand state fetch from a new owner, answered by this instance's stage loop.

    Serving a fetch hands the keys' state over (the old owner drops it), so a fetch the server
    gave up on must never be served afterwards: `take` (the loop) and `cancel` (the server's
    handler, at its deadline) decide under one lock which of them has it."""

    body: FetchBody
    done: threading.Event = field(default_factory=threading.Event)
    reply: bytes = b""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _owner: str = ""  # "", "loop" or "cancelled"

    def take(self) -> bool:
        """The stage loop's claim: False once the handler has cancelled the fetch."""
        return self._claim("loop")

    def cancel(self) -> bool:
        """The handler's claim at its deadline: False once the loop is serving the fetch."""
        return self._claim("cancelled")

    def _claim(self, who: str) -> bool:
        with self._lock:
            if not self._owner:
                self._owner = who
            return self._owner == who


class Stopped(Exception):
    """The instance was told to stop, or lost its coordinator."""


class Rewinding(Stopped):
    """The coordinator rewinds the job to a checkpoint (a local recovery): the stage loop ends
    and runs again from the checkpoint, in the same process."""


class InstanceContext:
    """What every stage loop uses: spec, metrics, inbox, outlets, commands, time accounting."""

    def __init__(
        self,
        spec: JobSpec,
        stage: str,
        index: int,
        control: JsonClient,
        inbox: Inbox,
        security: Security | None = None,
        identity: Identity | None = None,
    ):
        """`identity`: what the coordinator issued this instance at registration; reports,
        the command stream and data streams present it."""
        self.spec = spec
        self.security = security or Security.from_env()
        self.identity = identity
        self.stage = stage
        self.index = index
        self.name = f"{stage}/{index}"
        self.control = control
        self.inbox = inbox
        self.metrics = InstanceMetrics(spec.name, stage, str(index))
        self.topology: Topology | None = None
        self.topology_ready = threading.Event()
        self.drain = threading.Event()
        self.stop = threading.Event()
        self.fatal: str | None = None
        self.extra_stats: dict[str, Any] = {}
        self.state_size: Callable[[], tuple[int, int]] | None = None
        self.group_hits: Callable[[], np.ndarray] | None = None
        self.commands: queue.Queue[Command] = queue.Queue()
        self.fetches: queue.Queue[FetchRequest] = queue.Queue()
        self.fetch_served = threading.Event()  # set by a stage that answers fetches
        self._sampled: dict[str, float] = {}
        self._bad_times: BadEventTimesWriter | None = None
        self._bad_times_lock = threading.Lock()
        self._outlets: list[Outlet] = []
        self._reports = 0
        self.metrics_address = ""
        self.host = "127.0.0.1"  # the address this instance listens on
        self.restore: CheckpointMeta | None = None  # the checkpoint a recovery goes on from
        self.watermark_us: int | None = None  # event time (epoch µs), once the stage has one
        self.generation = 0  # of the data streams this instance sends and takes
        self.rewind: Rewind | None = None  # a rewind told and not yet done
        self._rewind_told = threading.Event()
        # upstream_names by the stages asked for, as of the topology they were made from.
        self._names: dict[tuple[str, ...], frozenset[str]] = {}
        self._names_of: Topology | None = None

    # -- commands ------------------------------------------------------------------------

    def follow_commands(self) -> None:
        try:
            for body in self.control.stream("Watch", self._whoami().wire()):
                command = parse_command(body)
                if isinstance(command, Topology):
                    self.topology = command
                    self.topology_ready.set()
                    self.metrics.parallelism.set(len(command.stages[self.stage]))
                    self.commands.put(command)
                elif isinstance(command, Drain):
                    self.drain.set()
                elif isinstance(command, Rewind):
                    log.info("rewinding to checkpoint %d", command.checkpoint)
                    self.rewind = command
                    self._rewind_told.set()
                elif isinstance(command, Stop):
                    log.info("told to stop: %s", command.reason)
                    self.stop.set()
                    return
                else:
                    self.commands.put(command)
            if not self.stop.is_set():
                self.fatal = f"coordinator at {self.control.address} closed the command stream"
        except TransportError as exc:
            if not self.stop.is_set():
                self.fatal = f"lost the coordinator: {exc}"
        except ProtocolError as exc:
            # The coordinator runs this version's protocol: a command that does not fit is a
            # bug, and going on without it would break the protocol it belongs to.
            self.fatal = f"from the coordinator at {self.control.address}: {exc}"
        self.stop.set()

    def check(self) -> None:
        """Raise Stopped when the loop must end now (Rewinding: to run again)."""
        if self.stop.is_set():
            raise Stopped(self.fatal or "stopped")
        if self.rewind is not None:
            raise Rewinding(f"rewinding to checkpoint {self.rewind.checkpoint}")

    def await_rewind(self, timeout: float) -> bool:
        """Whether a rewind is told within `timeout` (a data stream broke: a peer is lost, and
        the coordinator decides whether the job recovers in place), unless told to stop."""
        deadline = time.monotonic() + timeout
        while not self._rewind_told.wait(0.05):
            if self.stop.is_set() or time.monotonic() > deadline:
                return False
        return not self.stop.is_set()

    def begin_generation(self, restore: CheckpointMeta) -> int:
        """Start the rewind's generation after the loop has ended: nothing of the last one's
        run is kept (outlets, commands, fetches, topology), the inbox takes only the new
        generation's streams, and the loop goes on from `restore`. The generation begun."""
        assert self.rewind is not None
        generation = self.rewind.generation
        self.close_outlets()
        self._outlets = []
        self.topology = None
        self.topology_ready.clear()
        # Nothing is sent here after the Rewind until this instance says it has rewound.
        for pending in (self.commands, self.fetches):
            while not pending.empty():
                pending.get_nowait()
        self.fetch_served.clear()
        self.state_size = None
        self.group_hits = None
        self.extra_stats.clear()
        self.watermark_us = None
        self.restore = restore
        self.inbox.rewind(generation)
        self.generation = generation
        self._rewind_told.clear()
        self.rewind = None
        return generation

    def wait_topology(self) -> Topology:
        while not self.topology_ready.wait(0.1):
            self.check()
        assert self.topology is not None
        return self.topology

    def assignment(self, stage: str) -> Assignment:
        """Keyed stage `stage`'s current assignment."""
        return Assignment.from_json(self.wait_topology().assignments[stage])

    def next_command(self) -> Command | None:
        try:
            return self.commands.get_nowait()
        except queue.Empty:
            return None

    def addresses(self, stage: str) -> dict[int, str]:
        """The data addresses of a stage's current instances, by index."""
        return self.wait_topology().addresses(stage)

    def outlet(self, address: str) -> Outlet:
        outlet = Outlet(address, self.name, self.security, self.identity, self.generation)
        self._outlets.append(outlet)
        return outlet

    def connect(self, stage: str) -> dict[int, Outlet]:
        return {i: self.outlet(a) for i, a in sorted(self.addresses(stage).items())}

    def upstream_names(self, *stages: str) -> frozenset[str]:
        """The current instances of `stages` (the senders of a union), by name. The loops ask
        for them for every batch: made once per topology."""
        topology = self.wait_topology()
        if self._names_of is not topology:
            self._names, self._names_of = {}, topology
        names = self._names.get(stages)
        if names is None:
            names = frozenset(f"{s}/{i}" for s in stages for i in topology.addresses(s))
            self._names[stages] = names
        return names

    def emit(self, event: Event) -> None:
        """Tell the coordinator about a protocol step (acks, migration done) right away."""
        self.report(events=[event])

    # -- accounting ----------------------------------------------------------------------

    def send(self, outlet: Outlet, payload: bytes, kind: bytes = BATCH) -> None:
        """Send on `outlet`, counting the wait as backpressure; stop waiting if told to stop."""
        while True:
            try:
                waited = outlet.send(payload, deadline=time.monotonic() + 1.0, kind=kind)
                self.metrics.count(MetricName.BACKPRESSURED_SECONDS, waited)
                return
            except NoCredit:
                self.metrics.count(MetricName.BACKPRESSURED_SECONDS, 1.0)
                self.check()

    def reject(self, reason: str, sample: Any, count: int = 1) -> None:
        """Count records that do not fit the schema; log a sample at most every few seconds."""
        key = reason.split(" ")[0]
        self.metrics.invalid(key, count)
        now = time.monotonic()
        if now - self._sampled.get(reason, -1e9) >= SAMPLE_LOG_INTERVAL:
            self._sampled[reason] = now
            log.warning("rejected %d record(s): %s; sample: %r", count, reason, sample)

    def bad_event_times(self, records: Sequence[Any], reasons: Sequence[str]) -> None:
        """Records whose event time is missing, null or not a timestamp (one reason each): never
        applied, counted as invalid records with reason `event_time` (a sample logged), and
        written to the job's late-records log if it names one (keyshift.runtime.late_records).
        Called from the stage loop and the ingest endpoint's threads."""
        if not records:
            return
        self.reject(f"{BAD_EVENT_TIME} {reasons[0]}", records[0], len(records))
        settings = self.spec.late_records
        if settings is None:
            return
        with self._bad_times_lock:
            if self._bad_times is None:
                self._bad_times = BadEventTimesWriter(settings, self.stage, self.index)
        self._bad_times.write(records, reasons)

    def close_logs(self) -> None:
        """Write what a refused write of the bad-event-times log still holds, at the end."""
        if self._bad_times is not None:
            self._bad_times.close()

    def stats(self) -> dict[str, Any]:
        m = self.metrics
        keys, size = self.state_size() if self.state_size else (0, 0)
        m.state_keys.set(keys)
        m.state_bytes.set(size)
        depth = self.inbox.depth()
        m.queue_depth.set(depth)
        if self.watermark_us is not None:
            m.watermark.set(self.watermark_us / 1e6)
            m.watermark_lag.set(time.time() - self.watermark_us / 1e6)
            self.extra_stats["watermark_us"] = self.watermark_us
        totals = m.totals
        return {
            "records_in": totals[MetricName.RECORDS_IN],
            "records_out": totals[MetricName.RECORDS_OUT],
            "busy": totals[MetricName.BUSY_SECONDS],
            "idle": totals[MetricName.IDLE_SECONDS],
            "backpressured": totals[MetricName.BACKPRESSURED_SECONDS],
            "queue": depth,
            "state_keys": keys,
            "state_bytes": size,
            "invalid": m.invalid_total,
            "latency_buckets": m.latency.bucket_counts(),
            "time": time.time(),
            **{k: list(v) if isinstance(v, deque) else v for k, v in self.extra_stats.items()},
        }

    def _whoami(self) -> InstanceCall:
        """Who a control call speaks for, with the identity that proves it."""
        identity = self.identity.to_json() if self.identity is not None else None
        return InstanceCall(stage=self.stage, index=self.index, identity=identity)

    def report(
        self,
        finished: bool = False,
        error: str | None = None,
        events: list[Event] | None = None,
    ) -> None:
        self._reports += 1
        group_hits = None
        if self.group_hits is not None and self._reports % GROUP_REPORT_EVERY == 0:
            hits = self.group_hits().copy()  # the stage thread updates it meanwhile
            nonzero = np.flatnonzero(hits)
            group_hits = dict(zip(map(str, nonzero.tolist()), hits[nonzero].tolist(), strict=True))
        report = ReportRequest(
            stage=self.stage,
            index=self.index,
            identity=self._whoami().identity,
            stats=self.stats(),
            metrics_address=self.metrics_address,
            group_hits=group_hits,
            events=events or [],
            finished=finished,
            error=error or None,
        )
        self.control.call("Report", report.wire())

    def report_periodically(self) -> None:
        while not self.stop.wait(REPORT_INTERVAL):
            try:
                self.report()
            except TransportError:
                pass  # a lost coordinator is noticed by the command stream, which stops us
            except Exception:
                # The reports are the coordinator's heartbeat: a bug in gathering them must not
                # silence a healthy instance into being taken as lost.
                log.exception("report failed; the next one follows")

    def close_outlets(self) -> None:
        for outlet in self._outlets:
            outlet.abort()
