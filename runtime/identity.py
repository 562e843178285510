"""Per-instance identities: the credential the coordinator issues an instance at registration.

A credential is an HMAC, under a key derived from the job's secret, of (job, stage, index,
incarnation), where the incarnation is fresh at every registration. Only the registrant gets it
(in its Register reply); it presents it on its reports and its command stream (the coordinator
compares it with the one it issued) and in the hello that opens each of its data streams (the
receiver recomputes it: every process of the job holds the secret). So a peer that got past the
call token, or an instance speaking for another, cannot report instances finished, watch another
instance's commands, or send (and end) data in another instance's name.
Used by the coordinator, the stage instances and the data transport.
"""

from __future__ import annotations

import hmac
import secrets
from dataclasses import dataclass
from typing import Any

from keyshift.runtime.job_secret import derive_key


@dataclass(frozen=True)
class Identity:
    """What an instance was issued and presents: its incarnation and the credential."""

    incarnation: str
    credential: str

    def to_json(self) -> dict[str, str]:
        return {"incarnation": self.incarnation, "credential": self.credential}

    @classmethod
    def from_json(cls, body: Any) -> Identity | None:
        """The identity in a message, or None when it has none or a malformed one."""
        if not isinstance(body, dict):
            return None
        incarnation, credential = body.get("incarnation"), body.get("credential")
        if not isinstance(incarnation, str) or not isinstance(credential, str):
            return None
        return cls(incarnation, credential)


class Issuer:
    """Issues and checks credentials for one job. Without a secret (the insecure opt-out) the
    key is random per process: the coordinator still tells its instances apart, but data
    receivers, which cannot derive that key, do not check senders."""

    def __init__(self, job: str, secret: bytes | None) -> None:
        self.job = job
        self._key = derive_key(secret, "instance-identity") if secret else secrets.token_bytes(32)

    def _credential(self, name: str, incarnation: str) -> str:
        message = "\0".join((self.job, name, incarnation)).encode()
        return hmac.new(self._key, message, "sha256").hexdigest()

    def issue(self, name: str) -> Identity:
        """A new identity for the instance `name` ("stage/index")."""
        incarnation = secrets.token_hex(8)
        return Identity(incarnation, self._credential(name, incarnation))

    def valid(self, name: str, identity: Identity | None) -> bool:
        """Whether `identity` was issued to `name` (any incarnation), in constant time."""
        if identity is None:
            return False
        expected = self._credential(name, identity.incarnation)
        return hmac.compare_digest(expected, identity.credential)
