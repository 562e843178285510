"""Restarts of the control plane lose nothing: the operator (in process, against the API
emulator, tests/kube_emulator.py) and the coordinator (a real process run by the test kubelet,
tests/kube_pods.py) are restarted in the middle of a rescale and just after one, with the job's
real processes running. Afterwards every StatefulSet runs the coordinator's parallelism, no
retired pod is left crash-looping at registration, a later scale-in is acted on, the
autoscaler's memory (warm-up, the rescale it has taken) is the one from before the restart,
every rescale carried spec.migration's strategy and options, and the output is exactly once.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import pytest
import pytest_asyncio

from keyshift.operator.k8s_children import SECRET_KEY, job_secret_name
from keyshift.runtime.auth import Security
from keyshift.runtime.checkpoint_store import CheckpointStore
from keyshift.runtime.transport import JsonClient, TransportError
from tests.conftest import BATCHING
from tests.kube_emulator import CR_API, Emulator, eventually, register_resources, stored
from tests.kube_pods import PodRunner
from tests.test_k8s_operator import (
    NS,
    create,
    events_of,
    job_object,
    running_operator,
    status_writes,
    streaming_job,
)
from tests.test_rescale import check_output

pytestmark = [
    pytest.mark.asyncio,
    pytest.mark.alone,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning"),
]

SOURCE = {"kind": "generator", "keys": 2000, "distribution": "zipf", "seed": 7,
          "profile": {"rate": 1000}}  # fmt: skip
PLAN = {"strategy": "batched", "options": {"batch_groups": 64}}
MANY_KEYS = {"kind": "generator", "keys": 1_000_000, "distribution": "uniform", "seed": 7,
             "profile": {"rate": 2000}}  # fmt: skip


class JobClient:
    """The test's own calls to the job's coordinator, with the job's token: read from the
    Secret the operator creates, the first time a call is made (the job exists by then)."""

    def __init__(self, emu: Emulator, address: str) -> None:
        self.emu = emu
        self.address = address
        self._client: JsonClient | None = None

    def call(self, method: str, body: dict[str, Any] | None = None, timeout: float = 10.0) -> Any:
        if self._client is None:
            secret = stored(self.emu, "v1/secrets", NS, job_secret_name("clicks"))
            assert secret is not None, "the operator has not created the job's Secret"
            token = base64.b64decode(secret["data"][SECRET_KEY])
            self._client = JsonClient(self.address, "keyshift.Coordinator", Security(token))
        return self._client.call(method, body, timeout)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


@pytest_asyncio.fixture
async def emu() -> AsyncIterator[Emulator]:
    async with Emulator() as handler, kmock.Server(handler):
        register_resources(handler)
        yield handler


@contextlib.asynccontextmanager
async def kubelet(emu: Emulator, tmp_path: Path) -> AsyncIterator[PodRunner]:
    """The test kubelet, running the job's pods as real processes until the block ends."""
    runner = PodRunner(emu, NS, tmp_path)

    async def sync() -> None:
        while True:
            await runner.sync()
            await asyncio.sleep(0.2)

    task = asyncio.create_task(sync())
    try:
        yield runner
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        runner.stop()


def tracked(out: Path, parallelism: int, **job: Any) -> dict[str, Any]:
    return streaming_job(
        job={
            "name": "clicks",
            "source": {"config": SOURCE},
            "keyed": {"name": "track", "parallelism": parallelism,
                      "operator": {"kind": "process", "function": "tests.job_fns:track"}},
            "sink": {"config": {"kind": "log", "path": str(out), "format": "jsonl"}},
            "batching": BATCHING,
            **job,
        },
        migration=PLAN,
    )  # fmt: skip


