"""A stage instance process: registers with the coordinator, follows its commands, and runs
its stage's loop (source, keyed or sink) with metrics and periodic reports.

Started by a host as `python -m keyshift.runtime.instance --coordinator ADDR --stage S --index I`.
The stage loops live in `source_stage`, `keyed_stage` and `sink_stage`; this module gives them
an `InstanceContext` with everything that is not the stage's own logic.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from keyshift.runtime.auth import AuthError, Security
from keyshift.runtime.checkpoint_store import CheckpointError, CheckpointMeta
from keyshift.runtime.checkpointing import open_store
from keyshift.runtime.identity import Identity, Issuer
from keyshift.runtime.job import MAX_PARALLELISM, JobSpec, parse_job
from keyshift.runtime.keyspace import Assignment
from keyshift.runtime.lifecycle import allow_user_code, die_with_parent
from keyshift.runtime.metrics import InstanceMetrics, MetricName
from keyshift.runtime.transport import (
    BATCH,
    Inbox,
    JsonClient,
    NoCredit,
    Outlet,
    PortInUseError,
    TransportError,
    start_server,
)

log = logging.getLogger("keyshift.instance")
COORDINATOR_SERVICE = "keyshift.Coordinator"
REPORT_INTERVAL = 0.5
SAMPLE_LOG_INTERVAL = 10.0
GROUP_REPORT_EVERY = 2  # reports; per-group loads feed the coordinator's assignment planner
MIGRATE_SERVICE = "keyshift.Migrate"
FETCH_TIMEOUT = 30.0
# An instance starts its server before it learns the job's shape (its Register call carries the
# server's address), so the server is sized for the widest job: a data stream from every
# instance of the stage upstream and from every keyed peer (a rescale's moves), a state fetch
# from every peer, and a few more.
MAX_CALLS = 3 * MAX_PARALLELISM + 16


@dataclass
class FetchRequest:
    """An on-demand state fetch from a new owner, answered by this instance's stage loop."""

    body: dict[str, Any]
    done: threading.Event = field(default_factory=threading.Event)
    reply: bytes = b""


def migrate_handler(ctx_holder: list[InstanceContext]) -> grpc.GenericRpcHandler[Any, Any]:
    """Fetch calls are queued for the stage loop, which alone touches the state."""

    def fetch(request: bytes, context: grpc.ServicerContext) -> bytes:
        ctx = ctx_holder[0] if ctx_holder else None
        if ctx is None or not ctx.fetch_served.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, "this instance serves no keyed state")
            raise AssertionError("unreachable")
        item = FetchRequest(json.loads(request))
        ctx.fetches.put(item)
        if not item.done.wait(FETCH_TIMEOUT):
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "fetch not served in time")
        return item.reply

    return grpc.method_handlers_generic_handler(
        MIGRATE_SERVICE, {"Fetch": grpc.unary_unary_rpc_method_handler(fetch)}
    )


