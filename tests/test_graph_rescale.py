"""Live rescales of every keyed stage of a graph with three keyed stages in a line, under load,
with real processes: the sink's output equals a truth computed from the generator's seed.

users (count per user) -> to_region (map) -> regions (count per region) -> to_zone (map) ->
zones (count per zone) -> out. Each stage's output carries the update it came from, so the
sink's rows carry their whole path: every stage's counts per key must run 1..n (each update
applied exactly once at every stage), every (source, sequence) must arrive exactly once, and
the first stage must have applied each source's records of a key in the order sent.
(A later stage keeps the order of each sender; two updates of a key sent by two instances of
the stage before, around a move there, have no order between them.)
"""

from __future__ import annotations

import itertools
import json
import os
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from keyshift.runtime.generator import KeyGenerator
from keyshift.runtime.job import GeneratorSource
from keyshift.runtime.output_log import OutputLogReader
from keyshift.runtime.protocol import STRATEGIES
from keyshift.runtime.transport import JsonClient, RequestRefused
from tests.conftest import BATCHING, running_job, wait_for
from tests.job_fns import REGIONS, ZONES
from tests.test_recovery import Run, start_run
from tests.test_rescale import SERVICE, rescale_via, sum_out

pytestmark = pytest.mark.live

SOURCE = {"kind": "generator", "keys": 3000, "distribution": "zipf", "seed": 15,
          "profile": {"rate": 3000}}  # fmt: skip


def keyed_line(out: Path) -> dict[str, Any]:
    def nest(name: str, input: str, parallelism: int) -> dict[str, Any]:
        return {"name": name, "kind": "keyed", "input": input, "key_by": "key",
                "parallelism": parallelism,
                "operator": {"kind": "process", "function": "tests.job_fns:nest"}}  # fmt: skip

    fields = {"key": "int", "value": "str"}
    return {
        "name": "line",
        "graph": [
            {"name": "clicks", "kind": "source", "parallelism": 2, "config": SOURCE},
            {
                "name": "users",
                "kind": "keyed",
                "input": "clicks",
                "key_by": "key",
                "parallelism": 2,
                "operator": {"kind": "process", "function": "tests.job_fns:track"},
            },
            {
                "name": "to-region",
                "kind": "map",
                "input": "users",
                "function": "tests.job_fns:to_region",
                "fields": fields,
            },
            nest("regions", "to-region", 2),
            {
                "name": "to-zone",
                "kind": "map",
                "input": "regions",
                "function": "tests.job_fns:to_zone",
                "fields": fields,
            },
            nest("zones", "to-zone", 1),
            {
                "name": "out",
                "kind": "sink",
                "input": "zones",
                "parallelism": 2,
                "config": {"kind": "log", "path": str(out), "format": "jsonl"},
            },
        ],
        "batching": {**BATCHING, "max_records": 1024},
    }


