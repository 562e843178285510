"""The job's shared secret, read from the environment in one place.

Every process of a job (coordinator, stage instances, ingest endpoints, the PySpark writer and
reader) gets the same secret in `KEYSHIFT_JOB_SECRET`: the local host generates one per run
(`new_job_secret`), and on Kubernetes the operator keeps it in a Secret owned by the
StreamingJob and mounts it into every pod. Callers never use the raw secret twice for different
ends: `derive_key` gives each purpose (the token gRPC calls present, the key that signs state
chunks and checkpoint shards) its own key, so a leaked token cannot forge state.
Called by the transport, the state codecs, the hosts and the Spark connectors.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping

SECRET_ENV = "KEYSHIFT_JOB_SECRET"
# The shortest secret accepted: 32 bytes of entropy encoded urlsafe is 43 characters.
MIN_SECRET_CHARS = 32


class JobSecretError(ValueError):
    """The job's secret is missing where one is required, or too short to be one."""


def new_job_secret() -> str:
    """A fresh random secret for one job (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def load_job_secret(environ: Mapping[str, str] = os.environ) -> bytes | None:
    """The secret this process was started with, or None when the job runs without one."""
    value = environ.get(SECRET_ENV, "").strip()
    if not value:
        return None
    if len(value) < MIN_SECRET_CHARS:
        raise JobSecretError(
            f"{SECRET_ENV} is {len(value)} characters long; a job secret has at least "
            f"{MIN_SECRET_CHARS} (generate one with `keyshift.runtime.job_secret.new_job_secret`)"
        )
    return value.encode()


def derive_key(secret: bytes, purpose: str) -> bytes:
    """A key for one purpose ("grpc-token", "state-mac", ...) derived from the job's secret."""
    return hmac.new(secret, b"keyshift/" + purpose.encode(), hashlib.sha256).digest()
