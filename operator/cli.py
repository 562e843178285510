"""The `keyshift` command line: `keyshift run JOB.yaml` runs a job on this machine; `keyshift
crds` writes the StreamingJob CRD generated from the models and `keyshift dashboards` the Grafana
dashboards built in keyshift.operator.dashboards (both take `--check` for CI).

Entry point of the console script. Bad arguments, bad job files (see keyshift.runtime.job_file
for the limits a job file must keep) and requests the coordinator refuses get a one-paragraph
error and exit code 2 before anything starts; a run or rescale that fails exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from keyshift.operator.autoscaled_job import AutoscaledJob
from keyshift.operator.crd import CRD_DIRS, stale_crds, write_crds
from keyshift.operator.dashboards import DASHBOARD_DIR, stale_dashboards, write_dashboards
from keyshift.operator.job_registry import RegistryError, lookup, register, resolve
from keyshift.operator.live_view import LiveView, final_report
from keyshift.operator.local_host import (
    COORDINATOR_SERVICE,
    LocalJob,
    RunError,
    interrupt_flag,
    run_job,
)
from keyshift.operator.local_scaling import LocalAutoscaler, TargetsFile, local_autoscaler
from keyshift.operator.run_report import Timeline, write_png
from keyshift.policies.settings import AutoscalerSettings
from keyshift.runtime.auth import AuthError, Security
from keyshift.runtime.job import JobError, JobSpec, load_job_as
from keyshift.runtime.job_secret import SECRET_ENV, JobSecretError
from keyshift.runtime.lifecycle import allow_user_code, die_with_parent
from keyshift.runtime.protocol import (
    STRATEGIES,
    RescaleReport,
    RescaleRequest,
    finished_rescales,
    parse,
)
from keyshift.runtime.transport import JsonClient, RequestRefused, TransportError

# Seconds `keyshift rescale` waits for an unreachable coordinator (one restarting in a
# recovery) before it gives the rescale up as lost.
RESCALE_UNREACHABLE_GRACE = 20.0


def _error(console: Console, problem: object) -> None:
    console.print(f"[bold red]error:[/] {problem}", highlight=False)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _parallelism(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"parallelism must be at least 1, got {text}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 0..65535, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="keyshift", description="Stream processing that rescales live."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a job as local processes")
    run.add_argument("job", type=Path, help="job YAML file")
    run.add_argument("--duration", type=_positive, help="seconds to run before draining")
    run.add_argument(
        "--log-dir", type=Path, help="where the processes' logs go (default: a temp dir)"
    )
    run.add_argument(
        "--port", type=_port, default=0, help="coordinator port (default: any free one)"
    )
    run.add_argument("--no-view", action="store_true", help="no live view, only the final report")
    run.add_argument(
        "--register-timeout",
        type=_positive,
        default=30.0,
        help="seconds for all instances to register",
    )
    run.add_argument(
        "--report",
        type=Path,
        help="write a PNG of input rate, parallelism, latency and decisions here at the end",
    )
    run.add_argument(
        "--prometheus-targets",
        type=Path,
        help="keep a Prometheus file_sd list of the job's metrics endpoints in this file",
    )
    rescale = sub.add_parser("rescale", help="change a keyed stage's or a sink's width, live")
    rescale.add_argument("job", help="job name (as run by `keyshift run` here) or HOST:PORT")
    rescale.add_argument("stage", help="a keyed stage, or a sink")
    rescale.add_argument("parallelism", type=_parallelism)
    rescale.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="hot-first",
        help="how state moves (default: hot-first)",
    )
    rescale.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a strategy option, e.g. batch_groups=128 (repeatable)",
    )
    rescale.add_argument("--no-wait", action="store_true", help="return once it has started")
    rescale.add_argument("--timeout", type=_positive, default=600.0, help="seconds to wait")
    status = sub.add_parser("status", help="show a running job's status as JSON")
    status.add_argument("job", help="job name (as run by `keyshift run` here) or HOST:PORT")
    crds = sub.add_parser("crds", help="write the StreamingJob CRD generated from the models")
    crds.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if a CRD file is missing or stale (for CI)",
    )
    crds.add_argument(
        "--out",
        type=Path,
        action="append",
        metavar="DIR",
        help="directory for the CRD file (repeatable; default: crds/ and helm/keyshift/crds/)",
    )
    dashboards = sub.add_parser("dashboards", help="write the Grafana dashboards built in code")
    dashboards.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if a dashboard file is missing or stale (for CI)",
    )
    dashboards.add_argument(
        "--out",
        type=Path,
        default=DASHBOARD_DIR,
        metavar="DIR",
        help=f"directory for the dashboard files (default: {DASHBOARD_DIR}/)",
    )
    operator = sub.add_parser("operator", help="run the Kubernetes operator (kopf)")
    operator.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="watch only this namespace (repeatable; default: the whole cluster)",
    )
    operator.add_argument("--liveness-port", type=_port, default=8080, help="serves /healthz")
    operator.add_argument(
        "--metrics-port", type=_port, default=9100, help="the autoscalers' Prometheus metrics"
    )
    return parser


def _options(pairs: list[str]) -> dict[str, float]:
    options = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        try:
            options[name] = float(value)
        except ValueError:
            raise ValueError(f"--option {pair!r} is not NAME=NUMBER") from None
        if not sep or not name:
            raise ValueError(f"--option {pair!r} is not NAME=NUMBER")
    return options


def job_client(job: str) -> JsonClient:
    """A client of a job run here (its secret from the registry) or at HOST:PORT (its secret
    from KEYSHIFT_JOB_SECRET)."""
    address, secret = resolve(job)
    environ = {**os.environ, SECRET_ENV: secret} if secret else os.environ
    return JsonClient(address, COORDINATOR_SERVICE, Security.from_env(environ))


def describe_rescale(r: RescaleReport) -> str:
    if r.phase == "replaced" or (r.error or "").startswith("not started:"):
        # It never ran: replaced in the queue, or dropped from it.
        return f"rescale {r.id} of {r.stage} -> {r.to_parallelism}: {r.phase}; {r.error}"
    progress = r.progress
    if "partitions_out" in progress or "partitions_in" in progress:
        # A rescale of the sink: whole output partitions moved, no state.
        text = (
            f"rescale {r.id} of {r.stage} {r.from_parallelism}->{r.to_parallelism}: {r.phase} "
            f"after {r.duration:.2f} s; {r.groups_moved}/{r.groups_to_move} output partitions "
            "moved"
        )
        return text + (f"; error: {r.error}" if r.error else "")
    moved = progress.get("keys_in", 0) + progress.get("keys_fetched", 0)
    megabytes = progress.get("bytes_in", 0) / 1e6
    text = (
        f"rescale {r.id} of {r.stage} {r.from_parallelism}->{r.to_parallelism} ({r.strategy}): "
        f"{r.phase} after {r.duration:.2f} s in {r.steps} step(s); "
        f"{r.groups_moved}/{r.groups_to_move} groups, {moved:,.0f} keys, {megabytes:.1f} MB moved; "
        f"{progress.get('keys_fetched', 0):,.0f} keys fetched on demand, "
        f"{progress.get('records_parked', 0):,.0f} records parked, "
        f"{progress.get('records_forwarded', 0):,.0f} forwarded"
    )
    rates = r.mb_per_s
    if rates.get("out") is not None or rates.get("in") is not None:
        shown = {end: "-" if rate is None else f"{rate:.1f}" for end, rate in rates.items()}
        text += f"; state MB/s out {shown.get('out', '-')}, in {shown.get('in', '-')}"
    return text + (f"; error: {r.error}" if r.error else "")


def rescale_accepted(r: RescaleReport) -> str:
    """The answer to `keyshift rescale`: the request's id and whether it runs or waits."""
    state = "queued" if r.phase == "queued" else "started"
    text = f"{state} rescale {r.id}: {r.stage} -> {r.to_parallelism}"
    if r.phase == "queued":
        text += " (it starts when the rescales before it end: see `keyshift status`)"
    if r.replaced is not None:
        text += f"; it replaces queued rescale {r.replaced} of {r.stage}"
    return text


