"""A stage instance process: registers with the coordinator, follows its commands, and runs
its stage's loop (source, keyed or sink) with metrics and periodic reports.

Started by a host as `python -m keyshift.runtime.instance --coordinator ADDR --stage S --index I`.
The stage loops live in `source_stage`, `keyed_stage` and `sink_stage`; this module builds the
`InstanceContext` (`keyshift.runtime.stage_context`) they are given, imports only its own
stage's loop, and serves the migration fetches the keyed loop answers.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import signal
import sys
import threading
from typing import Any

import grpc

from keyshift.runtime.auth import AuthError, Security
from keyshift.runtime.checkpoint_store import CheckpointError
from keyshift.runtime.checkpointing import open_store
from keyshift.runtime.identity import Identity, Issuer
from keyshift.runtime.job import MAX_PARALLELISM, local_recovery, parse_job
from keyshift.runtime.lifecycle import allow_user_code, die_with_parent
from keyshift.runtime.metrics import serve_idle
from keyshift.runtime.protocol import (
    FetchBody,
    ProtocolError,
    RegisterReply,
    RegisterRequest,
    Rewound,
    StandbyAssignment,
    StandbyRequest,
    parse,
)
from keyshift.runtime.stage_context import (
    MIGRATE_SERVICE,
    FetchRequest,
    InstanceContext,
    Rewinding,
    Stopped,
)
from keyshift.runtime.transport import (
    Inbox,
    JsonClient,
    PortInUseError,
    TransportError,
    start_server,
)

log = logging.getLogger("keyshift.instance")
COORDINATOR_SERVICE = "keyshift.Coordinator"
FETCH_TIMEOUT = 30.0
# An instance starts its server before it learns the job's shape (its Register call carries the
# server's address), so the server is sized for the widest job: a data stream from every
# instance of the stage upstream and from every keyed peer (a rescale's moves), a state fetch
# from every peer, and a few more.
MAX_CALLS = 3 * MAX_PARALLELISM + 16
# Seconds a survivor whose data stream broke waits to be told to rewind (a local recovery)
# before it exits as lost; the coordinator notices a dead peer within a second.
REWIND_WAIT = 5.0


def migrate_handler(ctx_holder: list[InstanceContext]) -> grpc.GenericRpcHandler[Any, Any]:
    """Fetch calls are queued for the stage loop, which alone touches the state."""

    def fetch(request: bytes, context: grpc.ServicerContext) -> bytes:
        ctx = ctx_holder[0] if ctx_holder else None
        if ctx is None or not ctx.fetch_served.is_set():
            context.abort(grpc.StatusCode.UNAVAILABLE, "this instance serves no keyed state")
            raise AssertionError("unreachable")
        try:
            item = FetchRequest(parse(FetchBody, json.loads(request)))
        except (ValueError, ProtocolError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"fetch refused: {exc}")
            raise AssertionError("unreachable") from None
        ctx.fetches.put(item)
        if not item.done.wait(FETCH_TIMEOUT) and item.cancel():
            # Nothing was handed over: the new owner may ask again.
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "fetch not served in time")
        item.done.wait()  # the loop took it just now: its reply is moments away
        return item.reply

    return grpc.method_handlers_generic_handler(
        MIGRATE_SERVICE, {"Fetch": grpc.unary_unary_rpc_method_handler(fetch)}
    )


def run_stage(ctx: InstanceContext) -> None:
    # Only this instance's stage is imported: the others' modules (the output log's Parquet and
    # JSON writers, the ingest endpoint, ...) would cost every instance memory and start time.
    spec = ctx.spec
    modules = {step.stage.name: "source_stage" for step in spec.source_steps()}
    modules |= {sink.name: "sink_stage" for sink in spec.sinks()}
    module = modules.get(ctx.stage, "keyed_stage")
    stage = importlib.import_module(f"keyshift.runtime.{module}")
    try:
        stage.run(ctx)
    finally:
        ctx.close_logs()


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


def wait_as_standby(control: JsonClient, stage: str, pinned: int | None) -> int | None:
    """Wait, started and connected, until a scale-out gives this process an index (`pinned`,
    if set: the only one it may take); None: the job stopped first. TransportError when the
    coordinator goes away."""
    request = StandbyRequest(stage=stage, pid=os.getpid(), index=pinned)
    for body in control.stream("Standby", request.wire()):
        return parse(StandbyAssignment, body).index
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="keyshift-instance")
    parser.add_argument("--coordinator", required=True, help="host:port of the job's coordinator")
    parser.add_argument("--stage", required=True)
    parser.add_argument(
        "--index",
        type=_index,
        help="this instance's index, or 'hostname' for a StatefulSet pod's ordinal (name-N)",
    )
    parser.add_argument(
        "--standby",
        action="store_true",
        help="start as a standby of the stage: wait for a scale-out to give it an index (with "
        "--index, only that one: at once if the stage wants it already)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=0, help="data port (0: any free port)")
    parser.add_argument("--metrics-port", type=int, default=0)
    parser.add_argument("--connect-timeout", type=float, default=15.0)
    args = parser.parse_args(argv)
    if args.index is None and not args.standby:
        parser.error("one of --index or --standby is required")
    die_with_parent()
    allow_user_code()
    name = f"{args.stage}/{'standby' if args.standby else args.index}"
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
        if args.standby:
            # A fixed metrics port is a pod's, whose probes must find it alive while it waits.
            idle = serve_idle(args.host, args.metrics_port) if args.metrics_port else None
            try:
                args.index = wait_as_standby(control, args.stage, args.index)
            finally:
                if idle is not None:
                    idle()  # the instance's own metrics take the port
            if args.index is None:
                return 0  # the job stopped before a scale-out needed this standby
            name = f"{args.stage}/{args.index}"
            log.info("standby taken as %s", name)
        # The spec comes from the coordinator, so every process runs the same definition.
        request = RegisterRequest(
            stage=args.stage, index=args.index, data_address=f"{args.host}:{port}", pid=os.getpid()
        )
        reply = parse(RegisterReply, control.call("Register", request.wire()))
    except (PortInUseError, TransportError, AuthError, ProtocolError) as exc:
        print(f"instance {name}: {exc}", file=sys.stderr)
        return 1
    spec = parse_job(reply.job, origin="from the coordinator")
    identity = Identity.from_json(reply.identity)
    if identity is None:
        print(f"instance {name}: the coordinator issued no identity", file=sys.stderr)
        server.stop(grace=0)
        return 1
    # Without a secret (insecure) there is no key to check a sender's identity with.
    senders = Issuer(spec.name, security.secret) if security.secret is not None else None
    inbox.open(spec.batching.credits, senders, reply.generation)
    ctx = InstanceContext(spec, args.stage, args.index, control, inbox, security, identity)
    ctx.host = args.host
    ctx.generation = reply.generation
    if reply.restore is not None and spec.checkpoints is not None:
        try:
            ctx.restore = open_store(spec.checkpoints).load(reply.restore)
        except CheckpointError as exc:
            print(f"instance {name}: cannot read checkpoint {reply.restore}: {exc}",
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
    code = run_generations(ctx)
    ctx.stop.set()
    ctx.close_outlets()
    server.stop(grace=0.5)
    return code


def run_generations(ctx: InstanceContext) -> int:
    """Run the stage loop, and again from a checkpoint each time the coordinator rewinds the
    job (a local recovery); the process's exit code."""
    name = ctx.name
    while True:
        try:
            run_stage(ctx)
            ctx.report(finished=True)
            return 0
        except Rewinding:
            pass
        except Stopped as exc:
            if ctx.fatal:
                print(f"instance {name}: {exc}", file=sys.stderr)
            return 1 if ctx.fatal else 0
        except TransportError as exc:
            # A broken data stream is mostly a peer lost: the coordinator may rewind the job
            # in place rather than restart it, and says so at once.
            if not (local_recovery(ctx.spec) and ctx.await_rewind(REWIND_WAIT)):
                print(f"instance {name}: {exc}", file=sys.stderr)
                return 1
        except Exception as exc:
            log.exception("instance %s failed", name)
            with contextlib.suppress(TransportError):
                ctx.report(error=f"{type(exc).__name__}: {exc}")
            return 1
        if not rewind(ctx):
            return 1


def rewind(ctx: InstanceContext) -> bool:
    """Go on from the checkpoint of the rewind told, once the loop has ended; False when it
    cannot be read or the coordinator is gone (the instance exits: a global restart follows)."""
    assert ctx.rewind is not None and ctx.spec.checkpoints is not None
    checkpoint = ctx.rewind.checkpoint
    try:
        restore = open_store(ctx.spec.checkpoints).load(checkpoint)
        generation = ctx.begin_generation(restore)
        ctx.emit(Rewound(generation=generation))
    except (CheckpointError, TransportError) as exc:
        print(f"instance {ctx.name}: cannot rewind to checkpoint {checkpoint}: {exc}",
              file=sys.stderr)  # fmt: skip
        return False
    log.info("rewound to checkpoint %d (generation %d)", checkpoint, generation)
    return True


if __name__ == "__main__":
    sys.exit(main())