class Stopped(Exception):
    """The instance was told to stop, or lost its coordinator."""


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
        self.topology: dict[str, Any] | None = None
        self.topology_ready = threading.Event()
        self.drain = threading.Event()
        self.stop = threading.Event()
        self.fatal: str | None = None
        self.extra_stats: dict[str, Any] = {}
        self.state_size: Callable[[], tuple[int, int]] | None = None
        self.group_hits: Callable[[], np.ndarray] | None = None
        self.commands: queue.Queue[dict[str, Any]] = queue.Queue()
        self.fetches: queue.Queue[FetchRequest] = queue.Queue()
        self.fetch_served = threading.Event()  # set by a stage that answers fetches
        self._sampled: dict[str, float] = {}
        self._outlets: list[Outlet] = []
        self._reports = 0
        self.metrics_address = ""
        self.host = "127.0.0.1"  # the address this instance listens on
        self.restore: CheckpointMeta | None = None  # the checkpoint a recovery goes on from

    # -- commands ------------------------------------------------------------------------

    def follow_commands(self) -> None:
        try:
            for command in self.control.stream("Watch", self._whoami()):
                kind = command.get("type")
                if kind == "topology":
                    self.topology = command
                    self.topology_ready.set()
                    self.metrics.parallelism.set(len(command["stages"][self.stage]))
                    self.commands.put(command)
                elif kind == "drain":
                    self.drain.set()
                elif kind == "stop":
                    log.info("told to stop: %s", command.get("reason"))
                    self.stop.set()
                    return
                else:
                    self.commands.put(command)
            if not self.stop.is_set():
                self.fatal = f"coordinator at {self.control.address} closed the command stream"
        except TransportError as exc:
            if not self.stop.is_set():
                self.fatal = f"lost the coordinator: {exc}"
        self.stop.set()

    def check(self) -> None:
        """Raise Stopped when the loop must end now."""
        if self.stop.is_set():
            raise Stopped(self.fatal or "stopped")

    def wait_topology(self) -> dict[str, Any]:
        while not self.topology_ready.wait(0.1):
            self.check()
        assert self.topology is not None
        return self.topology

    def assignment(self) -> Assignment:
        return Assignment.from_json(self.wait_topology()["assignment"])

    def next_command(self) -> dict[str, Any] | None:
        try:
            return self.commands.get_nowait()
        except queue.Empty:
            return None

    def addresses(self, stage: str) -> dict[int, str]:
        """The data addresses of a stage's current instances, by index."""
        return {int(i): a for i, a in self.wait_topology()["stages"][stage].items()}

    def outlet(self, address: str) -> Outlet:
        outlet = Outlet(address, self.name, self.security, self.identity)
        self._outlets.append(outlet)
        return outlet

    def connect(self, stage: str) -> dict[int, Outlet]:
        return {i: self.outlet(a) for i, a in sorted(self.addresses(stage).items())}

    def upstream_names(self, stage: str) -> set[str]:
        return {f"{stage}/{i}" for i in self.addresses(stage)}

    def emit(self, event: dict[str, Any]) -> None:
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

    def stats(self) -> dict[str, Any]:
        m = self.metrics
        keys, size = self.state_size() if self.state_size else (0, 0)
        m.state_keys.set(keys)
        m.state_bytes.set(size)
        depth = self.inbox.depth()
        m.queue_depth.set(depth)
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

    def _whoami(self) -> dict[str, Any]:
        """Who a control call speaks for, with the identity that proves it."""
        body: dict[str, Any] = {"stage": self.stage, "index": self.index}
        if self.identity is not None:
            body["identity"] = self.identity.to_json()
        return body

    def report(
        self,
        finished: bool = False,
        error: str | None = None,
        events: list[dict[str, Any]] | None = None,
    ) -> None:
        body: dict[str, Any] = {
            **self._whoami(),
            "stats": self.stats(),
            "metrics_address": self.metrics_address,
        }
        self._reports += 1
        if self.group_hits is not None and self._reports % GROUP_REPORT_EVERY == 0:
            hits = self.group_hits().copy()  # the stage thread updates it meanwhile
            nonzero = np.flatnonzero(hits)
            body["group_hits"] = dict(
                zip(map(str, nonzero.tolist()), hits[nonzero].tolist(), strict=True)
            )
        if events:
            body["events"] = events
        if finished:
            body["finished"] = True
        if error:
            body["error"] = error
        self.control.call("Report", body)

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


def run_stage(ctx: InstanceContext) -> None:
    # Only this instance's stage is imported: the others' modules (the output log's Parquet and
    # JSON writers, the ingest endpoint, ...) would cost every instance memory and start time.
    spec = ctx.spec
    module = {
        spec.source.name: "source_stage",
        spec.keyed.name: "keyed_stage",
        spec.sink.name: "sink_stage",
    }[ctx.stage]
    stage = importlib.import_module(f"keyshift.runtime.{module}")
    stage.run(ctx)


