"""The backlog an ingest client reports: rows due at the client that it has not pushed yet.

A job sees only what reaches it: while its ingest endpoint pushes back, the rate it observes is
what it manages, not what arrives, and the rows piling up at the clients (a Spark writer's bids
that fell due but are not written yet) are invisible to the autoscaler. So a client may say how
far behind it is with each push: `ClientBacklog` is the push header's optional `backlog` field
(keyshift.runtime.ingest parses it in `unpack_request`; keyshift.runtime.ingest_client sends
it), and `ClientBacklogs` is the endpoint's latest report per client, which the source loop
exports as the source's client-backlog metrics for DS2 (keyshift.policies.ds2).

Wire form, version 1: `{"version": 1, "client": str, "rows": int >= 0, "oldest_seconds":
float >= 0}`: rows due and not yet pushed, this push's own rows not counted, and how long ago
the oldest of them fell due. A header without the field (an older client) reports nothing; a
field that is malformed or of another version refuses the push with a message saying what is
wrong (the client's rows are not taken, and it is told why).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any

BACKLOG_VERSION = 1
# A client's report is forgotten after this many seconds without a new one: a client that died
# or finished must not keep its last backlog in the autoscaler's view. Longer than a Spark
# micro-batch that waits on backpressure (the ingest endpoint's push timeout is 30 s).
BACKLOG_TTL = 60.0


class BadBacklog(ValueError):
    """A `backlog` header field that does not follow the wire form."""


@dataclass(frozen=True)
class ClientBacklog:
    """What one client has not pushed yet (see the module docstring)."""

    client: str  # stable across the client's pushes: a Spark query's id, say
    rows: int
    oldest_seconds: float

    def __post_init__(self) -> None:
        if not self.client:
            raise BadBacklog("backlog 'client' must be a non-empty string")
        if self.rows < 0:
            raise BadBacklog(f"backlog 'rows' must be >= 0, got {self.rows}")
        if not (math.isfinite(self.oldest_seconds) and self.oldest_seconds >= 0):
            raise BadBacklog(
                f"backlog 'oldest_seconds' must be a finite number >= 0, got {self.oldest_seconds}"
            )

    def to_header(self) -> dict[str, Any]:
        return {
            "version": BACKLOG_VERSION,
            "client": self.client,
            "rows": self.rows,
            "oldest_seconds": self.oldest_seconds,
        }

    @classmethod
    def from_header(cls, value: Any) -> ClientBacklog:
        """The header field parsed; BadBacklog saying what is wrong."""
        if not isinstance(value, dict):
            raise BadBacklog(f"backlog must be a JSON object, got {type(value).__name__}")
        version = value.get("version")
        if version != BACKLOG_VERSION or isinstance(version, bool):
            raise BadBacklog(
                f"backlog 'version' {version!r} is not supported: this endpoint reads version "
                f"{BACKLOG_VERSION}"
            )
        client, rows, oldest = value.get("client"), value.get("rows"), value.get("oldest_seconds")
        if not isinstance(client, str):
            raise BadBacklog(f"backlog 'client' must be a string, got {client!r}")
        if not isinstance(rows, int) or isinstance(rows, bool):
            raise BadBacklog(f"backlog 'rows' must be a whole number, got {rows!r}")
        if not isinstance(oldest, int | float) or isinstance(oldest, bool):
            raise BadBacklog(f"backlog 'oldest_seconds' must be a number, got {oldest!r}")
        return cls(client, rows, float(oldest))


@dataclass(frozen=True)
class BacklogTotal:
    """The backlog of an endpoint's clients: rows summed, the oldest row's age."""

    rows: int
    oldest_seconds: float


class ClientBacklogs:
    """The latest report per client, each forgotten `ttl` seconds after it came. Thread-safe:
    pushes report on the gRPC server's threads, the source loop reads."""

    def __init__(self, ttl: float = BACKLOG_TTL) -> None:
        if ttl <= 0:
            raise ValueError(f"ttl must be positive, got {ttl}")
        self.ttl = ttl
        self._latest: dict[str, tuple[ClientBacklog, float]] = {}
        self._lock = threading.Lock()

    def report(self, backlog: ClientBacklog, now: float) -> None:
        with self._lock:
            self._latest[backlog.client] = (backlog, now)

    def total(self, now: float) -> BacklogTotal:
        """The live reports' total at `now` (monotonic seconds, as given to `report`). The
        oldest row has aged since its report: as far as the endpoint knows, it is still due."""
        with self._lock:
            for client in [c for c, (_, at) in self._latest.items() if now - at > self.ttl]:
                del self._latest[client]
            reports = list(self._latest.values())
        rows = sum(b.rows for b, _ in reports)
        oldest = max(
            (b.oldest_seconds + max(now - at, 0.0) for b, at in reports if b.rows), default=0.0
        )
        return BacklogTotal(rows, oldest)
