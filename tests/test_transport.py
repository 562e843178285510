"""Data-stream flow control (keyshift.runtime.transport): credits go back in lots of half the
window, everything sent arrives in order, and a sender whose window is spent gets credits again
once its messages are processed. Services run in this process on loopback."""

from __future__ import annotations

import json
import queue
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from keyshift.runtime.auth import Security
from keyshift.runtime.transport import (
    BATCH,
    CREDIT,
    DATA_SERVICE,
    END,
    GRPC_OPTIONS,
    HELLO,
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
            requests.put(BATCH + bytes([i]))
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
        outlet.send(i.to_bytes(2, "little"), deadline=time.monotonic() + 10)
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
    old.send(b"before", deadline=time.monotonic() + 10)
    first = inbox.get(10)
    assert first is not None and first.payload == b"before" and first.generation == 0
    old.send(b"queued", deadline=time.monotonic() + 10)
    deadline = time.monotonic() + 10
    while inbox.depth() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    inbox.rewind(1)
    old.send(b"after", deadline=time.monotonic() + 10)  # still open, taken by nobody
    late = Outlet(address, "source/0", generation=0)
    new = Outlet(address, "source/0", generation=1)
    try:
        new.send(b"new", deadline=time.monotonic() + 10)
        taken = inbox.get(10)
        assert taken is not None and (taken.payload, taken.generation) == (b"new", 1)
        assert inbox.get(0.2) is None
        with pytest.raises(TransportError, match="generation 0; this instance takes 1"):
            while True:  # refused once the hello is read; its window is never granted
                late.send(b"late", deadline=time.monotonic() + 10)
    finally:
        for outlet in (old, late, new):
            outlet.abort()
