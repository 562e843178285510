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


def register(job: str, coordinator: str, log_dir: Path, secret: str) -> Path:
    """Record a running job and its secret (readable by this user only, as ~/.ssh keys are);
    refuse when a live run of the same job is recorded."""
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
    record = {
        "coordinator": coordinator,
        "pid": os.getpid(),
        "log_dir": str(log_dir),
        "secret": secret,
    }
    tmp.unlink(missing_ok=True)
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(json.dumps(record))
    os.replace(tmp, path)
    return path


def resolve(job: str) -> tuple[str, str | None]:
    """A job name, or a coordinator's host:port, to the coordinator's address and the job's
    secret (None for an address: the caller's environment has to hold it)."""
    record = lookup(job)
    if record is not None:
        return str(record["coordinator"]), record.get("secret")
    host, sep, port = job.rpartition(":")
    if sep and host and port.isdigit():
        return job, None
    raise RegistryError(
        f"no running job named {job!r} on this machine (looked in {registry_dir()}); "
        "start it with `keyshift run`, or give the coordinator as HOST:PORT"
    )
