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

from keyshift.runtime.coordinator import SERVICE, Coordinator
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
    parse_command,
)
from keyshift.runtime.transport import JsonClient, TransportError
from tests.conftest import wait_for

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
