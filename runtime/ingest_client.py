"""The client of a job's ingest endpoint: push rows into a source stage running `kind: ingest`.

Used by the PySpark writer (`df.writeStream.format("keyshift")`), by tests, and by anyone who
feeds a job from Python. Arrow tables and record batches travel as an Arrow IPC stream;
sequences of dicts travel as JSON. The server (keyshift.runtime.ingest) answers how many rows it
accepted and rejected and why; a request it refuses as a whole raises IngestError, a
TransportError carrying the gRPC status code (RESOURCE_EXHAUSTED and UNAVAILABLE are worth a
retry with the same batch_id; INVALID_ARGUMENT is not).

`push` splits rows into pushes within the endpoint's limits (`max_request_rows`,
`max_request_bytes`; the client's defaults are the ingest source's); a split push with a
batch_id sends its pieces as `<batch_id>#<n>`, so a retry of the same rows is applied once.

Every push may carry the client's backlog (`backlog`, a
keyshift.runtime.ingest_backlog.ClientBacklog: rows due at the client and not pushed yet), which
the job's autoscaler sizes for; a split push tells each piece the rows of the pieces after it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeAlias

import grpc
import pyarrow as pa

from keyshift.runtime.auth import Security
from keyshift.runtime.ingest import (
    ABORT_METHOD,
    COMMIT_METHOD,
    MAX_REASONS,
    PUSH_METHOD,
    pack_request,
)
from keyshift.runtime.ingest_backlog import ClientBacklog
from keyshift.runtime.job import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_REQUEST_ROWS
from keyshift.runtime.transport import GRPC_OPTIONS, TransportError

Rows: TypeAlias = pa.Table | pa.RecordBatch | Sequence[Mapping[str, Any]]


class IngestError(TransportError):
    """A Push that failed; `code` is the gRPC status (None when there is none)."""

    def __init__(self, message: str, code: grpc.StatusCode | None) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class IngestReply:
    accepted: int
    rejected: int
    reasons: tuple[str, ...]  # up to 5 distinct reasons for the rejected rows
    duplicate: bool  # the batch_id was accepted before; nothing was applied this time
    first_seq: int | None  # the sequence number of the first accepted row


def encode_rows(rows: Rows) -> tuple[str, bytes]:
    """(format, payload) of a Push body for these rows."""
    if isinstance(rows, pa.Table | pa.RecordBatch):
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, rows.schema) as writer:
            writer.write(rows)
        return "arrow", sink.getvalue().to_pybytes()
    if isinstance(rows, str | bytes) or not isinstance(rows, Sequence):
        raise TypeError(f"rows must be an Arrow table or a sequence of dicts, got {type(rows)}")
    return "json", json.dumps(list(rows), default=_plain).encode()


def split_rows(rows: Rows, max_rows: int, max_bytes: int) -> Iterator[tuple[str, bytes, int]]:
    """(format, payload, row count) of consecutive pieces of `rows`, each at most `max_rows`
    rows and `max_bytes` bytes of payload; ValueError if one row alone is larger."""
    _check_limits(max_rows, max_bytes)
    total = rows.num_rows if isinstance(rows, pa.Table | pa.RecordBatch) else len(rows)
    if total == 0:
        yield (*encode_rows(rows), 0)
        return
    start, count = 0, min(max_rows, total)
    while start < total:
        count = min(count, total - start)
        piece = (
            rows.slice(start, count)
            if isinstance(rows, pa.Table | pa.RecordBatch)
            else (rows[start : start + count])
        )
        fmt, payload = encode_rows(piece)
        if len(payload) <= max_bytes:
            yield fmt, payload, count
            start += count
        elif count == 1:
            raise ValueError(
                f"row {start} alone takes {len(payload):,} bytes, more than an ingest endpoint "
                f"takes in one push ({max_bytes:,})"
            )
        else:  # shrink in proportion, with a margin for rows larger than the average
            count = max(1, min(count - 1, count * max_bytes // len(payload) * 9 // 10))


def _check_limits(max_rows: int, max_bytes: int) -> None:
    if max_rows < 1 or max_bytes < 1:
        raise ValueError(
            f"an endpoint's limits are positive: got max_request_rows={max_rows}, "
            f"max_request_bytes={max_bytes}"
        )


def _plain(value: Any) -> Any:
    """numpy scalars (which pandas and users' code often hand over) as Python values."""
    item = getattr(value, "item", None)
    if callable(item):
        return item()
    raise TypeError(f"a {type(value).__name__} cannot be sent as JSON")


class IngestClient:
    """Pushes rows to one ingest endpoint (host:port). Thread-safe; reuse it for many pushes."""

    def __init__(
        self,
        address: str,
        max_request_rows: int = DEFAULT_MAX_REQUEST_ROWS,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        security: Security | None = None,
    ) -> None:
        """`max_request_rows` and `max_request_bytes`: the endpoint's limits (the ingest
        source's settings in the job file); pushes are split within them. `security`: the
        job's token and TLS settings; by default from the environment."""
        _check_limits(max_request_rows, max_request_bytes)
        self.address = address
        self.max_request_rows = max_request_rows
        self.max_request_bytes = max_request_bytes
        self._channel = (security or Security.from_env()).channel(address, GRPC_OPTIONS)
        self._push = self._channel.unary_unary(PUSH_METHOD, None, None)
        self._commit = self._channel.unary_unary(COMMIT_METHOD, None, None)
        self._abort = self._channel.unary_unary(ABORT_METHOD, None, None)

    def push(
        self,
        rows: Rows,
        batch_id: str | None = None,
        timeout: float = 60.0,
        backlog: ClientBacklog | None = None,
    ) -> IngestReply:
        """Push rows; with a batch_id, a batch the endpoint accepted before is not applied again.
        Rows beyond the endpoint's limits go in several pushes, and the reply sums theirs
        (`first_seq` is the first piece's; `duplicate` only if every piece was one).
        `backlog`: what the client has left to push after these rows."""
        pieces = list(self.pieces(rows))
        if len(pieces) == 1:
            return self.push_payload(pieces[0][0], pieces[0][1], batch_id, timeout, backlog)
        after = [sum(count for _, _, count in pieces[i + 1 :]) for i in range(len(pieces))]
        replies = [
            self.push_payload(
                fmt,
                payload,
                None if batch_id is None else f"{batch_id}#{i}",
                timeout,
                None if backlog is None else dataclasses.replace(backlog, rows=backlog.rows + n),
            )
            for i, ((fmt, payload, _), n) in enumerate(zip(pieces, after, strict=True))
        ]
        reasons = tuple(dict.fromkeys(r for reply in replies for r in reply.reasons))
        return IngestReply(
            accepted=sum(r.accepted for r in replies),
            rejected=sum(r.rejected for r in replies),
            reasons=reasons[:MAX_REASONS],
            duplicate=all(r.duplicate for r in replies),
            first_seq=next((r.first_seq for r in replies if r.first_seq is not None), None),
        )

    def pieces(self, rows: Rows) -> Iterator[tuple[str, bytes, int]]:
        """`rows` encoded in pieces within this endpoint's limits: (format, payload, rows)."""
        return split_rows(rows, self.max_request_rows, self.max_request_bytes)

    def push_payload(
        self,
        fmt: str,
        payload: bytes,
        batch_id: str | None = None,
        timeout: float = 60.0,
        backlog: ClientBacklog | None = None,
    ) -> IngestReply:
        """Push an already encoded payload: Arrow IPC stream bytes ("arrow") or a JSON array of
        row objects ("json"), e.g. what a writer serialized once and retries unchanged."""
        header: dict[str, Any] = {"format": fmt}
        if batch_id is not None:
            header["batch_id"] = batch_id
        return self._push_with(header, payload, timeout, backlog)

    def stage(
        self,
        rows: Rows,
        transaction: str,
        part: str,
        timeout: float = 60.0,
        backlog: ClientBacklog | None = None,
    ) -> IngestReply:
        """Validate and stage rows as one part of a transaction; nothing flows until `commit`.
        Staging the same part again replaces it (a retried task). A part is one push: split
        larger rows with `pieces` and stage each as its own part."""
        fmt, payload = encode_rows(rows)
        return self.stage_payload(fmt, payload, transaction, part, timeout, backlog)

    def stage_payload(
        self,
        fmt: str,
        payload: bytes,
        transaction: str,
        part: str,
        timeout: float = 60.0,
        backlog: ClientBacklog | None = None,
    ) -> IngestReply:
        """`stage` of an already encoded payload (see `push_payload`)."""
        header = {"format": fmt, "transaction": transaction, "part": part}
        return self._push_with(header, payload, timeout, backlog)

    def _push_with(
        self,
        header: dict[str, Any],
        payload: bytes,
        timeout: float,
        backlog: ClientBacklog | None,
    ) -> IngestReply:
        if backlog is not None:
            header["backlog"] = backlog.to_header()
        return _ingest_reply(self._call("push", self._push, pack_request(header, payload), timeout))

    def commit(self, transaction: str, parts: Sequence[str], timeout: float = 60.0) -> IngestReply:
        """Apply the named staged parts at once; a transaction committed before is a duplicate."""
        body = json.dumps({"transaction": transaction, "parts": list(parts)}).encode()
        return _ingest_reply(self._call("commit", self._commit, body, timeout))

    def abort(self, transaction: str, timeout: float = 10.0) -> int:
        """Drop a transaction's staged parts; the number of parts dropped."""
        body = json.dumps({"transaction": transaction}).encode()
        reply = self._call("abort", self._abort, body, timeout)
        try:
            return int(json.loads(reply)["dropped"])
        except (ValueError, TypeError, KeyError) as exc:
            raise IngestError(
                f"abort at {self.address}: the reply does not follow the protocol ({exc!r})", None
            ) from None

    def _call(self, verb: str, method: Any, body: bytes, timeout: float) -> bytes:
        try:
            return method(body, timeout=timeout)  # type: ignore[no-any-return]
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            status = code.name if code is not None else "no status"
            raise IngestError(
                f"{verb} to {self.address} failed ({status}): {details}", code
            ) from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> IngestClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _ingest_reply(reply: bytes) -> IngestReply:
    try:
        body = json.loads(reply)
        return IngestReply(
            accepted=int(body["accepted"]),
            rejected=int(body["rejected"]),
            reasons=tuple(str(r) for r in body["reasons"]),
            duplicate=bool(body["duplicate"]),
            first_seq=None if body["first_seq"] is None else int(body["first_seq"]),
        )
    except (ValueError, TypeError, KeyError) as exc:
        raise IngestError(f"the reply does not follow the protocol ({exc!r})", None) from None
