"""Event-time watermarks: the pure generator and tracker (keyshift.runtime.watermarks), the
job's `event_time` settings, and watermarks flowing from ingest sources to keyed instances
through real processes: the minimum over the sources, an idle source that stops holding it
back, and the watermark and its lag exported as metrics."""

from __future__ import annotations

import os
import re
import signal
import urllib.request
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from keyshift.runtime.checkpoint_store import CheckpointStore
from keyshift.runtime.ingest_client import IngestClient
from keyshift.runtime.job import JobError, parse_job
from keyshift.runtime.metrics import MetricName
from keyshift.runtime.protocol import ProtocolError, Watermark, WatermarkHold, parse
from keyshift.runtime.transport import JsonClient
from keyshift.runtime.watermarks import WatermarkGenerator, WatermarkTracker
from tests.conftest import BATCHING, count_job, running_job, wait_for
from tests.test_recovery import Run, start_run
from tests.test_rescale import SERVICE, rescale_via

FINAL = WatermarkTracker.FINAL


def test_a_source_watermark_trails_the_highest_event_time_by_the_bound() -> None:
    marks = WatermarkGenerator(bound_us=500, idle_timeout=None, last_active=0.0)
    assert marks.watermark is None
    marks.observe(10_000, 1.0)
    marks.observe(9_000, 2.0)  # a late-ish record does not move it back
    assert marks.watermark == 9_500
    marks.observe(12_000, 3.0)
    assert marks.watermark == 11_500


def test_a_quiet_source_becomes_idle_once_per_spell_and_active_when_it_emits() -> None:
    marks = WatermarkGenerator(bound_us=0, idle_timeout=2.0, last_active=0.0)
    assert not marks.check_idle(1.9)
    assert marks.check_idle(2.0) and marks.idle  # quiet from the start counts too
    assert not marks.check_idle(5.0)
    marks.observe(100, 6.0)
    assert not marks.idle and not marks.check_idle(6.0) and not marks.check_idle(7.9)
    assert marks.check_idle(8.0)
    never = WatermarkGenerator(bound_us=0, idle_timeout=None, last_active=0.0)
    assert not never.check_idle(1e9)


def test_a_source_whose_watermark_waited_for_credits_does_not_become_idle() -> None:
    """Slow receivers hold the watermark a source sends after its last batch for 1.5 s waiting
    for credits, and no records wait after it: its quiet spell starts after that send, not at
    the batch. (Under load both NEXMark sources of tests/test_windows.py's two windowed stages
    went idle so, the keyed instances' watermark passed their next records, a window fired
    short.)"""
    generator = WatermarkGenerator(bound_us=0, idle_timeout=1.0, last_active=0.0)
    generator.observe(100, now=0.0)  # the batch is out; its watermark's send waits for credits
    assert not generator.check_idle(now=1.5) and not generator.idle  # the check after that send
    assert not generator.check_idle(now=2.4)
    assert generator.check_idle(now=2.5)  # quiet for a second since: idle


def test_a_held_up_source_does_not_become_idle() -> None:
    """A source that has records but may not send them (a rescale paused it, or its receivers
    withhold credits: a replacement still restoring after a local recovery) is not a quiet
    input: were it idle, the receivers would follow the other sources past the records it
    sends once it can, and fire windows and timers early."""
    generator = WatermarkGenerator(bound_us=0, idle_timeout=1.0, last_active=0.0)
    generator.observe(100, now=0.0)
    assert not generator.check_idle(now=0.0)
    generator.held_up(now=0.9)
    generator.held_up(now=1.8)
    assert not generator.check_idle(now=2.5) and not generator.idle
    assert generator.check_idle(now=2.9)  # quiet for a second after the hold-up: idle


