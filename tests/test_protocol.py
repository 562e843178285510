"""The typed control protocol (keyshift.runtime.protocol): every command and event survives its
wire form; a malformed one (unknown type, missing field, wrong type, unexpected field) is a
ProtocolError naming the field; a malformed request to a real coordinator is refused with
INVALID_ARGUMENT and changes nothing; an instance handed a malformed command stops, saying why;
a malformed migration fetch is refused before the stage loop sees it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import pytest

from keyshift.runtime import instance
from keyshift.runtime.coordinator import SERVICE, Coordinator
from keyshift.runtime.instance import migrate_handler
from keyshift.runtime.job import parse_job
from keyshift.runtime.protocol import (
    STRATEGIES,
    Abort,
    Ack,
    Checkpoint,
    CheckpointComplete,
    Drain,
    FetchBody,
    InDone,
    KeyedCheckpointAck,
    MigrateIn,
    MigrateOut,
    OutDone,
    Pause,
    ProtocolError,
    PushOptions,
    RegisterRequest,
    ReportRequest,
    Reroute,
    RescaleReport,
    RescaleRequest,
    Rescaling,
    Resume,
    Retire,
    SinkCheckpointAck,
    SourceCheckpointAck,
    StatusReply,
    Stop,
    Topology,
    parse,
    parse_command,
    parse_event,
)
from keyshift.runtime.stage_context import MIGRATE_SERVICE, FetchRequest, InstanceContext
from keyshift.runtime.transport import (
    Inbox,
    JsonClient,
    TransportError,
    json_handler,
    start_server,
)
from tests.conftest import count_job

COMMANDS = [
    Topology(stages={"counts": {"0": "a:1"}}, assignments={"counts": {"epoch": 1, "owners": [0]}}),
    Drain(),
    Stop(reason="shutdown"),
    Checkpoint(id=3, previous=None),
    CheckpointComplete(id=3, sources={"0": 10}, outputs={"0": 7}),
    Reroute(stage="counts", epoch=2, assignment={"epoch": 2}, keyed={"0": "a:1"}, lost=[1]),
    Pause(epoch=1),
    Resume(epoch=1),
    MigrateIn(epoch=2, groups={"0": [1, 2]}, peers={"0": "a:1"}),
    MigrateOut(
        epoch=2,
        groups={"1": [1, 2]},
        peers={"1": "b:2"},
        sources=2,
        push=PushOptions(chunk_keys=10, trickle_keys_per_s=5.0),
    ),
    Abort(epoch=2, lost=[1], adopt={"0": [4]}),
    Retire(),
    Rescaling(active=False, ended=["source/0"]),
]
EVENTS = [
    Ack(step="reroute", epoch=2),
    OutDone(epoch=2, stats={"keys_out": 4.0}),
    InDone(epoch=2, stats={"keys_in": 4.0}),
    SourceCheckpointAck(id=3, source=0, position=10),
    KeyedCheckpointAck(id=3, chains={"shards": [], "groups": {}}, written=5),
    SinkCheckpointAck(id=3, error="output log: full"),
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.type)
def test_every_command_survives_its_wire_form(command: Any) -> None:
    assert parse_command(command.wire()) == command


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: e.type)
def test_every_event_survives_its_wire_form_inside_a_report(event: Any) -> None:
    report = ReportRequest(stage="counts", index=0, events=[event])
    assert parse(ReportRequest, report.wire()).events == [event]
    assert parse_event(event.wire()) == event


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"type": "teleport"}, "malformed command: Input tag 'teleport' found using 'type'"),
        ({"epoch": 1}, "malformed command: Unable to extract tag using discriminator 'type'"),
        ({"type": "pause"}, "malformed command: pause.epoch: Field required"),
        ({"type": "pause", "epoch": "1"}, "pause.epoch: Input should be a valid integer"),
        ({"type": "retire", "now": True}, "retire.now: Extra inputs are not permitted"),
        (
            {"type": "migrate_out", "epoch": 1, "groups": {}, "peers": {}, "sources": 1,
             "push": {"chunk_keys": 0}},
            "migrate_out.push.chunk_keys: Input should be greater than 0",
        ),
        ("pause", "malformed command: Input should be a valid dictionary"),
    ],
)  # fmt: skip
def test_a_malformed_command_names_what_is_wrong(body: Any, message: str) -> None:
    with pytest.raises(ProtocolError) as raised:
        parse_command(body)
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"type": "nack", "epoch": 1}, "malformed event: Input tag 'nack'"),
        ({"type": "ack", "epoch": 1}, "ack.step: Field required"),
        ({"type": "ack", "step": "jump", "epoch": 1}, "ack.step: Input should be 'migrate_in'"),
        ({"type": "checkpoint_source", "id": 1, "position": 1.5}, "position: Input should be"),
    ],
)
def test_a_malformed_event_names_what_is_wrong(body: Any, message: str) -> None:
    with pytest.raises(ProtocolError) as raised:
        parse_event(body)
    assert message in str(raised.value)


def test_rescale_messages_carry_the_strategy_and_its_options() -> None:
    request = parse(
        RescaleRequest,
        {"stage": "counts", "parallelism": 3, "strategy": "batched",
         "options": {"batch_groups": 8}},
    )  # fmt: skip
    assert (request.strategy, request.options) == ("batched", {"batch_groups": 8.0})
    assert parse(RescaleRequest, {"stage": "counts", "parallelism": 3}).strategy == "hot-first"
    assert set(STRATEGIES) == {"hot-first", "all-at-once", "batched", "lazy"}
    with pytest.raises(ProtocolError, match=r"options\.batch_groups: Input should be a valid"):
        parse(RescaleRequest, {"stage": "c", "parallelism": 1, "options": {"batch_groups": "8"}})
    with pytest.raises(
        ProtocolError, match=r"malformed RescaleReport: .*; from: Field required; strategy"
    ):
        parse(RescaleReport, {"to": 2})


@pytest.mark.parametrize(
    ("method", "body", "message"),
    [
        ("Register", {"stage": "counts", "index": "0", "data_address": "-"}, "index: Input"),
        ("Register", {"stage": "counts", "index": 0}, "data_address: Field required"),
        ("Report", {"stage": "counts", "index": 0, "events": [{"type": "?"}]}, "events.0"),
        ("Report", {"stage": "counts", "index": 0, "finished": "yes"}, "finished: Input"),
        ("Drain", {"now": True}, "malformed Empty: now: Extra inputs are not permitted"),
        ("Watch", {"stage": "counts"}, "malformed InstanceCall: index: Field required"),
    ],
)
def test_a_malformed_request_is_refused_before_it_changes_anything(
    one_keyed_coordinator: tuple[Coordinator, str], method: str, body: dict[str, Any], message: str
) -> None:
    coord, address = one_keyed_coordinator
    client = JsonClient(address, SERVICE)
    try:
        with pytest.raises(TransportError) as raised:
            if method == "Watch":
                next(client.stream(method, body))
            else:
                client.call(method, body)
        assert message in str(raised.value)
        assert coord.members["counts"] == {} and coord.phase == "starting"
    finally:
        client.close()


def test_an_instance_handed_a_malformed_command_stops_and_says_why(
    one_keyed_coordinator: tuple[Coordinator, str],
) -> None:
    """The coordinator runs the same protocol: a command that does not fit is a bug, and the
    instance stops rather than go on without a step of the protocol."""
    coord, _ = one_keyed_coordinator

    def watch(body: dict[str, Any], context: grpc.ServicerContext) -> Iterator[dict[str, Any]]:
        yield Pause(epoch=1).wire()
        yield {"type": "pause", "epoch": "soon"}

    server, port = start_server("127.0.0.1:0", [json_handler(SERVICE, {}, {"Watch": watch})])
    control = JsonClient(f"127.0.0.1:{port}", SERVICE)
    try:
        reply = coord.register(RegisterRequest(stage="counts", index=0, data_address="-"))
        ctx = InstanceContext(coord.spec, "counts", 0, control, Inbox())
        assert reply.identity
        ctx.follow_commands()  # returns once the stream has been read
        assert ctx.stop.is_set()
        assert ctx.next_command() == Pause(epoch=1)
        assert ctx.fatal is not None and "pause.epoch: Input should be a valid integer" in ctx.fatal
    finally:
        control.close()
        server.stop(None)


@contextmanager
def fetch_server() -> Iterator[tuple[InstanceContext, Any]]:
    """A keyed instance's Migrate/Fetch server on loopback (its stage loop played by the test),
    and a call to it."""
    spec = parse_job(count_job(keyed={"parallelism": 1}, sink={"parallelism": 1}))
    nowhere = JsonClient("127.0.0.1:1", SERVICE)
    ctx = InstanceContext(spec, "counts", 0, nowhere, Inbox())
    ctx.fetch_served.set()
    server, port = start_server("127.0.0.1:0", [migrate_handler([ctx])])
    channel = ctx.security.channel(f"127.0.0.1:{port}", [])
    fetch = channel.unary_unary(f"/{MIGRATE_SERVICE}/Fetch", None, None)
    try:
        yield ctx, fetch
    finally:
        channel.close()
        nowhere.close()
        server.stop(None)


def test_a_malformed_fetch_is_refused_and_a_good_one_reaches_the_stage_loop() -> None:
    """The Migrate/Fetch call between keyed instances: its body is parsed before the stage
    loop sees it (the loop alone touches the state)."""
    with fetch_server() as (ctx, fetch):
        for body, message in [
            (b"not json", "fetch refused"),
            (b'{"epoch": 2, "keys": [1.5], "groups": [3]}', "keys.0"),
            (b'{"epoch": 2, "keys": [1]}', "groups: Field required"),
        ]:
            with pytest.raises(grpc.RpcError) as raised:
                fetch(body, timeout=10)
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in (raised.value.details() or "")
        assert ctx.fetches.empty()
        good = b'{"epoch": 2, "keys": [1, "a"], "groups": [3, 4]}'
        answered = threading.Thread(target=lambda: fetch(good, timeout=10))
        answered.start()
        request = ctx.fetches.get(timeout=10)
        assert request.body == FetchBody(epoch=2, keys=[1, "a"], groups=[3, 4])
        request.done.set()
        answered.join(timeout=10)


def test_a_fetch_not_served_in_time_hands_nothing_over_and_one_taken_is_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Serving a fetch hands state over: one the handler gave up on (DEADLINE_EXCEEDED, which
    the new owner answers by asking again) must never be served later, and one the stage loop
    took before the deadline cannot be given up on."""
    monkeypatch.setattr(instance, "FETCH_TIMEOUT", 0.2)
    body = b'{"epoch": 2, "keys": [1], "groups": [3]}'
    with fetch_server() as (ctx, fetch):
        with pytest.raises(grpc.RpcError) as raised:
            fetch(body, timeout=10)
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert not ctx.fetches.get(timeout=10).take()  # the loop skips it: nothing handed over

        # The other order: the loop took it first, so the handler's deadline cannot cancel it.
        taken = FetchRequest(FetchBody(epoch=2, keys=[1], groups=[3]))
        assert taken.take() and not taken.cancel()


def test_the_status_reply_is_a_status_reply_on_the_wire(
    one_keyed_coordinator: tuple[Coordinator, str],
) -> None:
    coord, address = one_keyed_coordinator
    coord.register(RegisterRequest(stage="counts", index=0, data_address="a:1", pid=7))
    client = JsonClient(address, SERVICE)
    try:
        status = parse(StatusReply, client.call("Status"))
    finally:
        client.close()
    assert (status.phase, status.rescale, status.rescales) == ("starting", None, [])
    counts = next(s for s in status.stages if s.name == "counts")
    assert (counts.parallelism, counts.instances[0].address, counts.instances[0].pid) == (
        1,
        "a:1",
        7,
    )
