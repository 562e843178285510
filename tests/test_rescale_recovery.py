"""The rescale driver's recovery (keyshift.runtime.rescale's `RescaleDriver._recover`) when a new
owner dies mid-move, driven deterministically: a real Coordinator served on loopback in this
process, and the test playing its instances over the real control calls (Register, Watch,
Report), so every command and event is the real message at the moment the test chooses.

The race it pins down: an old owner may have handed over everything of a move (its `out_done`
is in) while the new owner dies before its `in_done`. The recovery gives those groups back to
the old owner, which no longer counts them as its own (its move out is closed), so the `abort`
must tell it to take them up; it once did not, and the survivor failed on their next records
("records of key group … neither owns nor is receiving").
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import pytest

from keyshift.runtime.coordinator import SERVICE, Coordinator
from keyshift.runtime.job import parse_job
from keyshift.runtime.protocol import (
    Abort,
    Ack,
    Command,
    Event,
    InDone,
    InstanceCall,
    MigrateIn,
    MigrateOut,
    OutDone,
    PeerUnreachable,
    RegisterRequest,
    ReportRequest,
    Reroute,
    RescaleRequest,
    Retire,
    parse_command,
)
from keyshift.runtime.transport import JsonClient, RequestRefused, TransportError
from tests.conftest import count_job, served, wait_for

C = TypeVar("C", bound=Command)


@dataclass
class PlayedInstance:
    """One instance the test plays: registered, watching its commands, reporting events."""

    stage: str
    index: int
    client: JsonClient
    identity: Any
    commands: queue.Queue[Command] = field(default_factory=queue.Queue)

    def watch(self) -> None:
        call = InstanceCall(stage=self.stage, index=self.index, identity=self.identity)
        try:
            for body in self.client.stream("Watch", call.wire()):
                self.commands.put(parse_command(body))
        except TransportError:
            pass  # closed by the test ("killed") or at its end

    def expect(self, kind: type[C]) -> C:
        """The next command of `kind`; others (topology, rescaling) are skipped."""
        while True:
            command = self.commands.get(timeout=30)
            if isinstance(command, kind):
                return command

    def report(self, *events: Event, hits: dict[str, int] | None = None) -> None:
        request = ReportRequest(
            stage=self.stage,
            index=self.index,
            identity=self.identity,
            events=list(events),
            group_hits=hits,
        )
        self.client.call("Report", request.wire())


def join(address: str, stage: str, index: int) -> PlayedInstance:
    client = JsonClient(address, SERVICE)
    request = RegisterRequest(stage=stage, index=index, data_address=f"127.0.0.1:{1000 + index}")
    reply = client.call("Register", request.wire())
    played = PlayedInstance(stage, index, client, reply["identity"])
    threading.Thread(target=played.watch, daemon=True).start()
    return played


@dataclass
class ScaleOut:
    """A 1 -> 2 scale-out of `counts` in its moving phase, every instance played by the test."""

    client: JsonClient
    source: PlayedInstance
    old: PlayedInstance
    sink: PlayedInstance
    new: PlayedInstance
    migrate_in: MigrateIn
    migrate_out: MigrateOut


@contextmanager
def moving_scale_out(coordinator: Coordinator, address: str) -> Iterator[ScaleOut]:
    """Start the scale-out and play it to the moving phase; close every client at the end."""
    spec = coordinator.spec
    source, old = join(address, "source", 0), join(address, "counts", 0)
    sink = join(address, "sink", 0)
    wait_for(lambda: coordinator.phase == "running", 10, "the job to run")
    # Every group carries load, so the plan moves half of them to the new instance.
    old.report(hits={str(g): 1 for g in range(spec.max_key_groups)})
    client = JsonClient(address, SERVICE)
    client.call("Rescale", RescaleRequest(stage="counts", parallelism=2).wire())
    wait_for(lambda: coordinator.desired["counts"] == 2, 10, "the scale-out to start")
    new = join(address, "counts", 1)
    try:
        migrate_in = new.expect(MigrateIn)
        new.report(Ack(step="migrate_in", epoch=migrate_in.epoch))
        migrate_out = old.expect(MigrateOut)
        old.report(Ack(step="migrate_out", epoch=migrate_out.epoch))
        reroute = source.expect(Reroute)
        source.report(Ack(step="reroute", epoch=reroute.epoch))
        wait_for(lambda: client.call("Status")["rescale"]["phase"] == "moving", 10, "the move")
        yield ScaleOut(client, source, old, sink, new, migrate_in, migrate_out)
    finally:
        client.close()
        for instance in (source, old, sink, new):
            instance.client.close()


def test_a_new_owner_lost_after_the_old_owner_handed_everything_over_gives_it_back(
    one_keyed_coordinator: tuple[Coordinator, str],
) -> None:
    coordinator, address = one_keyed_coordinator
    with moving_scale_out(coordinator, address) as move:
        moving = sorted(move.migrate_out.groups["1"])
        assert moving and sorted(move.migrate_in.groups["0"]) == moving
        # The old owner is done: all pushed, all forwarded, its move out closed. Then the new
        # owner dies before it has taken everything in (its command stream breaks).
        move.old.report(OutDone(epoch=move.migrate_out.epoch, stats={}))
        move.new.client.close()

        abort = move.old.expect(Abort)
        assert abort.lost == [1]
        # The groups go back to the old owner: the abort tells it to own them again.
        assert sorted(abort.adopt.get("0", [])) == moving
        move.old.report(Ack(step="abort", epoch=abort.epoch))
        recovered = move.source.expect(Reroute)
        owners = np.asarray(recovered.assignment["owners"])
        assert (owners[moving] == 0).all() and recovered.lost == [1]
        move.source.report(Ack(step="reroute", epoch=recovered.epoch))
        wait_for(lambda: coordinator.rescale_history, 10, "the rescale to end")
        (result,) = coordinator.rescale_history
        assert result.phase == "failed" and result.error is not None
        assert "recovered at parallelism 1" in result.error, result.error
        assert coordinator.assignment.epoch == recovered.epoch


def test_an_old_owner_a_new_owner_cannot_reach_mid_move_is_lost_and_recovered_from(
    one_keyed_coordinator: tuple[Coordinator, str],
) -> None:
    """The new owner's state fetch finds the old owner gone before the coordinator notices
    (its command stream still looks open): the new owner reports it, and the driver recovers
    with the old owner lost, as if its stream had broken; the new owner is not failed."""
    coordinator, address = one_keyed_coordinator
    with moving_scale_out(coordinator, address) as move:
        move.new.report(PeerUnreachable(peer=0, error="a state fetch failed: Connection refused"))

        abort = move.new.expect(Abort)
        assert abort.lost == [0]
        move.new.report(Ack(step="abort", epoch=abort.epoch))
        recovered = move.source.expect(Reroute)
        assert recovered.lost == [0]
        assert set(np.asarray(recovered.assignment["owners"]).tolist()) == {1}
        move.source.report(Ack(step="reroute", epoch=recovered.epoch))
        # its old owner's groups, empty
        move.new.report(InDone(epoch=move.migrate_in.epoch, stats={}))
        wait_for(lambda: coordinator.rescale_history, 10, "the rescale to end")
        (result,) = coordinator.rescale_history
        assert result.error is not None and "recovered at parallelism 1" in result.error
        assert coordinator.phase == "running" and coordinator.lost == ["counts/0"]
        (error,) = coordinator.errors
        assert error.startswith("instance counts/0") and "counts/1 could not reach it" in error


@dataclass
class TwoSubscales:
    """A 2 -> 4 scale-out of `counts` whose two subscales (0 -> 2, 1 -> 3) have started: the
    new owners got their `migrate_in`s."""

    coordinator: Coordinator
    client: JsonClient
    source: PlayedInstance
    old: list[PlayedInstance]
    new: list[PlayedInstance]
    ins: list[MigrateIn]


@contextmanager
def scale_out_2_to_4() -> Iterator[TwoSubscales]:
    spec = parse_job(count_job(keyed={"parallelism": 2}, sink={"parallelism": 1}))
    coordinator = Coordinator(spec, 30.0)
    with served(coordinator) as address:
        source, sink = join(address, "source", 0), join(address, "sink", 0)
        old = [join(address, "counts", i) for i in range(2)]
        wait_for(lambda: coordinator.phase == "running", 10, "the job to run")
        for instance in old:
            instance.report(hits={str(g): 1 for g in range(spec.max_key_groups)})
        client = JsonClient(address, SERVICE)
        client.call("Rescale", RescaleRequest(stage="counts", parallelism=4).wire())
        wait_for(lambda: coordinator.desired["counts"] == 4, 10, "the scale-out to start")
        new = [join(address, "counts", i) for i in (2, 3)]
        try:
            ins = [n.expect(MigrateIn) for n in new]
            assert [list(m.groups) for m in ins] == [["0"], ["1"]]
            assert ins[0].epoch != ins[1].epoch  # each subscale its own epoch
            yield TwoSubscales(coordinator, client, source, old, new, ins)
        finally:
            client.close()
            for instance in (source, sink, *old, *new):
                instance.client.close()


def test_concurrent_subscales_complete_on_their_own_and_a_loss_in_one_spares_the_other() -> None:
    """A 2 -> 4 scale-out is two subscales, 0 -> 2 and 1 -> 3, running side by side: the first
    is committed as soon as its own ends report done, while the second still moves; then the
    second's new owner dies, and only its groups go back (to instance 1)."""
    with scale_out_2_to_4() as move:
        coordinator, client, source, old, new, ins = (
            move.coordinator, move.client, move.source, move.old, move.new, move.ins
        )  # fmt: skip
        for n, migrate_in in zip(new, ins, strict=True):
            n.report(Ack(step="migrate_in", epoch=migrate_in.epoch))
        outs = [o.expect(MigrateOut) for o in old]
        assert [list(out.groups) for out in outs] == [["2"], ["3"]]
        for o, out in zip(old, outs, strict=True):
            o.report(Ack(step="migrate_out", epoch=out.epoch))
        rerouted = 0
        while rerouted < max(m.epoch for m in ins):
            rerouted = source.expect(Reroute).epoch
            source.report(Ack(step="reroute", epoch=rerouted))
        wait_for(lambda: client.call("Status")["rescale"]["phase"] == "moving", 10, "the moves")
        # The first subscale's ends are done: it is committed, the second still moves.
        old[0].report(OutDone(epoch=outs[0].epoch, stats={"bytes_out": 10}))
        new[0].report(InDone(epoch=ins[0].epoch, stats={"bytes_in": 10}))
        first = np.asarray(ins[0].groups["0"])
        second = np.asarray(ins[1].groups["1"])
        wait_for(lambda: (coordinator.assignment.owners[first] == 2).all(), 10, "the commit")
        assert (coordinator.assignment.owners[second] == 1).all()
        report = client.call("Status")["rescale"]["subscales"]
        assert (report["count"], report["done"], report["running"]) == (2, 1, 1), report
        phases = {s["destinations"][0]: (s["phase"], s["bytes"]) for s in report["shown"]}
        assert phases == {2: ("done", 10), 3: ("moving", 0)}, report
        # The second's new owner dies: its groups go back to instance 1, the first's stay.
        new[1].client.close()
        abort = old[1].expect(Abort)
        assert abort.lost == [3] and sorted(abort.adopt.get("1", [])) == sorted(second)
        old[1].report(Ack(step="abort", epoch=abort.epoch))
        recovered = source.expect(Reroute)
        owners = np.asarray(recovered.assignment["owners"])
        assert (owners[first] == 2).all() and (owners[second] == 1).all()
        source.report(Ack(step="reroute", epoch=recovered.epoch))
        old[1].report(OutDone(epoch=outs[1].epoch, stats={}))
        wait_for(lambda: coordinator.rescale_history, 10, "the rescale to end")
        (result,) = coordinator.rescale_history
        assert result.phase == "failed" and "recovered at parallelism 3" in str(result.error)
        assert coordinator.assignment.epoch == recovered.epoch