def cmd_rescale(args: argparse.Namespace, console: Console) -> int:
    try:
        request = parse(
            RescaleRequest,
            {"stage": args.stage, "parallelism": args.parallelism,
             "strategy": args.strategy, "options": _options(args.option)},
        )  # fmt: skip
        client = job_client(args.job)
        started = parse(RescaleReport, client.call("Rescale", request.wire()))
    except (ValueError, RegistryError, RequestRefused) as exc:
        _error(console, exc)
        return 2
    except TransportError as exc:
        _error(console, exc)
        return 1
    console.print(rescale_accepted(started), highlight=False)
    if args.no_wait:
        return 0
    deadline = time.monotonic() + args.timeout
    unreachable_since: float | None = None
    while time.monotonic() < deadline:
        try:
            status = client.call("Status")
        except TransportError as exc:
            # A recovering job's coordinator is gone for a few seconds; a job that is gone
            # for good stays unreachable.
            unreachable_since = unreachable_since or time.monotonic()
            if time.monotonic() - unreachable_since > RESCALE_UNREACHABLE_GRACE:
                _error(console, f"lost the job while rescaling: {exc}")
                return 1
            time.sleep(0.2)
            continue
        unreachable_since = None
        if status.get("incarnation") != started.incarnation:
            # Ids start again at 1 in a restarted coordinator: its rescale of this id is not ours.
            _error(
                console,
                f"the coordinator restarted while rescale {started.id} ran; a restarted job "
                "goes on from its latest checkpoint, without the rescale: see `keyshift status` "
                "and rescale again",
            )
            return 1
        done = next((r for r in finished_rescales(status) if r.id == started.id), None)
        if done is not None:
            console.print(describe_rescale(done), highlight=False, soft_wrap=True)
            return 0 if done.phase == "done" else 1
        time.sleep(0.2)
    _error(console, f"rescale not finished after {args.timeout:.0f} s")
    return 1