def check_paths(out: Path, emitted: list[int] | None, odds: bool = False) -> None:
    """Every stage applied every update once (its counts per key run 1..n and equal the
    truth), every record took each of its ways to the sink exactly once, and the first keyed
    stages kept each source's order per key. `odds`: the fan-out-and-in job, where odd keys
    also reach regions through `odds`, and users' updates also go straight to the sink.
    `emitted` None: a drained job's, read off the output (each source's records a prefix of
    its sequence; a record lost on the way leaves a gap, found as a way lost)."""
    table = OutputLogReader(out).read_all()
    counts: dict[tuple[str, int], list[int]] = {}
    applied: dict[tuple[str, int], list[tuple[int, int, int]]] = {}  # (count, source, seq)
    arrived: Counter[tuple[str, int, int]] = Counter()
    for key, value in zip(table.column("key").to_pylist(), table.column("value").to_pylist(),
                          strict=True):  # fmt: skip
        path = json.loads(value)
        if len(path) == 3:  # a user's update, straight from users to the sink
            first, (at_first, source, seq), user = "users-out", path, key
        else:
            at_zone, (at_region, (first, user, (at_first, source, seq))) = path
            assert key == user % REGIONS % ZONES, (key, user)
            counts.setdefault(("zones", key), []).append(at_zone)
            counts.setdefault(("regions", user % REGIONS), []).append(at_region)
        counts.setdefault((first, user), []).append(at_first)
        applied.setdefault((first, user), []).append((at_first, source, seq))
        arrived[(first, source, seq)] += 1
    for (stage, key), seen in counts.items():
        ordered = sorted(seen)
        assert ordered == list(range(1, len(ordered) + 1)), (stage, key, ordered[:20])
    for (stage, user), updates in applied.items():
        last: dict[int, int] = {}
        for _, source, seq in sorted(updates):
            assert seq > last.get(source, -1), f"{stage} {user}: seq {seq} of {source} late"
            last[source] = seq
    if emitted is None:
        emitted = [1 + max(q for first, s, q in arrived if first == "users" and s == source)
                   for source in range(2)]  # fmt: skip
    spec = GeneratorSource.model_validate(SOURCE)
    ways: Counter[tuple[str, int, int]] = Counter()
    regions: Counter[int] = Counter()
    for s, n in enumerate(emitted):
        keys, _ = KeyGenerator(spec, s).records(0, n)
        for seq, user in enumerate(keys.tolist()):
            firsts = ["users", *(["users-out"] if odds else []), *(["odds"] * (odds and user % 2))]
            for first in firsts:
                ways[(first, s, seq)] += 1
            regions[user % REGIONS] += 1 + (odds and user % 2)
    assert not arrived or max(arrived.values()) == 1, "a record took one way twice"
    assert set(arrived) == set(ways), f"{len(set(ways) - set(arrived))} ways lost"
    assert {r: len(c) for (stage, r), c in counts.items() if stage == "regions"} == dict(regions)


# Every keyed stage of the line, by every strategy; regions out and in. (The fan-out graph's
# steps below scale in by the others.)
STEPS = [
    ("regions", 3, "hot-first"),
    ("users", 3, "batched"),
    ("zones", 2, "all-at-once"),
    ("regions", 1, "lazy"),
]


def rescaled_under_load(
    tmp_path: Path, job: dict[str, Any], steps: list[tuple[str, int, str]]
) -> dict[str, Any]:
    """Run `job`, rescale stage by stage (each once records have flowed since the last, each
    checked to move every group it planned and to leave its stage at the width asked), drain;
    the finished job's status."""
    with running_job(tmp_path, job) as local:
        client = JsonClient(local.address, SERVICE)
        wait_for(lambda: local.status()["phase"] == "running", 120, "the job to run")
        for stage, parallelism, strategy in steps:
            flowed = sum_out(local)
            wait_for(lambda f=flowed: sum_out(local) > f + 3000, 60, "records to flow")  # type: ignore[misc]
            result = rescale_via(local, client, parallelism, strategy, stage=stage)
            assert result["stage"] == stage and result["to"] == parallelism
            assert result["groups_moved"] == result["groups_to_move"] > 0, result
            widths = {s["name"]: s["desired"] for s in local.status()["stages"]}
            assert widths[stage] == parallelism
        local.drain()
        final = wait_for(
            lambda: (s := local.status())["phase"] == "finished" and s, 120, "the job to drain"
        )
        client.close()
    return final


@pytest.mark.parametrize("steps", [STEPS], ids=["every-stage-every-strategy"])
def test_every_keyed_stage_rescales_live_and_the_output_equals_the_truth(
    tmp_path: Path, steps: list[tuple[str, int, str]]
) -> None:
    assert {s for _, _, s in steps} == set(STRATEGIES)
    out = tmp_path / "out"
    final = rescaled_under_load(tmp_path, keyed_line(out), steps)
    emitted = [i["stats"]["emitted"] for i in final["stages"][0]["instances"]]
    assert sum(emitted) > len(steps) * 3000
    check_paths(out, emitted)


