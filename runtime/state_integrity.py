"""Authentication of state that leaves a process: migration chunks and checkpoint files.

Keyed state travels between instances (pushed chunks, on-demand fetch replies) and through
checkpoint storage, and a process-function's state may hold values only pickle can carry. A
pickle runs code when it is loaded, so state is only ever decoded from bytes whose HMAC, under a
key derived from the job's secret (`keyshift.runtime.job_secret`), checks out: a peer that
reaches an instance's port, or anyone who can write the checkpoint bucket, cannot forge it.
A job run without a secret (an explicit insecure run) seals nothing and may hold plain values
only (`keyshift.runtime.state_values`). Used by the migration protocol, the checkpoint store
and the keyed stage.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping

from keyshift.runtime.job_secret import derive_key, load_job_secret

TAG_BYTES = hashlib.sha256().digest_size
PURPOSE = "state-mac"


class StateIntegrityError(ValueError):
    """State bytes whose HMAC is missing or does not match: forged, corrupt or foreign."""


class StateSeal:
    """Signs and checks state bytes with the job's state key (a no-op without a secret)."""

    def __init__(self, key: bytes | None) -> None:
        self._key = key

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> StateSeal:
        secret = load_job_secret(environ)
        return cls(derive_key(secret, PURPOSE) if secret is not None else None)

    @property
    def authenticated(self) -> bool:
        """True when every sealed payload is checked, so what it holds may be trusted."""
        return self._key is not None

    def mac(self, data: bytes | memoryview) -> str | None:
        """The hex HMAC of `data`, or None without a key."""
        if self._key is None:
            return None
        return hmac.new(self._key, data, hashlib.sha256).hexdigest()

    def check_mac(self, data: bytes | memoryview, mac: str | None, what: str) -> None:
        """Raise unless `mac` is the HMAC of `data` (nothing to check without a key)."""
        if self._key is None:
            return
        if mac is None:
            raise StateIntegrityError(f"{what} is not signed with this job's key")
        if not hmac.compare_digest(self.mac(data) or "", mac):
            raise StateIntegrityError(f"{what} does not match its signature")

    def seal(self, payload: bytes) -> bytes:
        """`payload` with its HMAC appended (unchanged without a key)."""
        if self._key is None:
            return payload
        return payload + hmac.new(self._key, payload, hashlib.sha256).digest()

    def open(self, sealed: bytes | memoryview, what: str) -> memoryview:
        """The payload of a sealed message, once its HMAC checks out."""
        view = memoryview(sealed)
        if self._key is None:
            return view
        if len(view) < TAG_BYTES:
            raise StateIntegrityError(f"{what} is too short to carry a signature")
        payload, tag = view[:-TAG_BYTES], view[-TAG_BYTES:]
        expected = hmac.new(self._key, payload, hashlib.sha256).digest()
        if not hmac.compare_digest(expected, tag.tobytes()):
            raise StateIntegrityError(f"{what} does not match its signature")
        return payload