def cmd_status(args: argparse.Namespace, console: Console) -> int:
    try:
        status = job_client(args.job).call("Status")
    except (RegistryError, AuthError) as exc:
        _error(console, exc)
        return 2
    except TransportError as exc:
        _error(console, exc)
        return 1
    print(json.dumps(status, indent=2))
    return 0


def _generated(
    console: Console,
    check: bool,
    write: Callable[[], list[Path]],
    stale: Callable[[], list[Path]],
    what: str,
    again: str,
) -> int:
    """Write generated files, or (`--check`, for CI) say which are missing or stale."""
    if not check:
        for path in write():
            console.print(f"wrote {path}", highlight=False)
        return 0
    found = stale()
    if found:
        _error(
            console,
            f"{what} in {', '.join(map(str, found))} missing, stale or no longer generated; "
            f"run `{again}` (and remove files it no longer writes), then commit the result",
        )
        return 1
    console.print(f"{what} current", highlight=False)
    return 0


def cmd_crds(args: argparse.Namespace, console: Console) -> int:
    dirs: list[Path] = args.out or list(CRD_DIRS)
    again = "keyshift crds" + "".join(f" --out {d}" for d in args.out or [])
    return _generated(
        console, args.check, lambda: write_crds(dirs), lambda: stale_crds(dirs),
        "the StreamingJob CRD (from operator/streamingjob.py) is", again,
    )  # fmt: skip