@pytest.mark.parametrize(
    ("bound", "timeout", "reason"),
    [(-1, None, "bound must be >= 0"), (0, 0.0, "idle timeout must be > 0")],
)
def test_bad_generator_settings_are_refused(bound: int, timeout: float | None, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        WatermarkGenerator(bound_us=bound, idle_timeout=timeout, last_active=0.0)


def test_the_tracker_takes_the_minimum_of_its_inputs_and_never_goes_back() -> None:
    tracker = WatermarkTracker({"a", "b"})
    assert not tracker.advance("a", 100)  # b has said nothing yet
    assert tracker.current is None
    assert tracker.advance("b", 50) and tracker.current == 50
    assert tracker.advance("b", 300) and tracker.current == 100
    assert not tracker.advance("a", 90)  # an input's watermark never goes back either
    assert tracker.current == 100
    assert not tracker.advance("c", 20)  # a new input, behind: the current one stays
    assert not tracker.advance("a", 400) and tracker.current == 100
    assert tracker.current == 100
    assert tracker.advance("c", 350) and tracker.current == 300


def test_idle_inputs_do_not_hold_it_back_and_ended_ones_release_it() -> None:
    tracker = WatermarkTracker({"a", "b"})
    tracker.advance("a", 1_000)
    assert tracker.advance("b", None, idle=True) and tracker.current == 1_000
    assert tracker.advance("a", 2_000) and tracker.current == 2_000
    assert not tracker.advance("b", 1_500)  # b speaks again, behind: it holds from now on
    assert tracker.current == 2_000
    assert not tracker.advance("a", 3_000) and tracker.current == 2_000
    assert tracker.advance("b", 2_500) and tracker.current == 2_500
    assert not tracker.advance("a", None, idle=True)  # b alone holds it, at 2_500
    assert tracker.end("b") is False  # a is idle and b ended: nothing says how far time is
    assert tracker.end("a") and tracker.current == FINAL


def test_a_move_upstream_holds_the_watermark_until_every_new_owner_releases_it() -> None:
    """A keyed stage upstream moves groups from a/1 to a/0 and a/2: whatever the instances'
    watermarks say, it stays at a/1's until both new owners have sent the moved windows."""
    tracker = WatermarkTracker({"a/0", "a/1"})
    tracker.advance("a/0", 120)
    assert tracker.advance("a/1", 100) and tracker.current == 100
    tracker.hold("a", 7, "a/1", 100, {"a/0", "a/2"})
    assert not tracker.advance("a/1", 130) and tracker.current == 100
    assert not tracker.release("a", 7, "a/0")  # a/2 has not released yet
    assert not tracker.release("a", 6, "a/2")  # not this move
    # a/2, started by the rescale, has sent no watermark yet: from its release on it is an
    # input, and one with no watermark holds everything (else the moved groups' records it
    # sends next would be behind the watermark).
    assert not tracker.release("a", 7, "a/2") and tracker.current == 100
    assert tracker.advance("a/2", 125) and tracker.current == 120
    # A release that overtakes its hold (they come on different streams) is kept for it.
    assert not tracker.release("a", 8, "a/0")
    tracker.hold("a", 8, "a/1", 120, {"a/0"})
    assert tracker.advance("a/0", 200) and tracker.current == 125
    assert tracker.advance("a/2", 400) and tracker.current == 130
    # A holder with no watermark yet holds everything.
    tracker.hold("a", 9, "a/1", None, {"a/2"})
    assert not tracker.advance("a/1", 300) and tracker.current == 130
    assert tracker.release("a", 9, "a/2") and tracker.current == 200


def test_every_old_owner_of_a_move_holds_at_its_own_watermark() -> None:
    """a/0 and a/1 both give groups to a/2 in one move: the watermark stays at the lower of
    their watermarks, whichever hold comes last, until a/2 has released the move (a/1's moved
    timers between 100 and 150 fire at a/2, and their records must not be behind it)."""
    tracker = WatermarkTracker({"a/0", "a/1"})
    tracker.advance("a/0", 150)
    assert tracker.advance("a/1", 100) and tracker.current == 100
    tracker.hold("a", 3, "a/1", 100, {"a/2"})
    tracker.hold("a", 3, "a/0", 150, {"a/2"})
    assert not tracker.advance("a/1", 200) and tracker.current == 100
    assert not tracker.release("a", 3, "a/2")  # no watermark from a/2 yet
    assert tracker.advance("a/2", 180) and tracker.current == 150


def test_an_input_that_left_holds_nothing_back_until_it_joins_again() -> None:
    tracker = WatermarkTracker({"a/0", "a/1"})
    tracker.advance("a/0", 500)
    tracker.advance("a/1", 100)
    assert tracker.leave("a/1") and tracker.current == 500
    assert not tracker.advance("a/1", 400)  # joined again, behind: it holds from now on
    assert not tracker.advance("a/0", 900) and tracker.current == 500
    assert tracker.advance("a/1", 800) and tracker.current == 800


def test_a_lost_new_owner_releases_its_move_and_a_retired_old_owner_still_holds() -> None:
    """a/1 moves groups to a/2, which dies (the topology no longer names it): the move will
    never be released, so it holds nothing back. a/0 retires after giving groups to a/1 (a
    LEAVE, then a topology without it): its hold stays until a/1 releases that move. An
    instance of another stage is never taken for lost."""
    tracker = WatermarkTracker({"a/0", "a/1", "b/0"})
    for sender, mark in (("a/0", 100), ("a/1", 150), ("b/0", 400)):
        tracker.advance(sender, mark)
    assert tracker.current == 100
    tracker.hold("a", 4, "a/0", 100, {"a/1"})
    tracker.hold("a", 5, "a/1", 150, {"a/2"})
    assert not tracker.leave("a/0")  # held at a/0's 100 still
    assert not tracker.forget_lost({"a"}, {"a/1", "a/2"})
    assert not tracker.forget_lost({"a"}, {"a/1"}) and tracker.current == 100  # a/2 lost
    assert tracker.release("a", 4, "a/1") and tracker.current == 150
    assert tracker.advance("a/1", 300) and tracker.current == 300
    assert not tracker.forget_lost({"a"}, {"a/1"})  # nothing more to forget
    assert tracker.forget_lost({"a"}, set()) and tracker.current == 400  # b/0's


def test_a_retired_old_owner_named_by_the_topology_holds_until_its_leave() -> None:
    """a/2 gave its groups to a/0 and retired; the topology that no longer lists it (naming it
    retired) overtook its LEAVE and a/0's release, both still queued on their streams. It is
    no loss: its watermark and its hold stand, or a/0's own watermark (ahead) would carry the
    receiver past the moved windows' results, which a/0 sends before its release."""
    tracker = WatermarkTracker({"a/0", "a/2"})
    tracker.advance("a/0", 500)
    tracker.advance("a/2", 100)
    tracker.hold("a", 7, "a/2", 100, {"a/0"})
    assert not tracker.forget_lost({"a"}, {"a/0"}, retired={"a/2"}) and tracker.current == 100
    assert not tracker.leave("a/2") and tracker.current == 100  # still held for a/0
    assert tracker.release("a", 7, "a/0") and tracker.current == 500
    # Unnamed, the same absence is a loss: nothing of a/2's arrives any more.
    lost = WatermarkTracker({"a/0", "a/2"})
    lost.advance("a/0", 500)
    lost.advance("a/2", 100)
    lost.hold("a", 7, "a/2", 100, {"a/0"})
    assert lost.forget_lost({"a"}, {"a/0"}) and lost.current == 500


def test_a_watermark_message_is_checked_when_parsed() -> None:
    assert parse(Watermark, {"watermark": 5, "idle": True}) == Watermark(watermark=5, idle=True)
    assert parse(Watermark, {"watermark": None}).idle is False
    with pytest.raises(ProtocolError, match="watermark"):
        parse(Watermark, {"watermark": "5"})
    with pytest.raises(ProtocolError, match="late"):
        parse(Watermark, {"watermark": 5, "late": 1})
    held = parse(Watermark, {"watermark": 5, "hold": {"epoch": 3, "until": [0, 2]}})
    assert held.hold == WatermarkHold(epoch=3, until=[0, 2])
    with pytest.raises(ProtocolError, match="until"):
        parse(Watermark, {"watermark": 5, "hold": {"epoch": 3, "until": "0"}})
    with pytest.raises(ProtocolError, match="release"):
        parse(Watermark, {"watermark": 5, "release": "3"})


def event_time_job(out: Path, event_time: dict[str, Any], sources: int = 2) -> dict[str, Any]:
    return count_job(
        fields={"user": "str", "clicks": "int", "at": "int"},
        source={"parallelism": sources, "config": {"kind": "ingest"}, "event_time": event_time},
        keyed={"name": "per-user", "parallelism": 2, "key_by": "user",
               "operator": {"function": "sum", "field": "clicks"}},
        sink={"config": {"kind": "log", "path": str(out)}},
    )  # fmt: skip


@pytest.mark.parametrize(
    ("event_time", "reason"),
    [
        ({"field": "when"}, "source.event_time.field 'when' is not one of the source's fields"),
        ({"field": "user"}, "'user' is a 'str' field; an event time is an 'int' field"),
        ({"max_out_of_orderness_ms": -1}, "max_out_of_orderness_ms: Input should be greater"),
        ({"idle_timeout_ms": 0}, "idle_timeout_ms: Input should be greater than 0"),
        ({"bound": 3}, "bound: Extra inputs are not permitted"),
    ],
)
def test_bad_event_time_settings_are_refused_at_load(
    tmp_path: Path, event_time: dict[str, Any], reason: str
) -> None:
    with pytest.raises(JobError, match=reason):
        parse_job(event_time_job(tmp_path, event_time))


def stats(local: Any, stage: int) -> list[dict[str, Any]]:
    """The latest counters of a stage's instances, by index."""
    instances = sorted(local.status()["stages"][stage]["instances"], key=lambda i: i["index"])
    return [i["stats"] for i in instances]


def push_to_first_source(local: Any, rows: int, last_at: int) -> None:
    """`rows` rows to source instance 0 only, their event times (`at`) ending at `last_at`."""

    def address() -> str | None:
        instances = local.status()["stages"][0]["instances"]
        found = [i for i in instances if i["index"] == 0]
        return found[0]["stats"].get("ingest_address") if found else None

    endpoint = wait_for(address, 30, "source 0's ingest endpoint")
    with IngestClient(endpoint) as client:
        at = list(range(last_at - rows + 1, last_at + 1))
        table = pa.table({"user": [f"u{i % 7}" for i in range(rows)], "clicks": [1] * rows,
                          "at": at})  # fmt: skip
        assert client.push(table, batch_id="b0").accepted == rows


@pytest.mark.live
def test_an_idle_source_does_not_stall_the_watermark(tmp_path: Path) -> None:
    """Two ingest sources, rows pushed to one: with an idle timeout the keyed instances'
    watermark is that source's (highest event time less the bound), exported as a metric with
    its lag; the quiet source holds nothing back."""
    bound_ms, last_at = 2.0, 1_700_000_000_000_000
    job = event_time_job(
        tmp_path / "out", {"field": "at", "max_out_of_orderness_ms": bound_ms,
                           "idle_timeout_ms": 300})  # fmt: skip
    with running_job(tmp_path, job) as local:
        wait_for(lambda: local.status()["phase"] == "running", 120, "the job to run")
        push_to_first_source(local, 1000, last_at)
        expected = last_at - int(bound_ms * 1000)
        wait_for(
            lambda: [s.get("watermark_us") for s in stats(local, 1)] == [expected] * 2,
            30,
            "both keyed instances' watermark",
        )
        wait_for(
            lambda: stats(local, 0)[0].get("watermark_us") == expected,
            30,
            "source 0's watermark in its report",
        )
        members = local.status()["stages"][1]["instances"]
        text = urllib.request.urlopen(f"http://{members[0]['metrics']}/metrics").read().decode()
        samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line[:1] != "#")
        (mark,) = [float(v) for k, v in samples.items() if k.startswith(MetricName.WATERMARK + "{")]
        (lag,) = [
            float(v) for k, v in samples.items() if k.startswith(MetricName.WATERMARK_LAG + "{")
        ]
        assert mark == pytest.approx(expected / 1e6)
        assert lag > 0  # 2023's event times trail today's clock
        local.drain()
        wait_for(lambda: local.status()["phase"] == "finished", 30, "the job to drain")


