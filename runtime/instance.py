"""A stage instance process: registers with the coordinator, follows its commands, and runs
its stage's loop (source, keyed or sink) with metrics and periodic reports.

Started by a host as `python -m keyshift.runtime.instance --coordinator ADDR --stage S --index I`.
The stage loops live in `source_stage`, `keyed_stage` and `sink_stage`; this module gives them
an `InstanceContext` with everything that is not the stage's own logic.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from keyshift.runtime.job import JobSpec, parse_job
from keyshift.runtime.keyspace import Assignment
from keyshift.runtime.lifecycle import allow_user_code, die_with_parent
from keyshift.runtime.metrics import InstanceMetrics, MetricName
from keyshift.runtime.transport import (
    Inbox,
    JsonClient,
    Outlet,
    PortInUseError,
    TransportError,
    start_server,
)

log = logging.getLogger("keyshift.instance")
COORDINATOR_SERVICE = "keyshift.Coordinator"
REPORT_INTERVAL = 0.5
SAMPLE_LOG_INTERVAL = 10.0


class Stopped(Exception):
    """The instance was told to stop, or lost its coordinator."""


class InstanceContext:
    """What every stage loop uses: spec, metrics, inbox, outlets, commands, time accounting."""

    def __init__(self, spec: JobSpec, stage: str, index: int, control: JsonClient, inbox: Inbox):
        self.spec = spec
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
        self._sampled: dict[str, float] = {}
        self._outlets: list[Outlet] = []
        self.metrics_address = ""

    # -- commands ------------------------------------------------------------------------

    def follow_commands(self) -> None:
        try:
            for command in self.control.stream("Watch", {"stage": self.stage, "index": self.index}):
                kind = command.get("type")
                if kind == "topology":
                    self.topology = command
                    self.topology_ready.set()
                elif kind == "drain":
                    self.drain.set()
                elif kind == "stop":
                    log.info("told to stop: %s", command.get("reason"))
                    self.stop.set()
                    return
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

    def connect(self, stage: str) -> list[Outlet]:
        addresses = self.wait_topology()["stages"][stage]
        outlets = [Outlet(address, self.name) for address in addresses]
        self._outlets.extend(outlets)
        self.metrics.parallelism.set(self.stage_parallelism())
        return outlets

    def stage_parallelism(self) -> int:
        return len(self.wait_topology()["stages"][self.stage])

    def upstream_count(self, stage: str) -> int:
        return len(self.wait_topology()["stages"][stage])

    # -- accounting ----------------------------------------------------------------------

    def send(self, outlet: Outlet, payload: bytes) -> None:
        while True:
            try:
                waited = outlet.send(payload, deadline=time.monotonic() + 1.0)
                self.metrics.count(MetricName.BACKPRESSURED_SECONDS, waited)
                return
            except TransportError as exc:
                if "deadline" not in str(exc):
                    raise
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
            **self.extra_stats,
        }

    def report(self, finished: bool = False, error: str | None = None) -> None:
        body = {
            "stage": self.stage,
            "index": self.index,
            "stats": self.stats(),
            "metrics_address": self.metrics_address,
        }
        if finished:
            body["finished"] = True
        if error:
            body["error"] = error
        self.control.call("Report", body)

    def report_periodically(self) -> None:
        while not self.stop.wait(REPORT_INTERVAL):
            # A lost coordinator is noticed by the command stream, which stops the instance.
            with contextlib.suppress(TransportError):
                self.report()

    def close_outlets(self) -> None:
        for outlet in self._outlets:
            outlet.abort()


def run_stage(ctx: InstanceContext) -> None:
    from keyshift.runtime import keyed_stage, sink_stage, source_stage

    spec = ctx.spec
    runner = {
        spec.source.name: source_stage.run,
        spec.keyed.name: keyed_stage.run,
        spec.sink.name: sink_stage.run,
    }[ctx.stage]
    runner(ctx)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="keyshift-instance")
    parser.add_argument("--coordinator", required=True, help="host:port of the job's coordinator")
    parser.add_argument("--stage", required=True)
    parser.add_argument("--index", type=int, required=True)
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
    control = JsonClient(args.coordinator, COORDINATOR_SERVICE)
    try:
        control.wait_ready(args.connect_timeout)
    except TransportError as exc:
        print(
            f"instance {name}: coordinator {args.coordinator} not reachable: {exc}", file=sys.stderr
        )
        return 1
    inbox = Inbox()
    try:
        server, port = start_server(f"{args.host}:{args.port}", [inbox.handler()])
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
    except (PortInUseError, TransportError) as exc:
        print(f"instance {name}: {exc}", file=sys.stderr)
        return 1
    spec = parse_job(reply["job"], origin="from the coordinator")
    inbox.open(spec.batching.credits)
    ctx = InstanceContext(spec, args.stage, args.index, control, inbox)
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