def cmd_dashboards(args: argparse.Namespace, console: Console) -> int:
    again = "keyshift dashboards" + (f" --out {args.out}" if args.out != DASHBOARD_DIR else "")
    return _generated(
        console, args.check, lambda: write_dashboards(args.out),
        lambda: stale_dashboards(args.out),
        "the Grafana dashboards (from operator/dashboards.py) are", again,
    )  # fmt: skip


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    try:
        spec = load_job_as(AutoscaledJob, args.job)
    except JobError as exc:
        _error(console, exc)
        return 2
    running = lookup(spec.name)
    if running is not None:
        _error(
            console,
            f"job {spec.name} is already running here "
            f"(pid {running['pid']}, coordinator {running['coordinator']})",
        )
        return 2
    started = time.monotonic()
    view = LiveView(console, enabled=not args.no_view)
    timeline = Timeline(time.monotonic(), spec.keyed.name)
    try:
        with (
            interrupt_flag() as interrupted,
            LocalJob(
                spec,
                args.job,
                log_dir=args.log_dir,
                coordinator_port=args.port,
                register_timeout=args.register_timeout,
            ) as job,
        ):
            job.start()
            registered = register(spec.name, job.address, job.log_dir, job.env[SECRET_ENV])
            autoscaler = None
            try:
                console.print(
                    f"job {spec.name}: coordinator at {job.address}, logs in {job.log_dir}",
                    highlight=False,
                )
                if spec.autoscaler is not None:
                    autoscaler = start_autoscaler(spec, spec.autoscaler, job, console, view)
                targets = _targets_file(args.prometheus_targets, job, autoscaler)

                def on_status(status: dict[str, Any]) -> None:
                    now = time.monotonic()
                    view.update(status, now)
                    timeline.add(now, status, view.tracker)
                    if targets is not None:
                        targets.update(status)
                    if autoscaler is not None:
                        timeline.decided(now, autoscaler.poll(status))

                with view:
                    result = run_job(job, args.duration, interrupted, on_status)
            finally:
                registered.unlink(missing_ok=True)
                if autoscaler is not None:
                    autoscaler.close()
    except (RegistryError, AuthError, JobSecretError) as exc:
        _error(console, exc)
        return 2
    except RunError as exc:
        _error(console, exc)
        return 1
    console.print(
        final_report(result.status, view.tracker, time.monotonic() - started), highlight=False
    )
    for rescale in finished_rescales(result.status):
        console.print("  " + describe_rescale(rescale), highlight=False, soft_wrap=True)
    for recovery in job.recoveries:
        took = recovery["seconds"]
        console.print(
            f"  recovered from checkpoint {recovery['checkpoint']}"
            + (f" in {took:.2f} s" if took is not None else "")
            + f" ({recovery.get('mode', 'global')})"
            + f" after: {recovery['reason'].splitlines()[0]}",
            highlight=False,
            soft_wrap=True,
        )
    if autoscaler is not None:
        actions = [d for _, d in timeline.decisions]
        console.print(
            f"  autoscaler ({spec.autoscaler.policy if spec.autoscaler else ''}): "
            f"{len(actions)} scaling decision(s); all decisions in {autoscaler.events.path}",
            highlight=False,
        )
    if args.report is not None:
        path = write_png(timeline, args.report, f"keyshift job {spec.name}")
        console.print(f"  report: {path}", highlight=False)
    if result.interrupted:
        console.print("stopped by Ctrl-C; the job drained cleanly", highlight=False)
    return 0


def start_autoscaler(
    spec: JobSpec, settings: AutoscalerSettings, job: LocalJob, console: Console, view: LiveView
) -> LocalAutoscaler:
    """The autoscaling loop for this run; its decisions show in the view and as lines."""
    assert job.client is not None
    autoscaler = local_autoscaler(
        spec,
        settings,
        job.client,
        job,
        job.log_dir,
        lambda line: console.print(line, highlight=False, soft_wrap=True),
        host=job.host,
    )
    scalable = autoscaler.loop.executor.scalable
    view.notes = lambda: [
        f"autoscaler: {d.reason}" for d in autoscaler.events.latest.values() if d.stage in scalable
    ]
    source = settings.prometheus_url or "direct scraping"
    console.print(
        f"autoscaler: {settings.policy} every {settings.interval:g} s over "
        f"{settings.metrics_window:g} s of metrics from {source}"
        + (" (dry run)" if settings.dry_run else ""),
        highlight=False,
    )
    return autoscaler


def _targets_file(
    path: Path | None, job: LocalJob, autoscaler: LocalAutoscaler | None
) -> TargetsFile | None:
    if path is None:
        return None
    extra = [f"{job.host}:{job.coordinator_metrics_port}"]
    if autoscaler is not None:
        extra.append(f"{job.host}:{autoscaler.metrics_port}")
    return TargetsFile(path, extra)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Job files name user functions as module:function relative to where the user runs us; the
    # processes we start resolve them the same way (keyshift.runtime.lifecycle).
    allow_user_code()
    console = Console()
    if args.command == "run":
        # A host that runs jobs itself (a test harness, a supervisor) may ask it as it asks
        # the processes it starts: a run must not outlive it, with its job's processes.
        die_with_parent()
        return cmd_run(args, console)
    if args.command == "rescale":
        return cmd_rescale(args, console)
    if args.command == "status":
        return cmd_status(args, console)
    if args.command == "crds":
        return cmd_crds(args, console)
    if args.command == "dashboards":
        return cmd_dashboards(args, console)
    if args.command == "operator":
        # Imported here: kopf and the Kubernetes client take a second to import, which every
        # other command would pay for nothing.
        from keyshift.operator.k8s_operator import OperatorError, run_operator

        try:
            run_operator(args.namespace, args.liveness_port, args.metrics_port)
        except OperatorError as exc:
            _error(console, exc)
            return 2
        return 0
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