@pytest.mark.live
def test_without_an_idle_timeout_a_quiet_source_holds_the_watermark(tmp_path: Path) -> None:
    job = event_time_job(tmp_path / "out", {"field": "at"})
    with running_job(tmp_path, job) as local:
        wait_for(lambda: local.status()["phase"] == "running", 120, "the job to run")
        push_to_first_source(local, 500, 1_700_000_000_000_000)
        wait_for(
            lambda: sum(s.get("records_in", 0) for s in stats(local, 1)) == 500,
            30,
            "the rows at the keyed instances",
        )
        wait_for(
            lambda: stats(local, 0)[0].get("watermark_us") == 1_700_000_000_000_000,
            30,
            "source 0's watermark in its report",
        )
        assert all("watermark_us" not in s for s in stats(local, 1))
        local.drain()
        wait_for(lambda: local.status()["phase"] == "finished", 30, "the job to drain")


def nexmark_job(out: Path, **extra: Any) -> dict[str, Any]:
    """NEXMark bids counted per auction, event time 5x the wall clock, with watermarks."""
    config = {"kind": "nexmark", "seed": 2, "event_rate": 1000, "total": 60_000,
              "max_disorder_ms": 20, "profile": {"rate": 5000}}  # fmt: skip
    return {
        "name": "marks",
        "graph": [
            {"kind": "source", "name": "events", "parallelism": 2, "config": config,
             "event_time": {"max_out_of_orderness_ms": 20}},
            {"kind": "keyed", "name": "per-auction", "input": "events", "key_by": "auction"},
            {"kind": "sink", "name": "out", "input": "per-auction",
             "config": {"kind": "log", "path": str(out)}},
        ],
        "batching": dict(BATCHING),
        **extra,
    }  # fmt: skip


