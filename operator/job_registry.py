"""Where `keyshift run` records its running jobs, so `keyshift rescale JOB` and
`keyshift status JOB` find a job's coordinator by name.

One JSON file per job under $KEYSHIFT_HOME/jobs (default ~/.keyshift/jobs), written when a run
starts and removed when it ends; a record whose host process is gone is stale and ignored.
Used by `keyshift.operator.cli`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class RegistryError(RuntimeError):
    """A job that is not running here, or already is."""


def registry_dir() -> Path:
    return Path(os.environ.get("KEYSHIFT_HOME", Path.home() / ".keyshift")) / "jobs"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lookup(job: str) -> dict[str, Any] | None:
    path = registry_dir() / f"{job}.json"
    try:
        record: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not _alive(int(record.get("pid", -1))):
        path.unlink(missing_ok=True)
        return None
    return record


def register(job: str, coordinator: str, log_dir: Path) -> Path:
    """Record a running job; refuse when a live run of the same job is recorded."""
    existing = lookup(job)
    if existing is not None and existing["pid"] != os.getpid():
        raise RegistryError(
            f"job {job} is already running (keyshift run, pid {existing['pid']}, "
            f"coordinator {existing['coordinator']})"
        )
    directory = registry_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{job}.json"
    tmp = path.with_suffix(".tmp")
    record = {"coordinator": coordinator, "pid": os.getpid(), "log_dir": str(log_dir)}
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)
    return path


def resolve(job: str) -> str:
    """A job name, or a coordinator's host:port, to the coordinator's address."""
    record = lookup(job)
    if record is not None:
        return str(record["coordinator"])
    host, sep, port = job.rpartition(":")
    if sep and host and port.isdigit():
        return job
    raise RegistryError(
        f"no running job named {job!r} on this machine (looked in {registry_dir()}); "
        "start it with `keyshift run`, or give the coordinator as HOST:PORT"
    )
