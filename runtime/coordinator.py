"""The coordinator: one per job. Holds the graph and the keyed stage's assignment (by epoch),
registers instances, publishes the topology, drives draining, and reports status over gRPC.

Started as a process by a host (`python -m keyshift.runtime.coordinator`); instances and the
host's client talk to it through the JSON control service `keyshift.Coordinator`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from keyshift.runtime.job import JobError, JobSpec, load_job
from keyshift.runtime.keyspace import Assignment
from keyshift.runtime.lifecycle import allow_user_code, die_with_parent
from keyshift.runtime.metrics import CoordinatorMetrics
from keyshift.runtime.transport import ControlError, PortInUseError, json_handler, start_server

log = logging.getLogger("keyshift.coordinator")
SERVICE = "keyshift.Coordinator"


@dataclass
class InstanceRecord:
    stage: str
    index: int
    data_address: str
    metrics_address: str
    pid: int
    commands: queue.Queue[dict[str, Any] | None] = field(default_factory=queue.Queue)
    stats: dict[str, Any] = field(default_factory=dict)
    finished: bool = False
    watching: bool = False

    @property
    def name(self) -> str:
        return f"{self.stage}/{self.index}"


class Coordinator:
    """The job's control state; every method is called from gRPC threads under one lock."""

    def __init__(self, spec: JobSpec, register_timeout: float) -> None:
        self.spec = spec
        self.register_timeout = register_timeout
        self.started = time.time()
        self._phase = "starting"
        self.errors: list[str] = []
        self.assignment = Assignment.contiguous(spec.max_key_groups, spec.keyed.parallelism)
        self.instances: dict[tuple[str, int], InstanceRecord] = {}
        self._drain_requested = False
        self._lock = threading.RLock()
        self.stopped = threading.Event()
        self.metrics = CoordinatorMetrics(spec.name)
        self.metrics.set_phase(self._phase)
        for stage in spec.stages():
            self.metrics.set_parallelism(stage.name, stage.parallelism)

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        self._phase = value
        self.metrics.set_phase(value)

    # -- helpers -------------------------------------------------------------------------

    def _expected(self) -> list[tuple[str, int]]:
        return [(s.name, i) for s in self.spec.stages() for i in range(s.parallelism)]

    def _fail(self, message: str) -> None:
        if message not in self.errors:
            log.error("%s", message)
            self.errors.append(message)
        self.phase = "failed"
        for record in self.instances.values():
            record.commands.put({"type": "stop", "reason": message})

    def _topology(self) -> dict[str, Any]:
        stages: dict[str, list[str]] = {}
        for stage in self.spec.stages():
            stages[stage.name] = [
                self.instances[(stage.name, i)].data_address for i in range(stage.parallelism)
            ]
        return {"type": "topology", "stages": stages, "assignment": self.assignment.to_json()}

    # -- RPCs ----------------------------------------------------------------------------

    def register(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            key = (str(body.get("stage")), int(body.get("index", -1)))
            if key not in self._expected():
                raise ControlError(
                    f"no instance {key[0]}/{key[1]} in job {self.spec.name}",
                    grpc.StatusCode.NOT_FOUND,
                )
            if key in self.instances:
                raise ControlError(f"instance {key[0]}/{key[1]} is already registered")
            if self.phase not in ("starting",):
                raise ControlError(f"job is {self.phase}; registration closed")
            self.instances[key] = InstanceRecord(
                stage=key[0],
                index=key[1],
                data_address=str(body["data_address"]),
                metrics_address=str(body["metrics_address"]),
                pid=int(body.get("pid", 0)),
            )
            log.info("registered %s/%s at %s", key[0], key[1], body["data_address"])
            if len(self.instances) == len(self._expected()):
                self.phase = "running"
                topology = self._topology()
                for record in self.instances.values():
                    record.commands.put(topology)
                if self._drain_requested:
                    self._start_draining()
            return {"job": self.spec.model_dump(mode="json")}

    def watch(self, body: dict[str, Any], context: grpc.ServicerContext) -> Any:
        with self._lock:
            record = self.instances.get((str(body.get("stage")), int(body.get("index", -1))))
            if record is None:
                raise ControlError("watch before register", grpc.StatusCode.FAILED_PRECONDITION)
            record.watching = True
        try:
            while context.is_active():
                try:
                    command = record.commands.get(timeout=0.5)
                except queue.Empty:
                    continue
                if command is None:
                    return
                yield command
        finally:
            with self._lock:
                record.watching = False
                if not record.finished and self.phase not in ("failed", "stopping"):
                    self._fail(
                        f"instance {record.name} (pid {record.pid}) was lost: "
                        "its process died or stopped answering"
                    )

    def report(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            record = self.instances.get((str(body.get("stage")), int(body.get("index", -1))))
            if record is None:
                raise ControlError("report before register", grpc.StatusCode.FAILED_PRECONDITION)
            record.stats = dict(body.get("stats", {}))
            if body.get("metrics_address"):
                record.metrics_address = str(body["metrics_address"])
            if body.get("error"):
                self._fail(f"instance {record.name} failed: {body['error']}")
            if body.get("finished"):
                record.finished = True
                if all(r.finished for r in self.instances.values()) and len(self.instances) == len(
                    self._expected()
                ):
                    self.phase = "finished"
            return {}

    def _start_draining(self) -> None:
        self.phase = "draining"
        for i in range(self.spec.source.parallelism):
            self.instances[(self.spec.source.name, i)].commands.put({"type": "drain"})

    def drain(self, body: dict[str, Any]) -> dict[str, Any]:
        """Stop the sources; the rest of the job finishes what is in flight, then ends."""
        with self._lock:
            if self.phase == "running":
                self._start_draining()
            elif self.phase == "starting":
                # Honoured as soon as every instance has registered and knows the topology.
                self._drain_requested = True
            return {"phase": self.phase}

    def status(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            stages = []
            for stage in self.spec.stages():
                instances = []
                for i in range(stage.parallelism):
                    record = self.instances.get((stage.name, i))
                    instances.append(
                        {
                            "index": i,
                            "registered": record is not None,
                            "address": record.data_address if record else None,
                            "metrics": record.metrics_address if record else None,
                            "pid": record.pid if record else None,
                            "finished": record.finished if record else False,
                            "stats": record.stats if record else {},
                        }
                    )
                stages.append(
                    {"name": stage.name, "parallelism": stage.parallelism, "instances": instances}
                )
            return {
                "job": self.spec.name,
                "phase": self.phase,
                "errors": list(self.errors),
                "epoch": self.assignment.epoch,
                "uptime": time.time() - self.started,
                "stages": stages,
            }

    def shutdown(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self.phase != "failed":
                self.phase = "stopping" if self.phase != "finished" else "finished"
            for record in self.instances.values():
                record.commands.put({"type": "stop", "reason": "shutdown"})
                record.commands.put(None)
        self.stopped.set()
        return {}

    def check_registration(self) -> None:
        with self._lock:
            if self.phase != "starting":
                return
            if time.time() - self.started < self.register_timeout:
                return
            missing = [f"{s}/{i}" for s, i in self._expected() if (s, i) not in self.instances]
            self._fail(
                f"instances {', '.join(missing)} did not register within "
                f"{self.register_timeout:.0f} s"
            )

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        return json_handler(
            SERVICE,
            {
                "Register": self.register,
                "Report": self.report,
                "Drain": self.drain,
                "Status": self.status,
                "Shutdown": self.shutdown,
            },
            {"Watch": self.watch},
        )


def _write_ready(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="keyshift-coordinator")
    parser.add_argument("--job", required=True, help="job YAML file")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--metrics-port", type=int, default=0)
    parser.add_argument("--ready-file", type=Path, help="where to write the bound ports as JSON")
    parser.add_argument("--register-timeout", type=float, default=30.0)
    args = parser.parse_args(argv)
    die_with_parent()
    allow_user_code()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        spec = load_job(args.job)
    except JobError as exc:
        print(exc, file=sys.stderr)
        return 2
    coordinator = Coordinator(spec, args.register_timeout)
    try:
        server, port = start_server(f"{args.host}:{args.port}", [coordinator.handler()])
        metrics_port = coordinator.metrics.serve(args.host, args.metrics_port)
    except (PortInUseError, OSError) as exc:
        print(f"coordinator: {exc}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: coordinator.stopped.set())
    log.info("coordinator of job %s listening on %s:%d", spec.name, args.host, port)
    if args.ready_file:
        _write_ready(
            args.ready_file, {"port": port, "metrics_port": metrics_port, "pid": os.getpid()}
        )
    while not coordinator.stopped.wait(0.2):
        coordinator.check_registration()
    server.stop(grace=1.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