def _index(text: str) -> int:
    """An index, or the ordinal at the end of $HOSTNAME (a StatefulSet's pod `name-N`)."""
    if text == "hostname":
        host = os.environ.get("HOSTNAME", "")
        ordinal = host.rpartition("-")[2]
        if not ordinal.isdigit():
            raise argparse.ArgumentTypeError(
                f"HOSTNAME {host!r} does not end in -N, so it gives no index"
            )
        return int(ordinal)
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an index nor 'hostname'") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"index must be >= 0, got {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="keyshift-instance")
    parser.add_argument("--coordinator", required=True, help="host:port of the job's coordinator")
    parser.add_argument("--stage", required=True)
    parser.add_argument(
        "--index",
        type=_index,
        required=True,
        help="this instance's index, or 'hostname' for a StatefulSet pod's ordinal (name-N)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=0, help="data port (0: any free port)")
    parser.add_argument("--metrics-port", type=int, default=0)
    parser.add_argument("--connect-timeout", type=float, default=15.0)
    args = parser.parse_args(argv)
    die_with_parent()
    allow_user_code()
    name = f"{args.stage}/{args.index}"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        security = Security.from_env()
    except AuthError as exc:
        print(f"instance {name}: {exc}", file=sys.stderr)
        return 2
    control = JsonClient(args.coordinator, COORDINATOR_SERVICE, security)
    try:
        control.wait_ready(args.connect_timeout)
    except TransportError as exc:
        print(
            f"instance {name}: coordinator {args.coordinator} not reachable: {exc}", file=sys.stderr
        )
        return 1
    inbox = Inbox()
    holder: list[InstanceContext] = []
    try:
        server, port = start_server(
            f"{args.host}:{args.port}",
            [inbox.handler(), migrate_handler(holder)],
            MAX_CALLS,
            security=security,
        )
        # The spec comes from the coordinator, so every process runs the same definition.
        reply = control.call(
            "Register",
            {
                "stage": args.stage,
                "index": args.index,
                "data_address": f"{args.host}:{port}",
                "metrics_address": "",
                "pid": os.getpid(),
            },
        )
    except (PortInUseError, TransportError, AuthError) as exc:
        print(f"instance {name}: {exc}", file=sys.stderr)
        return 1
    spec = parse_job(reply["job"], origin="from the coordinator")
    identity = Identity.from_json(reply.get("identity"))
    if identity is None:
        print(f"instance {name}: the coordinator issued no identity", file=sys.stderr)
        server.stop(grace=0)
        return 1
    # Without a secret (insecure) there is no key to check a sender's identity with.
    senders = Issuer(spec.name, security.secret) if security.secret is not None else None
    inbox.open(spec.batching.credits, senders)
    ctx = InstanceContext(spec, args.stage, args.index, control, inbox, security, identity)
    ctx.host = args.host
    if reply.get("restore") is not None and spec.checkpoints is not None:
        try:
            ctx.restore = open_store(spec.checkpoints).load(int(reply["restore"]))
        except CheckpointError as exc:
            print(f"instance {name}: cannot read checkpoint {reply['restore']}: {exc}",
                  file=sys.stderr)  # fmt: skip
            server.stop(grace=0)
            return 1
    holder.append(ctx)
    try:
        metrics_port = ctx.metrics.serve(args.host, args.metrics_port)
    except OSError as exc:
        print(
            f"instance {name}: cannot serve metrics on port {args.metrics_port}: {exc}",
            file=sys.stderr,
        )
        server.stop(grace=0)
        return 1
    ctx.metrics_address = f"{args.host}:{metrics_port}"
    threading.Thread(target=ctx.follow_commands, name="commands", daemon=True).start()
    threading.Thread(target=ctx.report_periodically, name="reports", daemon=True).start()
    try:
        run_stage(ctx)
        ctx.report(finished=True)
        code = 0
    except Stopped as exc:
        code = 1 if ctx.fatal else 0
        if ctx.fatal:
            print(f"instance {name}: {exc}", file=sys.stderr)
    except TransportError as exc:
        print(f"instance {name}: {exc}", file=sys.stderr)
        code = 1
    except Exception as exc:
        log.exception("instance %s failed", name)
        with contextlib.suppress(TransportError):
            ctx.report(error=f"{type(exc).__name__}: {exc}")
        code = 1
    ctx.stop.set()
    ctx.close_outlets()
    server.stop(grace=0.5)
    return code


if __name__ == "__main__":
    sys.exit(main())