def test_a_subscale_whose_new_owner_dies_before_it_froze_is_dropped_and_the_other_goes_on() -> None:
    """The new owner of subscale 1 -> 3 dies before it acked its `migrate_in`: instance 1 was
    never told to freeze and is not now (its groups stay with it); subscale 0 -> 2, also still
    preparing, is told to freeze by the recovery and finishes."""
    with scale_out_2_to_4() as move:
        old, new, ins, source = move.old, move.new, move.ins, move.source
        new[1].client.close()
        # The recovery freezes the surviving subscale before the abort.
        out = old[0].expect(MigrateOut)
        assert out.epoch == ins[0].epoch and list(out.groups) == ["2"]
        abort = old[0].expect(Abort)
        assert abort.lost == [3]
        second = np.asarray(ins[1].groups["1"])
        assert sorted(abort.adopt.get("1", [])) == sorted(second)
        for instance in (old[0], old[1], new[0]):
            instance.report(Ack(step="abort", epoch=abort.epoch))
        recovered = source.expect(Reroute)
        owners = np.asarray(recovered.assignment["owners"])
        first = np.asarray(ins[0].groups["0"])
        assert (owners[first] == 2).all() and (owners[second] == 1).all()
        source.report(Ack(step="reroute", epoch=recovered.epoch))
        old[0].report(OutDone(epoch=out.epoch, stats={}))
        new[0].report(InDone(epoch=ins[0].epoch, stats={}))
        wait_for(lambda: move.coordinator.rescale_history, 10, "the rescale to end")
        (result,) = move.coordinator.rescale_history
        assert result.phase == "failed" and "recovered at parallelism 3" in str(result.error)
        assert not any(isinstance(c, MigrateOut) for c in list(old[1].commands.queue))