async def scale(emu: Emulator, to: int) -> None:
    """`kubectl scale sj clicks --replicas N`; the caller waits for what it expects."""
    reply = await emu.patch(
        f"{CR_API}/namespaces/{NS}/streamingjobs/clicks/scale",
        json={"spec": {"replicas": to}},
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert reply.status == 200, await reply.text()


async def run_job(emu: Emulator, body: dict[str, Any]) -> None:
    """`kubectl apply` the StreamingJob, then wait until the operator says it runs."""
    reply = await create(emu, body)
    assert reply.status in (200, 201), await reply.text()
    await eventually(lambda: job_object(emu).get("status", {}).get("phase") == "Running", 90,
                     "the job to run")  # fmt: skip


def replicas(emu: Emulator, stage: str) -> int | None:
    sts = stored(emu, "apps/v1/statefulsets", NS, f"clicks-{stage}") or {}
    return sts.get("spec", {}).get("replicas")


def coordinator(client: JobClient) -> dict[str, Any]:
    status: dict[str, Any] = client.call("Status", None, 3.0)
    return status


async def settled(
    emu: Emulator, runner: PodRunner, client: JobClient, keyed: int, what: str
) -> None:
    """Wait until the running coordinator's keyed stage is at `keyed`, every StatefulSet runs
    what the coordinator wants, and no pod above that is left (a retired one would crash-loop
    at registration)."""

    def check() -> bool:
        try:
            status = coordinator(client)
        except TransportError:  # a restarting coordinator does not answer yet
            return False
        if status["phase"] != "running" or status["rescale"] is not None:
            return False
        for stage in status["stages"]:
            wanted = stage["desired"]
            if replicas(emu, stage["name"]) != wanted or stage["parallelism"] != wanted:
                return False
            if f"clicks-{stage['name']}-{wanted}" in runner.pods:
                return False
        return bool(status["stages"][1]["parallelism"] == keyed)

    await eventually(check, 120, what)


async def drain_and_check(client: JobClient, out: Path, source: dict[str, Any] = SOURCE) -> None:
    """Stop the sources, wait for the job to finish, and check its output is exactly once."""
    client.call("Drain", None, 5.0)
    final = await eventually(
        lambda: (s := coordinator(client))["phase"] == "finished" and s, 120, "the job to drain"
    )
    emitted = [i["stats"]["emitted"] for i in final["stages"][0]["instances"]]
    check_output(out, source, emitted)


def rescales_carried_the_plan(client: JobClient) -> None:
    for rescale in coordinator(client)["rescales"]:
        assert rescale["strategy"] == "batched", rescale
        assert rescale["options"]["batch_groups"] == 64.0, rescale


async def test_operator_restarts_mid_and_just_after_rescales_lose_nothing(
    emu: Emulator, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    # Dry run: the loop decides and keeps its memory, the test alone rescales.
    body = tracked(out, 3, autoscaler={"interval": 1, "warmup": 600, "dry_run": True})
    async with kubelet(emu, tmp_path) as runner:
        client = JobClient(emu, runner.address("clicks", NS))
        try:
            async with running_operator(emu, runner.address):
                await run_job(emu, body)
                await eventually(lambda: job_object(emu)["status"].get("handledRescale"), 30,
                                 "the operator's memory in the status")  # fmt: skip

            # A scale-in the operator started and did not see end (it was down): the one
            # started next shrinks the StatefulSet and takes the rescale's outcome (warm-up).
            client.call("Rescale", {"stage": "track", "parallelism": 2, **PLAN}, 10.0)
            await eventually(lambda: coordinator(client)["rescales"], 90, "the scale-in")
            async with running_operator(emu, runner.address):
                await settled(emu, runner, client, 2, "the StatefulSet shrunk")
                guards = await eventually(
                    lambda: (job_object(emu)["status"].get("guards") or {}).get("track", {})
                    .get("rescaledAt"), 30, "the warm-up of the scale-in",
                )  # fmt: skip

                # Restarted in the middle of a scale-out: the new operator finishes its part.
                # (The spec still says 3: the scale-in above was not made through it.)
                await scale(emu, 4)
                await eventually(lambda: coordinator(client)["rescale"], 60, "the scale-out")
            async with running_operator(emu, runner.address):
                await settled(emu, runner, client, 4, "the scale-out")
                await eventually(
                    lambda: job_object(emu)["status"]["guards"]["track"]["rescaledAt"] > guards,
                    30, "the warm-up of the scale-out",
                )  # fmt: skip

                def warming_up() -> dict[str, Any] | None:
                    """The status once the loop has decided in the warm-up (every stage then
                    has its memory, which the warm-up leaves as it is)."""
                    status = job_object(emu)["status"]
                    last = (status.get("decisions") or [{}])[-1]
                    if "warming up" in last.get("reason", "") and len(status["guards"]) == 3:
                        return status
                    return None

                kept = await eventually(warming_up, 30, "a decision in the warm-up")

            # Just after a rescale: the new operator goes on with the same memory. The warm-up
            # still holds the stage, and the rescale it had taken is not taken again.
            async with running_operator(emu, runner.address):
                writes = status_writes(emu)
                await eventually(lambda: status_writes(emu) >= writes + 3, 30, "status writes")
                held = await eventually(
                    lambda: (d := job_object(emu)["status"].get("decisions")) and d[-1], 30,
                    "a decision of the new operator",
                )  # fmt: skip
                assert "warming up after a rescale" in held["reason"], held
                status = job_object(emu)["status"]
                assert status["guards"] == kept["guards"]
                assert status["handledRescale"] == kept["handledRescale"]
                assert kept["decisions"] and kept["decisions"][-1] in status["decisions"]
                assert len(coordinator(client)["rescales"]) == 2

                # A later scale-in is acted on.
                await scale(emu, 2)
                await settled(emu, runner, client, 2, "the later scale-in")
                rescales_carried_the_plan(client)
                await drain_and_check(client, out)
        finally:
            client.close()


async def test_coordinator_restarts_mid_and_just_after_rescales_lose_nothing(
    emu: Emulator, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    checkpoints = {"interval": 2, "storage": str(tmp_path / "checkpoints")}
    body = tracked(out, 2, checkpoints=checkpoints)
    body["spec"]["checkpointClaim"] = "checkpoints"  # the kubelet runs on one file system
    async with kubelet(emu, tmp_path) as runner, running_operator(emu, runner.address):
        client = JobClient(emu, runner.address("clicks", NS))
        try:
            await run_job(emu, body)
            await scale(emu, 3)
            await settled(emu, runner, client, 3, "the scale-out")
            rescales_carried_the_plan(client)

            # Just after a rescale, once a checkpoint holds it: the restored coordinator
            # numbers its rescales from 1 again, and its scale-in (started as the autoscaler
            # or `keyshift rescale` would, not by a spec change that re-reconciles) is still
            # taken: the StatefulSet shrinks.
            done = coordinator(client)["checkpoints"]["completed"]
            await eventually(lambda: coordinator(client)["checkpoints"]["completed"] > done + 1,
                             60, "a checkpoint after the scale-out")  # fmt: skip
            first = coordinator(client)["incarnation"]
            runner.pods["clicks-coordinator-0"].stop(grace=0)
            await eventually(lambda: _incarnation(client) not in (None, first), 90,
                             "the coordinator to restart")  # fmt: skip
            await settled(emu, runner, client, 3, "the restored job")
            client.call("Rescale", {"stage": "track", "parallelism": 2, **PLAN}, 10.0)
            await settled(emu, runner, client, 2, "the scale-in after the restart")
            assert [r["id"] for r in coordinator(client)["rescales"]] == [1]

            # In the middle of a scale-out the operator has seen start: the job goes on from
            # its checkpoint, at the parallelism the checkpoint had, and the StatefulSet
            # follows it.
            second = coordinator(client)["incarnation"]
            done = coordinator(client)["checkpoints"]["completed"]
            await eventually(lambda: coordinator(client)["checkpoints"]["completed"] > done + 1,
                             60, "a checkpoint after the scale-in")  # fmt: skip
            await scale(emu, 4)  # the spec still says 3
            await eventually(lambda: job_object(emu)["status"].get("phase") == "Rescaling", 60,
                             "the operator to see the scale-out")  # fmt: skip
            runner.pods["clicks-coordinator-0"].stop(grace=0)
            await eventually(lambda: _incarnation(client) not in (None, second), 90,
                             "the coordinator to restart")  # fmt: skip
            await settled(emu, runner, client, 2, "the job restored mid-rescale")
            await eventually(lambda: job_object(emu)["status"]["parallelism"] == 2, 30,
                             "the status to say so")  # fmt: skip
            await drain_and_check(client, out)
        finally:
            client.close()


async def test_a_keyed_pod_killed_mid_move_recovers_with_that_reason(
    emu: Emulator, tmp_path: Path
) -> None:
    """An old owner's pod killed (no grace) in the middle of a hot-first scale-out: the job
    recovers from its checkpoint (never Failed), the recovery's reason names the killed
    instance however it was noticed (its command stream, or the new owner's fetch from it),
    and the output is exactly once."""
    out = tmp_path / "out"
    storage = str(tmp_path / "checkpoints")
    body = tracked(out, 2, checkpoints={"interval": 1, "storage": storage})
    # Over a million keys a record seldom meets a key with state again, so fetches on demand
    # cannot finish the move early, and a trickle of 20 keys/s makes the push of the thousands
    # of moving keys last: the kill lands in the middle of the move.
    body["spec"]["job"]["source"]["config"] = MANY_KEYS
    body["spec"]["migration"] = {
        "strategy": "hot-first", "options": {"chunk_keys": 8, "trickle_keys_per_s": 20}
    }  # fmt: skip
    body["spec"]["checkpointClaim"] = "checkpoints"  # the kubelet runs on one file system
    async with kubelet(emu, tmp_path) as runner, running_operator(emu, runner.address):
        client = JobClient(emu, runner.address("clicks", NS))
        try:
            await run_job(emu, body)
            await eventually(lambda: coordinator(client)["checkpoints"]["completed"] >= 2, 60,
                             "two checkpoints")  # fmt: skip
            first = coordinator(client)["incarnation"]
            await scale(emu, 3)

            def moving() -> bool:
                rescale = coordinator(client)["rescale"]
                return bool(rescale) and rescale["phase"] == "moving"

            await eventually(moving, 60, "the scale-out to move state")
            runner.pods["clicks-track-0"].stop(grace=0)  # no grace: SIGKILL right after SIGTERM
            await eventually(lambda: _incarnation(client) not in (None, first), 90,
                             "the coordinator to restart")  # fmt: skip
            await settled(emu, runner, client, 2, "the job restored at the checkpoint's width")
            status = await eventually(
                lambda: (s := job_object(emu)["status"])["recoveries"]["total"] and s, 30,
                "the recovery in the StreamingJob's status",
            )  # fmt: skip
            assert status["recoveries"]["lastReason"] and status["recoveries"]["lastSeconds"] > 0
            # The recovery from the kill (on a loaded machine a later one may follow).
            recovery = CheckpointStore(storage).recoveries()[0]
            assert recovery["reason"].startswith("instance track/0"), recovery
            assert not any(e["reason"] == "Restarting" for e in events_of(emu))  # never Failed
            await drain_and_check(client, out, MANY_KEYS)
        finally:
            client.close()


async def test_a_killed_keyed_pod_is_recovered_locally(emu: Emulator, tmp_path: Path) -> None:
    """A keyed pod killed with no rescale running: the coordinator stays up (its incarnation
    unchanged), waits for the kubelet to start the pod again and rewinds the others in place;
    the StreamingJob's status says the recovery was local, and the output is exactly once."""
    out = tmp_path / "out"
    storage = str(tmp_path / "checkpoints")
    body = tracked(out, 2, checkpoints={"interval": 1, "storage": storage})
    body["spec"]["checkpointClaim"] = "checkpoints"  # the kubelet runs on one file system
    async with kubelet(emu, tmp_path) as runner, running_operator(emu, runner.address):
        client = JobClient(emu, runner.address("clicks", NS))
        try:
            await run_job(emu, body)
            await eventually(lambda: coordinator(client)["checkpoints"]["completed"] >= 2, 60,
                             "two checkpoints")  # fmt: skip
            first = coordinator(client)["incarnation"]
            runner.pods["clicks-track-1"].stop(grace=0)
            status = await eventually(
                lambda: (s := job_object(emu)["status"])["recoveries"]["total"] and s, 90,
                "the recovery in the StreamingJob's status",
            )  # fmt: skip
            recoveries = status["recoveries"]
            assert recoveries["lastMode"] == "local", recoveries
            assert recoveries["lastReason"].startswith("instance track/1"), recoveries
            assert coordinator(client)["incarnation"] == first
            await drain_and_check(client, out)
        finally:
            client.close()


async def test_a_failed_job_is_restarted_as_its_strategy_says_and_then_given_up(
    emu: Emulator, tmp_path: Path
) -> None:
    """A checkpointed job whose coordinator failed (an instance failed: its function raises on
    one record) is restarted by the operator from its latest checkpoint, at once the first
    time; the restarted job replays that record and fails again, and with one restart allowed
    in a row the operator gives up: Failed, with the reason and the restart it made."""
    out = tmp_path / "out"
    checkpoints = {"interval": 1, "storage": str(tmp_path / "checkpoints")}
    body = tracked(out, 1, checkpoints=checkpoints, restart={"max_attempts": 1})
    body["spec"]["job"]["keyed"]["operator"]["function"] = "tests.job_fns:track_until_seq_3000"
    body["spec"]["checkpointClaim"] = "checkpoints"  # the kubelet runs on one file system
    async with kubelet(emu, tmp_path) as runner, running_operator(emu, runner.address):
        client = JobClient(emu, runner.address("clicks", NS))
        try:
            await run_job(emu, body)
            failed = await eventually(lambda: _failed(client), 90, "the job to fail")
            assert "record 3000 of source 0" in failed["errors"][0]
            restarted = await eventually(
                lambda: (i := _incarnation(client)) not in (None, failed["incarnation"]) and i,
                60, "the operator to restart the coordinator",
            )  # fmt: skip
            assert any(e["reason"] == "Restarting" for e in events_of(emu))
            again = await eventually(lambda: _failed(client), 120, "the restarted job to fail")
            assert again["incarnation"] == restarted and again["restored_from"] is not None

            status = await eventually(
                lambda: (s := job_object(emu)["status"])["phase"] == "Failed" and s, 30,
                "the operator to give up",
            )  # fmt: skip
            (degraded,) = [c for c in status["conditions"] if c["type"] == "Degraded"]
            assert degraded["reason"] == "RestartsExhausted", degraded
            assert "not restarted again: 2 failures in a row" in degraded["message"], degraded
            assert len(status["restarts"]["failures"]) == 2
            # The restarted job's recovery, with the failure's reason, timed from it.
            recoveries = status["recoveries"]
            assert recoveries["total"] == 1 and recoveries["lastSeconds"] > 0, recoveries
            assert "record 3000 of source 0" in recoveries["lastReason"], recoveries
            writes = status_writes(emu)
            await eventually(lambda: status_writes(emu) >= writes + 3, 30, "status writes")
            assert _incarnation(client) == restarted  # and it stays given up
        finally:
            client.close()


def _failed(client: JobClient) -> dict[str, Any] | None:
    try:
        status = coordinator(client)
    except TransportError:  # not answering while it restarts
        return None
    return status if status["phase"] == "failed" else None


def _incarnation(client: JobClient) -> str | None:
    try:
        return str(coordinator(client)["incarnation"])
    except TransportError:  # not answering while it restarts
        return None


async def test_the_deprecated_alias_warns_on_the_job(emu: Emulator) -> None:
    body = streaming_job(job={"name": "clicks", "autoscaler": {"strategy": "batched"}})
    async with running_operator(emu):
        reply = await create(emu, body)
        assert reply.status in (200, 201), await reply.text()
        event = await eventually(
            lambda: next((e for e in events_of(emu) if e["reason"] == "Deprecated"), None),
            20, "a Deprecated event",
        )  # fmt: skip
        assert event["type"] == "Warning"
        assert "spec.job.autoscaler.strategy is deprecated" in event["message"]


async def test_an_operator_restarted_mid_decision_goes_on_with_its_pending_steps(
    emu: Emulator, tmp_path: Path
) -> None:
    """An edit of two stages' parallelism is one decision, applied one rescale at a time: the
    operator stops once the first has started and the second waits in its status
    (`pendingRescales`); the operator started next goes on with it, the sink's rescale too,
    and the output is still exactly once."""
    out = tmp_path / "out"
    track = {"kind": "process", "function": "tests.job_fns:track"}
    graph: list[dict[str, Any]] = [
        {"name": "clicks", "kind": "source", "config": SOURCE},
        {"name": "track", "kind": "keyed", "input": "clicks", "key_by": "key",
         "operator": track},
        {"name": "out", "kind": "sink", "input": "track", "partitions": 2,
         "config": {"kind": "log", "path": str(out), "format": "jsonl"}},
    ]  # fmt: skip
    body = streaming_job(job={"name": "clicks", "graph": graph, "batching": BATCHING},
                         output={"claim": "clicks-out"})  # fmt: skip
    async with kubelet(emu, tmp_path) as runner:
        client = JobClient(emu, runner.address("clicks", NS))
        try:
            async with running_operator(emu, runner.address):
                await run_job(emu, body)
                edited = copy.deepcopy(graph)
                edited[1]["parallelism"], edited[2]["parallelism"] = 2, 2
                reply = await emu.patch(
                    f"{CR_API}/namespaces/{NS}/streamingjobs/clicks",
                    json={"spec": {"job": {"graph": edited}}},
                    headers={"Content-Type": "application/merge-patch+json"},
                )
                assert reply.status == 200, await reply.text()
                pending = await eventually(
                    lambda: (job_object(emu)["status"].get("pendingRescales") or {}).get("queued"),
                    60, "the second step waiting in the status",
                )  # fmt: skip
                assert pending == [{"stage": "out", "parallelism": 2}]

                def pending_steps() -> dict[str, Any]:
                    stages = job_object(emu)["status"].get("stages", [])
                    return {s["name"]: s.get("pending") for s in stages}

                # Each stage shows its step still to come, while it is to come.
                await eventually(lambda: pending_steps().get("out") == 2, 30, "out's step shown")
            async with running_operator(emu, runner.address):

                def done() -> list[tuple[str, int, str]] | None:
                    try:
                        made = coordinator(client)["rescales"]
                    except TransportError:
                        return None
                    steps = [(r["stage"], r["to"], r["phase"]) for r in made]
                    return steps if len(steps) >= 2 else None

                assert await eventually(done, 120, "both steps") == [
                    ("track", 2, "done"),
                    ("out", 2, "done"),
                ]

                def nothing_pending() -> bool:
                    pending = job_object(emu)["status"].get("pendingRescales") or {}
                    return not pending.get("started") and not pending.get("queued")

                await eventually(
                    lambda: (replicas(emu, "track"), replicas(emu, "out")) == (2, 2)
                    and nothing_pending()
                    and not any(pending_steps().values()),
                    60, "the StatefulSets at 2 and nothing pending",
                )  # fmt: skip
                await drain_and_check(client, out)
        finally:
            client.close()
