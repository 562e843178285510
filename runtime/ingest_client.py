"""The client of a job's ingest endpoint: push rows into a source stage running `kind: ingest`.

Used by the PySpark writer (`df.writeStream.format("keyshift")`), by tests, and by anyone who
feeds a job from Python. Arrow tables and record batches travel as an Arrow IPC stream;
sequences of dicts travel as JSON. The server (keyshift.runtime.ingest) answers how many rows it
accepted and rejected and why; a request it refuses as a whole raises IngestError, a
TransportError carrying the gRPC status code (RESOURCE_EXHAUSTED and UNAVAILABLE are worth a
retry with the same batch_id; INVALID_ARGUMENT is not).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeAlias

import grpc
import pyarrow as pa

from keyshift.runtime.auth import Security
from keyshift.runtime.ingest import ABORT_METHOD, COMMIT_METHOD, PUSH_METHOD, pack_request
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


def _plain(value: Any) -> Any:
    """numpy scalars (which pandas and users' code often hand over) as Python values."""
    item = getattr(value, "item", None)
    if callable(item):
        return item()
    raise TypeError(f"a {type(value).__name__} cannot be sent as JSON")


class IngestClient:
    """Pushes rows to one ingest endpoint (host:port). Thread-safe; reuse it for many pushes."""

    def __init__(self, address: str, security: Security | None = None) -> None:
        """`security`: the job's token and TLS settings; by default from the environment."""
        self.address = address
        self._channel = (security or Security.from_env()).channel(address, GRPC_OPTIONS)
        self._push = self._channel.unary_unary(PUSH_METHOD, None, None)
        self._commit = self._channel.unary_unary(COMMIT_METHOD, None, None)
        self._abort = self._channel.unary_unary(ABORT_METHOD, None, None)

    def push(self, rows: Rows, batch_id: str | None = None, timeout: float = 60.0) -> IngestReply:
        """Push rows; with a batch_id, a batch the endpoint accepted before is not applied again."""
        fmt, payload = encode_rows(rows)
        return self.push_payload(fmt, payload, batch_id, timeout)

    def push_payload(
        self, fmt: str, payload: bytes, batch_id: str | None = None, timeout: float = 60.0
    ) -> IngestReply:
        """Push an already encoded payload: Arrow IPC stream bytes ("arrow") or a JSON array of
        row objects ("json"), e.g. what a writer serialized once and retries unchanged."""
        header: dict[str, Any] = {"format": fmt}
        if batch_id is not None:
            header["batch_id"] = batch_id
        return _ingest_reply(self._call("push", self._push, pack_request(header, payload), timeout))

    def stage(self, rows: Rows, transaction: str, part: str, timeout: float = 60.0) -> IngestReply:
        """Validate and stage rows as one part of a transaction; nothing flows until `commit`.
        Staging the same part again replaces it (a retried task)."""
        fmt, payload = encode_rows(rows)
        header = {"format": fmt, "transaction": transaction, "part": part}
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
