"""gRPC transport: data channels with credit-based flow control, and JSON control calls.

Data: a sender opens one bidirectional `keyshift.Data/Push` stream per downstream instance and
sends batches; the receiver grants credits, one per batch it has taken off its bounded
inbox (handed back in lots of half the window), so a slow stage stops its senders instead of
growing a queue. Control: unary calls whose
bodies are JSON (coordinator registration, reports, status) plus a server stream of commands.
Messages are raw bytes (no generated code): a one-byte kind, then the body.
Every data stream belongs to a generation (in its hello), and an inbox takes only its own
generation's messages: a local recovery rewinds the job into the next generation, and what was
sent before the rewind, still in flight or queued, is never taken after it. A batch travels
without its Arrow schema: a stream sends its schema (SCHEMA) before its first batch and again
whenever the schema of the batches it sends changes, and the receiving end of that stream
reads each batch by the schema it last had on it. Each stream has its own: a new stream (a
reconnect, a new sender) starts without one.
Used by the coordinator, the stage instances and the local host's client.
"""

from __future__ import annotations

import json
import logging
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
import pyarrow as pa

from keyshift.runtime.auth import Security
from keyshift.runtime.identity import Identity, Issuer
from keyshift.runtime.metrics import UNAUTHENTICATED
from keyshift.runtime.records import decode_body, decode_schema, encode_body, encode_schema

log = logging.getLogger(__name__)

MAX_MESSAGE = 256 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.so_reuseport", 0),
    # A peer that restarts (a recovering coordinator) is reached again within a second, not
    # after gRPC's default backoff of up to two minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
DATA_SERVICE = "keyshift.Data"
HELLO, END, LEAVE, CREDIT = b"H", b"E", b"L", b"C"
SCHEMA = b"A"  # the Arrow schema of the stream's batches from here on (takes no credit)
# Message kinds on a data stream, each taking one credit. Ordering on one stream is what the
# migration protocol relies on: a MARKER follows every batch its sender routed by the old epoch.
BATCH = b"B"  # records from an upstream stage
MARKER = b"M"  # a source switched to a new assignment epoch (JSON)
FORWARD = b"F"  # records an old owner hands to the new owner of their key group
STATE = b"S"  # a chunk of keyed state pushed by an old owner (Arrow IPC, JSON header first)
FORWARD_DONE = b"D"  # the old owner will forward nothing more for this epoch (JSON)
BARRIER = b"K"  # a checkpoint barrier: what the sender sent before it is in the checkpoint
WATERMARK = b"W"  # the sender's event-time watermark (JSON), after the records it covers
DATA_KINDS = frozenset((BATCH, MARKER, FORWARD, STATE, FORWARD_DONE, BARRIER, WATERMARK))
RECORD_KINDS = frozenset((BATCH, FORWARD))  # their body is a batch in the stream's schema


class TransportError(RuntimeError):
    """A peer that cannot be reached, died, or broke the protocol."""


class PortInUseError(TransportError):
    pass


class RequestRefused(TransportError):
    """The peer answered, and refused the request as wrong or not possible now (ControlError)."""


REFUSALS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
    }
)


class NoCredit(TransportError):
    """The receiver granted no credit before the sender's deadline: it is backpressuring."""


def start_server(
    address: str,
    handlers: list[grpc.GenericRpcHandler[Any, Any]],
    max_calls: int = 64,
    security: Security | None = None,
) -> tuple[grpc.Server, int]:
    """Start a gRPC server on host:port (port 0 = any free one); return it and its port.

    The server runs each call, a stream for its whole life, on a thread of its own, so
    `max_calls` (the caller's bound on calls at once, from the job's shape; the default suits
    servers of short calls, such as the ingest endpoint) sizes its pool, and a call beyond it
    is refused at once with RESOURCE_EXHAUSTED: queued for a thread, it would hang until its
    deadline. Threads start only as calls need them. Calls without the job's token are refused
    (`security`, by default this process's settings)."""
    security = security or Security.from_env()
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_calls, thread_name_prefix="grpc"),
        handlers=handlers,
        interceptors=security.interceptors(UNAUTHENTICATED.refused),
        options=GRPC_OPTIONS,
        maximum_concurrent_rpcs=max_calls,
    )
    try:
        port = security.add_port(server, address)
    except RuntimeError as exc:
        raise PortInUseError(f"cannot listen on {address}: port already in use ({exc})") from None
    if port == 0:
        raise PortInUseError(f"cannot listen on {address}: port already in use")
    server.start()
    return server, port


