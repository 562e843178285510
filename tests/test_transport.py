"""Data streams (keyshift.runtime.transport): credits go back in lots of half the window,
everything sent arrives in order, a sender whose window is spent gets credits again once its
messages are processed, and batches travel without their schema, which each stream carries
once per change. Services run in this process on loopback."""

from __future__ import annotations

import json
import queue
import struct
import threading
import time
from collections.abc import Iterator

import pyarrow as pa
import pytest

from keyshift.runtime.auth import Security
from keyshift.runtime.transport import (
    BATCH,
    CREDIT,
    DATA_SERVICE,
    END,
    FORWARD,
    GRPC_OPTIONS,
    HELLO,
    MARKER,
    Inbox,
    Outlet,
    TransportError,
    start_server,
)

CREDITS = 8


@pytest.fixture
def inbox_address() -> Iterator[tuple[Inbox, str]]:
    inbox = Inbox()
    server, port = start_server("127.0.0.1:0", [inbox.handler()])
    inbox.open(CREDITS)
    try:
        yield inbox, f"127.0.0.1:{port}"
    finally:
        server.stop(None)


def credits_of(message: bytes) -> int:
    assert message[:1] == CREDIT, message
    return int(struct.unpack("<I", message[1:5])[0])


def test_credits_go_back_in_lots_of_half_the_window(inbox_address: tuple[Inbox, str]) -> None:
    inbox, address = inbox_address
    requests: queue.Queue[bytes | None] = queue.Queue()
    requests.put(HELLO + json.dumps({"sender": "source/0"}).encode())
    with Security.from_env().channel(address, GRPC_OPTIONS) as channel:
        call = channel.stream_stream(f"/{DATA_SERVICE}/Push", None, None)
        responses: Iterator[bytes] = iter(call(iter(requests.get, None), timeout=30))
        assert credits_of(next(responses)) == CREDITS
        for i in range(CREDITS):
            requests.put(MARKER + bytes([i]))
        deliveries = [inbox.get(10) for _ in range(CREDITS)]
        assert [d.payload if d else None for d in deliveries] == [bytes([i]) for i in range(8)]
        # Seven released: one lot of four goes back, three wait for the fourth of the next.
        for delivery in deliveries[:-1]:
            assert delivery is not None
            delivery.release()
        assert credits_of(next(responses)) == CREDITS // 2
        deliveries[-1].release()  # type: ignore[union-attr]
        assert credits_of(next(responses)) == CREDITS // 2
        requests.put(END)
        requests.put(None)
        assert list(responses) == []
    end = inbox.get(10)
    assert end is not None and end.kind == END and inbox.failures.empty()


def test_an_outlet_sends_far_more_than_its_window_in_order(
    inbox_address: tuple[Inbox, str],
) -> None:
    inbox, address = inbox_address
    got: list[bytes] = []

    def consume() -> None:
        while (delivery := inbox.get(10)) is not None and delivery.kind != END:
            got.append(delivery.payload)
            delivery.release()

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    outlet = Outlet(address, "source/0")
    total = 10 * CREDITS + 3
    for i in range(total):
        outlet.send(i.to_bytes(2, "little"), deadline=time.monotonic() + 10, kind=MARKER)
    outlet.finish(timeout=10)
    consumer.join(15)
    assert not consumer.is_alive()
    assert got == [i.to_bytes(2, "little") for i in range(total)]