def test_rescales_of_three_stages_asked_at_once_run_in_order_and_the_output_equals_the_truth(
    tmp_path: Path,
) -> None:
    """Three stages asked for at once (two keyed stages and the sink): the first runs, the
    others wait in the coordinator's queue and run one after another in the order asked;
    a request for the stage that moves, or for a stateless stage, is refused."""
    out = tmp_path / "out"
    with running_job(tmp_path, keyed_line(out)) as local:
        client = JsonClient(local.address, SERVICE)
        wait_for(lambda: local.status()["phase"] == "running", 120, "the job to run")
        wait_for(lambda: sum_out(local) > 3000, 60, "records to flow")
        # The test is the host: users/2 starts only when `ended` below starts it, so the
        # first rescale still waits for it when the others are asked for.
        asked = [
            client.call("Rescale", {"stage": "users", "parallelism": 3}),
            client.call("Rescale", {"stage": "out", "parallelism": 1}),
            client.call("Rescale", {"stage": "regions", "parallelism": 1}),
        ]
        assert [r["phase"] == "queued" for r in asked] == [False, True, True]
        with pytest.raises(RequestRefused) as moving:
            client.call("Rescale", {"stage": "users", "parallelism": 1})
        assert f"rescale {asked[0]['id']} of stage users is still running" in str(moving.value)
        with pytest.raises(RequestRefused) as stateless:
            client.call("Rescale", {"stage": "to-zone", "parallelism": 3})
        assert "stateless map chained into the processes of stage 'regions'" in str(stateless.value)
        queued = [r["id"] for r in local.status()["queued"]]
        assert queued == [asked[1]["id"], asked[2]["id"]]

        def ended() -> list[dict[str, Any]] | None:
            status = local.status()
            local.ensure_instances(status)
            return status["rescales"] if len(status["rescales"]) == 3 else None

        history = wait_for(ended, 120, "the three rescales to end")
        assert [(r["id"], r["phase"]) for r in history] == [(r["id"], "done") for r in asked]
        for before, after in itertools.pairwise(history):
            assert after["started"] >= before["finished"]
        widths = {s["name"]: s["desired"] for s in local.status()["stages"]}
        assert (widths["users"], widths["out"], widths["regions"]) == (3, 1, 1)
        local.drain()
        final = wait_for(
            lambda: (s := local.status())["phase"] == "finished" and s, 120, "the job to drain"
        )
        client.close()
    emitted = [i["stats"]["emitted"] for i in final["stages"][0]["instances"]]
    check_paths(out, emitted)


def fan_out_and_in(out: Path) -> dict[str, Any]:
    """Fan-out at the source and at users, unions into regions and into the sink: clicks ->
    users, and clicks -> keep (odd keys) -> odds; users and odds -> (their maps) -> regions ->
    to-zone -> zones; users and zones -> out."""
    job = keyed_line(out)
    stages = {stage["name"]: stage for stage in job["graph"]}
    track = {"kind": "process", "function": "tests.job_fns:track"}
    fields = {"key": "int", "value": "str"}
    stages["regions"]["inputs"] = ["to-region", "odd-to-region"]
    del stages["regions"]["input"]
    stages["out"]["inputs"] = ["users", "zones"]
    del stages["out"]["input"]
    job["graph"] = [
        *stages.values(),
        {"name": "keep", "kind": "filter", "input": "clicks", "parallelism": 2,
         "function": "tests.pipeline_fns:keep"},
        {"name": "odds", "kind": "keyed", "input": "keep", "key_by": "key", "operator": track},
        {"name": "odd-to-region", "kind": "map", "input": "odds",
         "function": "tests.job_fns:odd_to_region", "fields": fields},
    ]  # fmt: skip
    return job


FAN_STEPS = [
    ("odds", 2, "hot-first"),
    ("regions", 1, "lazy"),
    ("zones", 2, "all-at-once"),
    ("odds", 1, "batched"),
]


def test_fan_out_and_unions_rescale_live_and_every_way_equals_the_truth(tmp_path: Path) -> None:
    """The keyed stages that fan-out and unions feed or read (odds, regions, zones) rescaled
    under load, out and in (users, which fans out, rescales in the line's test)."""
    out = tmp_path / "out"
    final = rescaled_under_load(tmp_path, fan_out_and_in(out), FAN_STEPS)
    emitted = [i["stats"]["emitted"] for i in final["stages"][0]["instances"]]
    check_paths(out, emitted, odds=True)


# 1.5k records/s without a total: the rescale (a new instance may take 10 s to start on a busy
# machine), a checkpoint after it and the crash come while the sources run, and the job drains
# once it has recovered. The checks hold at any rate; the CPU the suite spends grows with it.
CRASH_RATE = 1500