# --- control: JSON unary calls and a command stream -------------------------------------


def json_handler(
    service: str,
    unary: dict[str, Callable[[dict[str, Any]], dict[str, Any]]],
    streams: dict[str, Callable[[dict[str, Any], grpc.ServicerContext], Iterator[dict[str, Any]]]]
    | None = None,
) -> grpc.GenericRpcHandler[Any, Any]:
    def unary_call(fn: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
        def call(request: bytes, context: grpc.ServicerContext) -> bytes:
            try:
                body = json.loads(request) if request else {}
            except ValueError:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request is not JSON")
            try:
                return json.dumps(fn(body)).encode()
            except ControlError as exc:
                context.abort(exc.code, str(exc))
            raise AssertionError("unreachable")

        return grpc.unary_unary_rpc_method_handler(call)

    def stream_call(
        fn: Callable[[dict[str, Any], grpc.ServicerContext], Iterator[dict[str, Any]]],
    ) -> Any:
        def call(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
            try:
                for item in fn(json.loads(request) if request else {}, context):
                    yield json.dumps(item).encode()
            except ControlError as exc:
                context.abort(exc.code, str(exc))

        return grpc.unary_stream_rpc_method_handler(call)

    methods = {name: unary_call(fn) for name, fn in unary.items()}
    methods.update({name: stream_call(fn) for name, fn in (streams or {}).items()})
    return grpc.method_handlers_generic_handler(service, methods)


class ControlError(Exception):
    """A control request that is refused; the message goes back to the caller."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.FAILED_PRECONDITION):
        super().__init__(message)
        self.code = code


class JsonClient:
    """Calls a JSON control service; every failure becomes a TransportError naming the peer."""

    def __init__(self, address: str, service: str, security: Security | None = None) -> None:
        self.address = address
        self.service = service
        self._channel = (security or Security.from_env()).channel(address, GRPC_OPTIONS)

    def call(self, method: str, body: dict[str, Any] | None = None, timeout: float = 10.0) -> Any:
        stub = self._channel.unary_unary(f"/{self.service}/{method}", None, None)
        try:
            reply = stub(json.dumps(body or {}).encode(), timeout=timeout)
        except grpc.RpcError as exc:
            refused = isinstance(exc, grpc.Call) and exc.code() in REFUSALS
            error = RequestRefused if refused else TransportError
            raise error(_describe(exc, self.address, method)) from None
        return json.loads(reply)

    def stream(self, method: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        stub = self._channel.unary_stream(f"/{self.service}/{method}", None, None)
        try:
            for item in stub(json.dumps(body).encode()):
                yield json.loads(item)
        except grpc.RpcError as exc:
            raise TransportError(_describe(exc, self.address, method)) from None

    def wait_ready(self, timeout: float) -> None:
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise TransportError(f"no answer from {self.address} within {timeout:.0f} s") from None

    def close(self) -> None:
        self._channel.close()


def _describe(exc: grpc.RpcError, address: str, method: str) -> str:
    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"{address} is unreachable ({method}): {details}"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return (
            f"{method} at {address} was refused: it serves as many calls at once as it is "
            f"sized for ({details})"
        )
    return f"{method} at {address} failed: {details}"


# --- data: credit-based streams -----------------------------------------------------------


@dataclass
class Delivery:
    """One message taken from the inbox: a kind (BATCH, MARKER, ... or END) and its body:
    `records` for the RECORD_KINDS, else `payload`."""

    sender: str
    kind: bytes
    payload: bytes
    _grant: Callable[[], None]
    generation: int = 0
    records: pa.RecordBatch | None = None

    def release(self) -> None:
        """Hand the sender's credit back; call once the payload is processed or copied."""
        self._grant()

    def content(self) -> bytes | pa.RecordBatch:
        return self.records if self.records is not None else self.payload


class Inbox:
    """The bounded input of one instance, fed by all its senders' Push streams."""

    def __init__(self) -> None:
        self.credits = 0
        self.generation = 0  # the only generation whose streams are taken
        self._opened = threading.Event()
        self._queue: queue.Queue[Delivery] = queue.Queue()
        self.failures: queue.Queue[str] = queue.Queue()
        self._senders: Issuer | None = None

    def open(
        self, credits_per_sender: int, senders: Issuer | None = None, generation: int = 0
    ) -> None:
        """Start granting credits; senders that connected earlier wait until now. With
        `senders`, a stream whose hello does not carry the identity issued to the sender it
        names is refused before anything it sends is taken. Only streams of `generation` are
        taken."""
        self.credits = credits_per_sender
        self._senders = senders
        self.generation = generation
        self._opened.set()

    def rewind(self, generation: int) -> None:
        """Take only `generation`'s streams from now on, and drop what the earlier ones left
        queued. Their streams stay open, granted nothing more: their senders wait on credits
        until they rewind too (closing them would fail a sender that has not yet been told)."""
        self.generation = generation
        while not self._queue.empty():
            self._queue.get_nowait()
        while not self.failures.empty():
            self.failures.get_nowait()

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        return grpc.method_handlers_generic_handler(
            DATA_SERVICE, {"Push": grpc.stream_stream_rpc_method_handler(self._push)}
        )

    def get(self, timeout: float) -> Delivery | None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                delivery = (
                    self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
                )
            except queue.Empty:
                return None
            if delivery.generation == self.generation:
                return delivery
            # An earlier generation's, queued before the rewind: never taken.
            timeout = max(deadline - time.monotonic(), 0.0)

    def depth(self) -> int:
        return self._queue.qsize()

    def _push(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        self._opened.wait()
        hello = next(requests, b"")
        try:
            body = json.loads(hello[1:]) if hello[:1] == HELLO else None
        except ValueError:
            body = None
        if not isinstance(body, dict):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a data stream starts with a hello")
            raise AssertionError("unreachable")
        sender = str(body.get("sender", "?"))
        generation = body.get("generation", 0)
        if generation != self.generation:
            # An earlier generation's sender that has not rewound yet (a later one cannot come
            # before this instance has rewound: its topology is only sent after that).
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"a stream of generation {generation!r}; this instance takes {self.generation}",
            )
        if self._senders is not None and not self._senders.valid(
            sender, Identity.from_json(body.get("identity"))
        ):
            UNAUTHENTICATED.refused(DATA_SERVICE)
            log.warning("refused a data stream in the name of %s: not its identity", sender)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"not the identity of {sender}")
        grants: queue.Queue[int | None] = queue.Queue()
        grants.put(self.credits)
        # Credits go back in lots of half the window, not one per message: each credit
        # message costs both ends a gRPC send and thread hand-offs (bench/data_path.py). The
        # sender still holds at least half its window, and a lot is always completed by the
        # messages it has in flight, so no sender waits on credits withheld.
        lot = max(1, self.credits // 2)
        released = 0
        lock = threading.Lock()

        def grant() -> None:
            nonlocal released
            with lock:
                released += 1
                if released < lot:
                    return
                released = 0
            grants.put(lot)

        def read() -> None:
            ended = False
            schema: pa.Schema | None = None  # this stream's, once its sender has sent it
            try:
                for message in requests:
                    kind = message[:1]
                    if kind in RECORD_KINDS:
                        if schema is None:
                            raise ValueError("a batch before its stream's schema")
                        # Read in place: the batch shares the message's memory.
                        records = decode_body(memoryview(message)[1:], schema)
                        self._queue.put(
                            Delivery(sender, kind, b"", grant, generation, records=records)
                        )
                    elif kind == SCHEMA:
                        schema = decode_schema(memoryview(message)[1:])
                    elif kind in DATA_KINDS:
                        self._queue.put(Delivery(sender, kind, message[1:], grant, generation))
                    elif kind in (END, LEAVE):
                        ended = True
                        self._queue.put(Delivery(sender, kind, b"", lambda: None, generation))
            except grpc.RpcError:
                pass
            except (ValueError, pa.ArrowException) as exc:
                # The sender broke the protocol: its stream ends here, as a failed one.
                log.warning("dropped the data stream of %s: %s", sender, exc)
            if not ended and generation == self.generation:
                self.failures.put(sender)
            grants.put(None)

        threading.Thread(target=read, name="inbox-reader", daemon=True).start()
        while True:
            n = grants.get()
            if n is None:
                return
            yield CREDIT + struct.pack("<I", n)


class Outlet:
    """The sending end of one data channel, to one downstream instance."""

    def __init__(
        self,
        address: str,
        sender: str,
        security: Security | None = None,
        identity: Identity | None = None,
        generation: int = 0,
    ) -> None:
        """`identity`: the one `sender` was issued at registration, shown in the hello with
        the sender's `generation`."""
        self.address = address
        self._channel = (security or Security.from_env()).channel(address, GRPC_OPTIONS)
        self._requests: queue.Queue[bytes | None] = queue.Queue()
        self._credits = 0
        self._cv = threading.Condition()
        self._error: str | None = None
        self._closed = False
        self._schema: pa.Schema | None = None  # the one the receiver reads batches by now
        hello: dict[str, Any] = {"sender": sender, "generation": generation}
        if identity is not None:
            hello["identity"] = identity.to_json()
        self._requests.put(HELLO + json.dumps(hello).encode())
        call = self._channel.stream_stream(f"/{DATA_SERVICE}/Push", None, None)
        self._responses = call(iter(self._requests.get, None))
        self._reader = threading.Thread(target=self._read_credits, name="outlet", daemon=True)
        self._reader.start()

    def _read_credits(self) -> None:
        try:
            for message in self._responses:
                if message[:1] == CREDIT:
                    with self._cv:
                        self._credits += struct.unpack("<I", message[1:5])[0]
                        self._cv.notify_all()
            error = None if self._closed else f"{self.address} closed the data stream"
        except grpc.RpcError as exc:
            error = None if self._closed else _describe(exc, self.address, "Push")
        with self._cv:
            self._error = error or self._error
            if error:
                self._cv.notify_all()

    def send(
        self, payload: bytes | pa.RecordBatch, deadline: float | None = None, kind: bytes = BATCH
    ) -> float:
        """Send one message once a credit is free; return the seconds spent waiting. The body of
        the RECORD_KINDS is a batch, that of the others bytes."""
        start = time.perf_counter()
        body = self._body(payload, kind)
        with self._cv:
            while self._credits == 0 and self._error is None:
                if deadline is not None and time.monotonic() > deadline:
                    raise NoCredit(f"no credit from {self.address} before the deadline")
                self._cv.wait(0.1)
            if self._error is not None:
                raise TransportError(self._error)
            self._credits -= 1
            self._put(payload, kind, body)
        return time.perf_counter() - start

    def try_send(self, payload: bytes | pa.RecordBatch, kind: bytes = BATCH) -> bool:
        """Send one message if a credit is free right now; never wait."""
        body = self._body(payload, kind)
        with self._cv:
            if self._error is not None:
                raise TransportError(self._error)
            if self._credits == 0:
                return False
            self._credits -= 1
            self._put(payload, kind, body)
        return True

    @staticmethod
    def _body(payload: bytes | pa.RecordBatch, kind: bytes) -> bytes | pa.Buffer:
        if (kind in RECORD_KINDS) != isinstance(payload, pa.RecordBatch):
            raise TypeError(f"a message of kind {kind!r} carries a batch if and only if records")
        return encode_body(payload) if isinstance(payload, pa.RecordBatch) else payload

    def _put(self, payload: bytes | pa.RecordBatch, kind: bytes, body: bytes | pa.Buffer) -> None:
        """Queue the message, after the batch's schema if the receiver does not have it (under
        the credit lock: the two go on the stream in this order)."""
        if isinstance(payload, pa.RecordBatch) and (
            self._schema is None or not payload.schema.equals(self._schema)
        ):
            self._schema = payload.schema
            self._requests.put(SCHEMA + encode_schema(payload.schema))
        self._requests.put(b"".join((kind, body)))

    def finish(self, timeout: float = 30.0, kind: bytes = END) -> None:
        """Close the stream once everything queued is delivered. END tells the receiver this
        sender's data is complete; LEAVE only that this stream closes (a retired instance, a
        finished migration), so a later instance under the same name may send more."""
        self._closed = True
        self._requests.put(kind)
        self._requests.put(None)
        self._reader.join(timeout)
        self._channel.close()

    def abort(self) -> None:
        self._closed = True
        self._requests.put(None)
        self._channel.close()
