"""The `keyshift` command line: `keyshift run JOB.yaml` runs a job on this machine.

Entry point of the console script. Bad arguments and bad job files get a one-paragraph error
and exit code 2 before anything starts; a run that fails exits 1.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rich.console import Console

from keyshift.operator.live_view import LiveView, final_report
from keyshift.operator.local_host import LocalJob, RunError, interrupt_flag, run_job
from keyshift.runtime.job import JobError, load_job
from keyshift.runtime.lifecycle import allow_user_code


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
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
    return parser


def cmd_run(args: argparse.Namespace, console: Console) -> int:
    try:
        spec = load_job(args.job)
    except JobError as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False)
        return 2
    started = time.monotonic()
    view = LiveView(console, enabled=not args.no_view)
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
            console.print(
                f"job {spec.name}: coordinator at {job.address}, logs in {job.log_dir}",
                highlight=False,
            )
            with view:
                result = run_job(
                    job, args.duration, interrupted, lambda s: view.update(s, time.monotonic())
                )
    except RunError as exc:
        console.print(f"[bold red]error:[/] {exc}", highlight=False)
        return 1
    console.print(
        final_report(result.status, view.tracker, time.monotonic() - started), highlight=False
    )
    if result.interrupted:
        console.print("stopped by Ctrl-C; the job drained cleanly", highlight=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Job files name user functions as module:function relative to where the user runs us; the
    # processes we start resolve them the same way (keyshift.runtime.lifecycle).
    allow_user_code()
    console = Console()
    if args.command == "run":
        return cmd_run(args, console)
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