def keyed_marks(local: Any) -> list[int | None]:
    return [s.get("watermark_us") for s in stats(local, 1)]


@pytest.mark.slow
@pytest.mark.live
def test_a_rescale_never_moves_the_watermark_backwards(tmp_path: Path) -> None:
    """While the keyed stage goes 1 -> 3 -> 2, no instance ever reports a watermark below one
    reported before (a new instance reports none until every source has told it theirs)."""
    with running_job(tmp_path, nexmark_job(tmp_path / "out")) as local:
        client = JsonClient(local.address, SERVICE)
        try:
            wait_for(lambda: any(keyed_marks(local)), 30, "a watermark")
            seen: list[int] = []

            def watch(local: Any) -> None:
                marks = [m for m in keyed_marks(local) if m is not None]
                if marks:
                    assert not seen or min(marks) >= seen[-1], (marks, seen[-1])
                    seen.append(min(marks))

            for parallelism in (3, 2):
                watch(local)
                rescale_via(local, client, parallelism, "hot-first", stage="per-auction")
                watch(local)
            wait_for(lambda: local.status()["phase"] == "finished", 60, "the job to finish")
        finally:
            client.close()
    assert len(seen) == 4 and seen[-1] > seen[0]


@pytest.mark.slow
@pytest.mark.live
def test_a_checkpoint_stores_the_watermark_and_a_recovery_resumes_from_it(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    context, port = start_run(tmp_path, nexmark_job(out))
    with context as proc:
        run = Run(proc, f"127.0.0.1:{port}")
        try:
            wait_for(lambda: run.completed() >= 3, 60, "three checkpoints")
            os.kill(run.pid_of("per-auction", 0), signal.SIGKILL)
            code = proc.wait(timeout=180)
        finally:
            run.client.close()
        assert code == 0, run.output.text()
    text = run.output.text()
    assert "recovered from checkpoint" in text, text
    store = CheckpointStore(str(tmp_path / "checkpoints"))
    metas = [store.load(c) for c in store.completed()]
    assert metas and all("per-auction" in m.watermarks for m in metas)
    marks = [m.watermarks["per-auction"] for m in sorted(metas, key=lambda m: m.id)]
    assert marks == sorted(marks)
    # The restored instances went on from the watermark of the checkpoint they restored (which
    # retention may have deleted since): one the checkpoints after it never went below.
    found = re.search(r"recovered from checkpoint (\d+)", text)
    assert found is not None, text
    logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("*per-auction*"))
    restored = re.findall(rf"from checkpoint {found[1]}, at watermark (\d+)", logs)
    assert restored and len(set(restored)) == 1, logs[-3000:]
    later = [m.watermarks["per-auction"] for m in metas if m.id > int(found[1])]
    assert all(int(restored[0]) <= mark for mark in later)