def test_a_rewound_inbox_takes_only_its_generations_streams(
    inbox_address: tuple[Inbox, str],
) -> None:
    """The fence of a local recovery: what an earlier generation's stream queued or sends
    after the rewind is never taken, a stream of an earlier generation opened after it is
    refused, and the new generation's stream is taken."""
    inbox, address = inbox_address
    old = Outlet(address, "source/0")
    old.send(b"before", deadline=time.monotonic() + 10, kind=MARKER)
    first = inbox.get(10)
    assert first is not None and first.payload == b"before" and first.generation == 0
    old.send(b"queued", deadline=time.monotonic() + 10, kind=MARKER)
    deadline = time.monotonic() + 10
    while inbox.depth() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    inbox.rewind(1)
    old.send(b"after", deadline=time.monotonic() + 10, kind=MARKER)  # still open, taken by nobody
    late = Outlet(address, "source/0", generation=0)
    new = Outlet(address, "source/0", generation=1)
    try:
        new.send(b"new", deadline=time.monotonic() + 10, kind=MARKER)
        taken = inbox.get(10)
        assert taken is not None and (taken.payload, taken.generation) == (b"new", 1)
        assert inbox.get(0.2) is None
        with pytest.raises(TransportError, match="generation 0; this instance takes 1"):
            while True:  # refused once the hello is read; its window is never granted
                late.send(b"late", deadline=time.monotonic() + 10, kind=MARKER)
    finally:
        for outlet in (old, late, new):
            outlet.abort()


def test_batches_of_changing_schemas_arrive_whole_on_one_stream_and_on_a_new_one(
    inbox_address: tuple[Inbox, str],
) -> None:
    """Records and a migration's forwarded records of another schema share a stream; a second
    stream of the same sender (a reconnect) starts without the first one's schema."""
    inbox, address = inbox_address
    ints = pa.RecordBatch.from_pydict({"key": [1, 2]})
    strings = pa.RecordBatch.from_pydict({"key": ["a"], "n": [3]})
    sent = [(BATCH, ints), (BATCH, ints), (FORWARD, strings), (BATCH, ints.slice(1))]
    for _ in range(2):
        outlet = Outlet(address, "source/0")
        for kind, batch in sent:
            outlet.send(batch, deadline=time.monotonic() + 10, kind=kind)
        outlet.send(b"{}", deadline=time.monotonic() + 10, kind=MARKER)
        outlet.finish(timeout=10)
        got = []
        while (delivery := inbox.get(10)) is not None and delivery.kind != END:
            got.append((delivery.kind, delivery.content()))
            delivery.release()
        assert delivery is not None and delivery.kind == END
        assert got[-1] == (MARKER, b"{}")
        assert [kind for kind, _ in got[:-1]] == [kind for kind, _ in sent]
        for (_, batch), (_, arrived) in zip(sent, got, strict=False):
            assert isinstance(arrived, pa.RecordBatch) and arrived.equals(batch)
            assert arrived.schema.equals(batch.schema)
    assert inbox.failures.empty()


def test_a_batch_before_its_streams_schema_fails_the_stream(
    inbox_address: tuple[Inbox, str],
) -> None:
    inbox, address = inbox_address
    batch = pa.RecordBatch.from_pydict({"key": [1]})
    requests: queue.Queue[bytes | None] = queue.Queue()
    requests.put(HELLO + json.dumps({"sender": "source/0"}).encode())
    requests.put(BATCH + batch.serialize().to_pybytes())
    with Security.from_env().channel(address, GRPC_OPTIONS) as channel:
        call = channel.stream_stream(f"/{DATA_SERVICE}/Push", None, None)
        responses: Iterator[bytes] = iter(call(iter(requests.get, None), timeout=30))
        assert credits_of(next(responses)) == CREDITS
        assert inbox.failures.get(timeout=10) == "source/0"
        requests.put(None)
    assert inbox.get(0) is None  # nothing of it was taken
    # With the schema first, the same body is a batch.
    outlet = Outlet(address, "source/1")
    outlet.send(batch, deadline=time.monotonic() + 10)
    delivery = inbox.get(10)
    assert delivery is not None and delivery.records is not None
    assert delivery.kind == BATCH and delivery.records.equals(batch)
    outlet.finish(timeout=10)


def test_an_outlet_refuses_a_body_that_does_not_fit_its_kind(
    inbox_address: tuple[Inbox, str],
) -> None:
    _, address = inbox_address
    outlet = Outlet(address, "source/0")
    try:
        with pytest.raises(TypeError, match="carries a batch"):
            outlet.send(b"records", kind=BATCH)
        with pytest.raises(TypeError, match="carries a batch"):
            outlet.try_send(pa.RecordBatch.from_pydict({"key": [1]}), kind=MARKER)
    finally:
        outlet.abort()