@pytest.mark.slow
def test_a_killed_instance_of_a_later_keyed_stage_recovers_every_stage(tmp_path: Path) -> None:
    """With checkpoints every 0.5 s, `keyshift run` of the graph with fan-out and unions (the
    three-stage line, and regions reading two stages); `regions` is rescaled to 3, then one
    of its instances is killed: the job goes back to its latest checkpoint (every keyed
    stage's groups and owners, `regions` at 3), and the output is still exactly the truth.
    (The line alone took as long again and covers nothing this graph does not.)"""
    out = tmp_path / "out"
    job = fan_out_and_in(out)
    job["graph"][0]["config"] = {**SOURCE, "profile": {"rate": CRASH_RATE}}
    context, port = start_run(tmp_path, job)
    with context as proc:
        run = Run(proc, f"127.0.0.1:{port}")
        try:
            wait_for(lambda: run.completed() >= 2, 120, "two checkpoints")
            started = run.client.call(
                "Rescale", {"stage": "regions", "parallelism": 3, "strategy": "hot-first"}
            )
            wait_for(
                lambda: any(r["id"] == started["id"] for r in run.status()["rescales"]),
                60,
                "the rescale",
            )
            done = run.completed()
            wait_for(lambda: run.completed() > done, 30, "a checkpoint after the rescale")
            os.kill(run.pid_of("regions", 2), signal.SIGKILL)

            def restored() -> dict[str, Any] | None:
                status = run.status_now()
                running = status and status["restored_from"] and status["phase"] == "running"
                return status if running else None

            # The checkpoint it goes back to was taken after the rescale: regions at 3.
            status = wait_for(restored, 120, "the job to run again from its checkpoint")
            assert status["restored_from"] > done
            widths = {s["name"]: s["desired"] for s in status["stages"]}
            expected = {"clicks": 2, "users": 2, "regions": 3, "zones": 1, "out": 2}
            assert widths == expected | {"odds": 1}
            again = run.completed()
            wait_for(lambda: run.completed() > again, 60, "a checkpoint after the recovery")
            os.kill(proc.pid, signal.SIGINT)  # drain
            code = proc.wait(timeout=180)
        finally:
            run.client.close()
        assert code == 0, run.output.text()
    assert "recovered from checkpoint" in run.output.text()
    check_paths(out, None, odds=True)


def test_a_new_owner_of_a_later_stage_dying_mid_move_is_recovered_from(tmp_path: Path) -> None:
    """Without checkpoints: regions' new instance is killed while its move runs; the rescale
    fails naming it, its groups go back to the old owners, the senders (users' instances)
    reroute to them, and the job goes on and finishes, no record ever applied twice. (Keyed
    by user there, so the stage has thousands of keys, most seldom hit: a slow trickle keeps
    the move running, where 61 regions would all be fetched on demand at once.)"""
    out = tmp_path / "out"
    job = keyed_line(out)
    (to_region,) = [stage for stage in job["graph"] if stage["name"] == "to-region"]
    to_region["function"] = "tests.job_fns:by_user"
    with running_job(tmp_path, job) as local:
        client = JsonClient(local.address, SERVICE)
        wait_for(lambda: local.status()["phase"] == "running", 120, "the job to run")
        wait_for(lambda: sum_out(local) > 3000, 60, "records to flow")
        slow = {"chunk_keys": 1, "trickle_keys_per_s": 1}
        client.call(
            "Rescale", {"stage": "regions", "parallelism": 3, "strategy": "lazy", "options": slow}
        )

        def moving() -> bool:
            status = local.status()
            local.ensure_instances(status)
            return bool(status["rescale"]) and status["rescale"]["phase"] == "moving"

        wait_for(moving, 60, "the rescale to start moving state")
        local.instances["regions/2"].process.kill()
        status = wait_for(lambda: (s := local.status())["rescales"] and s, 60, "the rescale")
        (result,) = status["rescales"]
        assert result["phase"] == "failed" and "regions/2" in result["error"], result
        assert "recovered at parallelism 2" in result["error"], result["error"]
        assert status["phase"] == "running" and status["lost"] == ["regions/2"]
        flowed = sum_out(local)
        wait_for(lambda: sum_out(local) > flowed + 3000, 60, "records to flow after it")
        local.drain()
        wait_for(lambda: local.status()["phase"] == "finished", 120, "the job to drain")
        client.close()
    table = OutputLogReader(out).read_all()
    arrived = Counter(tuple(json.loads(v)[1][1][2][1:]) for v in table.column("value").to_pylist())
    assert arrived and max(arrived.values()) == 1, "a record was applied twice"