def test_a_scale_out_whose_new_instances_do_not_all_register_leaves_the_stage_as_it_was() -> None:
    """A 1 -> 3 whose counts/2 never registers: the rescale fails after the registration
    timeout with nothing moved, the stage's width goes back to 1 (the host stops starting the
    missing instance, whose registration is refused from then on), and counts/1, which did
    register, is retired."""
    spec = parse_job(count_job(keyed={"parallelism": 1}, sink={"parallelism": 1}))
    coordinator = Coordinator(spec, 1.0)
    with served(coordinator) as address:
        source, old, sink = (join(address, s, 0) for s in ("source", "counts", "sink"))
        wait_for(lambda: coordinator.phase == "running", 10, "the job to run")
        client = JsonClient(address, SERVICE)
        started = client.call("Rescale", RescaleRequest(stage="counts", parallelism=3).wire())
        wait_for(lambda: coordinator.desired["counts"] == 3, 10, "the scale-out to start")
        new = join(address, "counts", 1)
        try:
            new.expect(Retire)
            assert coordinator.desired["counts"] == 1
            new.client.call(
                "Report",
                ReportRequest(stage="counts", index=1, identity=new.identity, finished=True).wire(),
            )
            new.client.close()  # it exits: its command stream ends

            def ended() -> dict[str, Any] | None:
                rescales = client.call("Status")["rescales"]
                return next((r for r in rescales if r["id"] == started["id"]), None)

            result = wait_for(ended, 10, "the rescale to end")
            assert result["phase"] == "failed" and "to register" in result["error"], result
            assert result["groups_moved"] == 0
            wait_for(lambda: 1 not in coordinator.members["counts"], 10, "counts/1 to leave")
            assert coordinator.assignments["counts"].parallelism == 1
            with pytest.raises(RequestRefused, match="no instance counts/2"):
                join(address, "counts", 2)
        finally:
            client.close()
            for instance in (source, old, sink, new):
                instance.client.close()
