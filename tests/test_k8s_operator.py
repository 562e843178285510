"""The operator against a Kubernetes API over real HTTP (kmock's emulator, tests/kube_emulator.py):
reconcile (create, update, resume, delete, idempotence, invalid specs), and the full loop with
real keyshift processes run by a test-side kubelet (tests/kube_pods.py): DS2 scales a job out
from its real metrics, the StatefulSet grows, state moves live, the output stays exactly-once."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import kmock
import kopf
import pytest
import pytest_asyncio
from kubernetes_asyncio import client as k8s

from keyshift.operator.k8s_children import ChildOptions, stage_stateful_set
from keyshift.operator.k8s_operator import OperatorConfig, build_registry, observed_phase
from keyshift.operator.scaling_metrics import ScrapeSource
from keyshift.operator.streamingjob import StreamingJobSpec
from tests.conftest import BATCHING, target_module
from tests.kube_emulator import (
    CR,
    CR_API,
    Emulator,
    OperatorThread,
    eventually,
    listed,
    register_resources,
    stored,
)
from tests.kube_pods import PodRunner
from tests.prometheus_server import free_port
from tests.test_rescale import check_output

NS = "jobs"
MERGE = {"Content-Type": "application/merge-patch+json"}

pytestmark = [
    pytest.mark.asyncio,
    pytest.mark.alone,
    pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning"),
]


def streaming_job(name: str = "clicks", **spec: Any) -> dict[str, Any]:
    job = {
        "name": name,
        "source": {"config": {"kind": "generator", "keys": 2000, "profile": {"rate": 2000}}},
        "keyed": {"name": "counts", "parallelism": 2},
        "sink": {"config": {"kind": "log", "path": "/data/out", "format": "jsonl"}},
    }
    return {
        "apiVersion": "keyshift.io/v1alpha1",
        "kind": "StreamingJob",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"image": "ghcr.io/keyshift/keyshift:0.1.0", "job": job, **spec},
    }


@pytest_asyncio.fixture
async def emu() -> AsyncIterator[Emulator]:
    async with Emulator() as handler, kmock.Server(handler):
        register_resources(handler)
        yield handler


def operator_config(
    emu: Emulator, coordinator_address: Any = None, children: ChildOptions | None = None
) -> OperatorConfig:
    url = str(emu.url)

    async def api() -> k8s.ApiClient:
        return k8s.ApiClient(k8s.Configuration(host=url))

    config = OperatorConfig(
        api_client=api, login=lambda **_: kopf.ConnectionInfo(server=url, default_namespace=NS)
    )
    if coordinator_address is not None:
        config.coordinator_address = coordinator_address
    if children is not None:
        config.children = children
    return config


@contextlib.asynccontextmanager
async def running_operator(
    emu: Emulator,
    coordinator_address: Any = None,
    children: ChildOptions | None = None,
    config: OperatorConfig | None = None,
) -> AsyncIterator[OperatorThread]:
    config = config or operator_config(emu, coordinator_address, children)
    operator = OperatorThread(build_registry(config))
    await operator.start()
    try:
        await eventually(
            lambda: any(r.resource == kmock.resource(CR) and r.action == kmock.action.WATCH
                        for r in list(emu)),
            10, "the operator to watch StreamingJobs",
        )  # fmt: skip
        yield operator
    finally:
        await operator.stop()
        config.close()  # as `keyshift operator` does once kopf has stopped


async def scale_to(emu: Emulator, replicas: int, standby: int = 0) -> None:
    """`kubectl scale sj clicks --replicas N`, and wait until it is done (the StatefulSet
    runs `standby` pods more)."""
    reply = await emu.patch(f"{CR_API}/namespaces/{NS}/streamingjobs/clicks/scale",
                            json={"spec": {"replicas": replicas}}, headers=MERGE)  # fmt: skip
    assert reply.status == 200, await reply.text()

    def done() -> bool:
        status = job_object(emu)["status"]
        rescales = status.get("rescales") or [{}]
        sts = stored(emu, "apps/v1/statefulsets", NS, "clicks-counts") or {}
        return (
            status.get("parallelism") == replicas
            and rescales[-1].get("to") == replicas
            and rescales[-1].get("phase") == "done"
            and sts.get("spec", {}).get("replicas") == replicas + standby
        )

    await eventually(done, 60, f"the keyed stage at {replicas}")


def status_writes(emu: Emulator) -> int:
    return sum(
        1 for r in list(emu)
        if r.resource == kmock.resource(CR) and r.subresource == "status"
        and r.action == kmock.action.UPDATE
    )  # fmt: skip


@contextlib.asynccontextmanager
async def job_running_in_cluster(
    emu: Emulator, tmp_path: Path, body: dict[str, Any]
) -> AsyncIterator[PodRunner]:
    """The operator, a test-side kubelet running the pods as real processes, and the job,
    created and running; everything stopped on exit."""
    runner = PodRunner(emu, NS, tmp_path)

    async def kubelet() -> None:
        while True:
            await runner.sync()
            await asyncio.sleep(0.2)

    task = asyncio.create_task(kubelet())
    try:
        async with running_operator(emu, runner.address):
            reply = await create(emu, body)
            assert reply.status in (200, 201), await reply.text()
            await eventually(lambda: job_object(emu).get("status", {}).get("phase") == "Running",
                             60, "the job to run")  # fmt: skip
            yield runner
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        runner.stop()


async def create(emu: Emulator, body: dict[str, Any]) -> Any:
    return await emu.post(f"{CR_API}/namespaces/{NS}/streamingjobs", json=body)


def job_object(emu: Emulator, name: str = "clicks") -> dict[str, Any]:
    return stored(emu, CR, NS, name) or {}


def owned_children(emu: Emulator, name: str = "clicks") -> dict[tuple[str, str], dict[str, Any]]:
    found = {}
    for resource in ("v1/configmaps", "v1/services", "apps/v1/deployments",
                     "apps/v1/statefulsets", "networking.k8s.io/v1/networkpolicies",
                     "policy/v1/poddisruptionbudgets"):  # fmt: skip
        for obj in listed(emu, resource, NS):
            owners = obj["metadata"].get("ownerReferences", [])
            if any(o["kind"] == "StreamingJob" and o["name"] == name for o in owners):
                found[(obj["kind"], obj["metadata"]["name"])] = obj
    return found


def content(obj: dict[str, Any]) -> dict[str, Any]:
    """An object without what every write changes."""
    obj = copy.deepcopy(obj)
    for key in ("resourceVersion", "generation", "managedFields"):
        obj["metadata"].pop(key, None)
    obj.pop("status", None)
    return obj


def events_of(emu: Emulator, name: str = "clicks") -> list[dict[str, Any]]:
    return [e for e in listed(emu, "v1/events", NS) if e["involvedObject"].get("name") == name]


def condition(emu: Emulator, kind: str) -> dict[str, Any]:
    conditions = job_object(emu).get("status", {}).get("conditions", [])
    return next((c for c in conditions if c["type"] == kind), {})


async def degraded_condition(emu: Emulator) -> dict[str, Any]:
    """The job's Degraded condition, once it is True."""
    found: dict[str, Any] = await eventually(
        lambda: (c := condition(emu, "Degraded")).get("status") == "True" and c,
        20, "the Degraded condition",
    )  # fmt: skip
    return found


EXPECTED_CHILDREN = {
    ("ConfigMap", "clicks-job"),
    ("Deployment", "clicks-coordinator"),
    ("Service", "clicks-coordinator"),
    ("Service", "clicks-source"),
    ("StatefulSet", "clicks-source"),
    ("Service", "clicks-counts"),
    ("StatefulSet", "clicks-counts"),
    ("Service", "clicks-sink"),
    ("StatefulSet", "clicks-sink"),
}


async def test_create_update_resume_delete(emu: Emulator) -> None:
    async with running_operator(emu):
        reply = await create(emu, streaming_job())
        assert reply.status in (200, 201), await reply.text()
        await eventually(lambda: set(owned_children(emu)) == EXPECTED_CHILDREN, 20, "children")
        counts = owned_children(emu)[("StatefulSet", "clicks-counts")]
        assert counts["spec"]["replicas"] == 2
        uid = job_object(emu)["metadata"]["uid"]
        assert all(
            c["metadata"]["ownerReferences"][0]["uid"] == uid for c in owned_children(emu).values()
        )
        status = await eventually(
            lambda: (s := job_object(emu).get("status", {})).get("observedGeneration") == 1 and s,
            20, "the status",
        )  # fmt: skip
        assert status["phase"] == "Pending"  # nothing runs the pods here
        assert status["selector"] == "keyshift.io/job=clicks,keyshift.io/stage=counts"
        assert condition(emu, "Degraded")["status"] == "False"
        await eventually(lambda: any(e["reason"] == "Reconciled" for e in events_of(emu)), 10,
                         "a Reconciled event")  # fmt: skip

        # An update of the image reaches every workload; the rescaled replicas are kept.
        await emu.patch(f"{CR_API}/namespaces/{NS}/streamingjobs/clicks",
                        json={"spec": {"image": "ghcr.io/keyshift/keyshift:0.2.0"}},
                        headers=MERGE)  # fmt: skip
        await emu.patch(f"/apis/apps/v1/namespaces/{NS}/statefulsets/clicks-counts",
                        json={"spec": {"replicas": 3}}, headers=MERGE)  # fmt: skip

        def updated() -> bool:
            sets = [c for (kind, _), c in owned_children(emu).items() if kind == "StatefulSet"]
            images = {s["spec"]["template"]["spec"]["containers"][0]["image"] for s in sets}
            return images == {"ghcr.io/keyshift/keyshift:0.2.0"}

        await eventually(updated, 20, "the new image on every StatefulSet")
        assert owned_children(emu)[("StatefulSet", "clicks-counts")]["spec"]["replicas"] == 3
        await eventually(lambda: job_object(emu)["status"].get("observedGeneration") == 2, 20,
                         "observedGeneration 2")  # fmt: skip
        before = {k: content(v) for k, v in owned_children(emu).items()}

    # Resume after an operator restart: the same children, nothing else changes.
    async with running_operator(emu):
        await eventually(
            lambda: sum(e["reason"] == "Reconciled" for e in events_of(emu)) >= 3, 20,
            "a reconcile on resume",
        )  # fmt: skip
        assert {k: content(v) for k, v in owned_children(emu).items()} == before

        reply = await emu.delete(f"{CR_API}/namespaces/{NS}/streamingjobs/clicks")
        assert reply.status == 200
        await eventually(lambda: stored(emu, CR, NS, "clicks") is None, 20, "the job to go")


def scrapers() -> list[threading.Thread]:
    """The operator's scraping threads (keyshift.operator.scaling_metrics) that are alive."""
    return [t for t in threading.enumerate() if target_module(t) == ScrapeSource.__module__]


async def test_a_deleted_job_and_a_stopped_operator_leave_nothing_running(emu: Emulator) -> None:
    """A deleted job's runtime parts are closed (its scraper stops knocking at the ports its
    pods had) and its autoscaler's series go; those the operator holds when it stops are
    closed once kopf has stopped, as `keyshift operator` does."""
    config = operator_config(emu)
    autoscaled = {"interval": 1, "dry_run": True}
    async with running_operator(emu, config=config):
        clicks = streaming_job()
        clicks["spec"]["job"]["autoscaler"] = autoscaled
        reply = await create(emu, clicks)
        assert reply.status in (200, 201), await reply.text()
        await eventually(lambda: f"{NS}/clicks" in config.held and len(scrapers()) == 1, 20,
                         "the job's autoscaler to scrape")  # fmt: skip
        assert f"{NS}/clicks" in config.exported
        reply = await emu.delete(f"{CR_API}/namespaces/{NS}/streamingjobs/clicks")
        assert reply.status == 200
        await eventually(lambda: not config.held and not scrapers(), 20, "the parts to close")
        assert f"{NS}/clicks" not in config.exported

        views = streaming_job("views")
        views["spec"]["job"]["autoscaler"] = autoscaled
        reply = await create(emu, views)
        assert reply.status in (200, 201), await reply.text()
        await eventually(lambda: f"{NS}/views" in config.held and len(scrapers()) == 1, 20,
                         "the second job's autoscaler to scrape")  # fmt: skip
    assert not config.held and not scrapers()


ISOLATION = ChildOptions.model_validate(
    {
        "jobImage": "ghcr.io/keyshift/keyshift@sha256:" + "0f" * 32,
        "networkPolicy": {
            "operator": {"namespaceLabels": {"kubernetes.io/metadata.name": "keyshift"},
                         "podLabels": {"app.kubernetes.io/component": "operator"}},
            "prometheus": {"namespaceLabels": {}, "podLabels": {"app": "prometheus"}},
            "sparkClients": [{"podLabels": {"spark-role": "driver"}}],
        },
        "podDisruptionBudget": {"maxUnavailable": 1},
    }
)  # fmt: skip


async def test_network_policy_budgets_and_the_default_image_are_children_too(
    emu: Emulator,
) -> None:
    body = streaming_job()
    del body["spec"]["image"]
    async with running_operator(emu, children=ISOLATION):
        reply = await create(emu, body)
        assert reply.status in (200, 201), await reply.text()
        expected = (
            EXPECTED_CHILDREN
            | {("NetworkPolicy", "clicks")}
            | {("PodDisruptionBudget", f"clicks-{stage}") for stage in ("source", "counts", "sink")}
        )
        await eventually(lambda: set(owned_children(emu)) == expected, 20, "children")
        found = owned_children(emu)
        uid = job_object(emu)["metadata"]["uid"]
        # Owned by the job: they go with it.
        assert all(c["metadata"]["ownerReferences"][0]["uid"] == uid for c in found.values())
        policy = found[("NetworkPolicy", "clicks")]["spec"]
        assert policy["podSelector"] == {"matchLabels": {"keyshift.io/job": "clicks"}}
        assert [p["port"] for p in policy["ingress"][3]["ports"]] == [7000]
        budget = found[("PodDisruptionBudget", "clicks-counts")]["spec"]
        assert budget["selector"]["matchLabels"] == {
            "keyshift.io/job": "clicks",
            "keyshift.io/stage": "counts",
        }
        images = {
            c["spec"]["template"]["spec"]["containers"][0]["image"]
            for (kind, _), c in found.items()
            if kind in ("Deployment", "StatefulSet")
        }
        assert images == {ISOLATION.job_image}

        # An update reaches the policy: an ingest port is opened to the Spark clients. (Once
        # kopf has finished with the creation: an edit before that counts as handled.)
        await eventually(
            lambda: "kopf.zalando.org/last-handled-configuration"
            in job_object(emu)["metadata"].get("annotations", {}),
            20, "kopf to finish the creation",
        )  # fmt: skip
        job = {"source": {"config": {"kind": "ingest", "port": 7300, "keys": None,
                                     "profile": None}}}  # fmt: skip
        reply = await emu.patch(f"{CR_API}/namespaces/{NS}/streamingjobs/clicks",
                                json={"spec": {"job": job}}, headers=MERGE)  # fmt: skip
        assert reply.status == 200, await reply.text()

        def opened() -> bool:
            policy = owned_children(emu)[("NetworkPolicy", "clicks")]["spec"]
            return [p["port"] for p in policy["ingress"][3]["ports"]] == [7000, 7300]

        await eventually(opened, 20, "the ingest port in the NetworkPolicy")
        # The policy is the first child applied: let the reconcile finish before stopping.
        await eventually(lambda: job_object(emu)["status"].get("observedGeneration") == 2, 20,
                         "observedGeneration 2")  # fmt: skip


async def test_a_job_without_an_image_degrades_when_the_operator_has_none(emu: Emulator) -> None:
    body = streaming_job()
    del body["spec"]["image"]
    async with running_operator(emu):
        reply = await create(emu, body)
        assert reply.status in (200, 201), await reply.text()
        degraded = await degraded_condition(emu)
        assert "spec.image is not set" in degraded["message"]
        assert owned_children(emu) == {}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"migration": {"strategy": "batched", "options": {"teleport": 1}}}, "teleport"),
        ({"job": {"name": "clicks", "keyed": {"name": "counts", "parallelism": 9},
                  "autoscaler": {"bounds": {"max_parallelism": 4}}}}, "outside the autoscaler"),
        ({"job": {"name": "clicks", "autoscaler": {"stages": {"nope": {}}}}}, "not stages"),
    ],
)  # fmt: skip
async def test_what_the_schema_cannot_express_degrades_without_children(
    emu: Emulator, change: dict[str, Any], message: str
) -> None:
    body = streaming_job()
    body["spec"].update(change)
    async with running_operator(emu):
        reply = await create(emu, body)
        assert reply.status in (200, 201), await reply.text()
        degraded = await degraded_condition(emu)
        assert degraded["reason"] == "InvalidSpec" and message in degraded["message"]
        assert job_object(emu)["status"]["phase"] == "Degraded"
        await eventually(lambda: any(e["reason"] == "InvalidSpec" for e in events_of(emu)), 10,
                         "an InvalidSpec event")  # fmt: skip
        assert owned_children(emu) == {}


@pytest.mark.parametrize(
    "spec",
    [
        {"job": {"name": "clicks", "keyed": {"parallelism": 0}}},
        {"job": {"name": "clicks"}, "migration": {"strategy": "teleport"}},
        {"job": {"name": "clicks", "max_key_groups": 0}},
        {"image": 7, "job": {"name": "clicks"}},
        {"job": "not a mapping"},
        {"job": {"name": "clicks", "keyed": {"standby": 9}}},
        {"job": {"name": "clicks", "keyed": {"standby": -1}}},
    ],
)
async def test_the_schema_refuses_invalid_jobs(emu: Emulator, spec: dict[str, Any]) -> None:
    body = streaming_job()
    body["spec"] = {"image": "x", **spec}
    reply = await create(emu, body)
    assert reply.status == 422, await reply.text()
    assert stored(emu, CR, NS, "clicks") is None


async def test_full_loop_ds2_scales_out_a_running_job_and_its_output_stays_exact(
    emu: Emulator, tmp_path: Path
) -> None:
    """Real processes for the pods; DS2 reads them (direct scraping), the StatefulSet grows,
    state moves live, and every record is counted once."""
    out = tmp_path / "out"
    total = 1000 * 5 + 8000 * 25
    source = {
        "kind": "generator",
        "keys": 3000,
        "distribution": "zipf",
        "seed": 5,
        "total": total,
        "profile": {"kind": "points", "points": [[0, 1000], [5, 8000]]},
    }
    body = streaming_job(job={
        "name": "clicks",
        "source": {"config": source},
        "keyed": {"name": "track", "parallelism": 1,
                  "operator": {"kind": "process", "function": "tests.job_fns:slow_track"}},
        "sink": {"config": {"kind": "log", "path": str(out), "format": "jsonl"}},
        "batching": {**BATCHING, "max_records": 1024},
        "autoscaler": {"interval": 1, "metrics_window": 5, "warmup": 5,
                       "bounds": {"max_parallelism": 3}},
    }, migration={"strategy": "batched", "options": {"batch_groups": 64}})  # fmt: skip
    async with job_running_in_cluster(emu, tmp_path, body):
        # Instances register before their rescale is done: wait for both.
        await eventually(
            lambda: job_object(emu)["status"].get("parallelism", 0) >= 2
            and any(r["phase"] == "done" for r in job_object(emu)["status"].get("rescales", [])),
            90, "a scale-out",
        )  # fmt: skip
        sts = stored(emu, "apps/v1/statefulsets", NS, "clicks-track") or {}
        assert sts["spec"]["replicas"] >= 2
        status = job_object(emu)["status"]
        ups = [d for d in status["decisions"] if d["action"] == "scale_up"]
        assert ups and "true rate" in ups[0]["reason"] and ups[0]["inputs"]["target_rate"] > 0
        assert any(r["phase"] == "done" for r in status["rescales"]), status["rescales"]
        # The autoscaler's rescales carry spec.migration to the coordinator.
        assert all(r["strategy"] == "batched" and r["options"]["batch_groups"] == 64
                   for r in status["rescales"]), status["rescales"]  # fmt: skip
        await eventually(
            lambda: any(e["reason"] == "AutoscalerDecision" for e in events_of(emu)), 20,
            "an AutoscalerDecision event",
        )  # fmt: skip
        await eventually(lambda: job_object(emu)["status"].get("phase") == "Finished", 120,
                         "the job to finish")  # fmt: skip
        await eventually(
            lambda: (stored(emu, "apps/v1/statefulsets", NS, "clicks-track") or {})
            .get("spec", {}).get("replicas") == 0,
            20, "the finished job's workers to be scaled to zero",
        )  # fmt: skip
    check_output(out, source, [total])


async def test_kubectl_scale_rescales_live_and_a_dead_prometheus_is_only_a_reason(
    emu: Emulator, tmp_path: Path
) -> None:
    """The scale subresource moves the running job's keyed stage; the autoscaler, pointed at a
    Prometheus that is not there, decides nothing and says why, and the job runs on."""
    nobody = f"http://127.0.0.1:{free_port()}"
    body = streaming_job(job={
        "name": "clicks",
        "source": {"config": {"kind": "generator", "keys": 2000,
                              "profile": {"rate": 3000}}},
        "keyed": {"name": "counts", "parallelism": 1},
        "sink": {"config": {"kind": "log", "path": str(tmp_path / "out"), "format": "none"}},
        "autoscaler": {"interval": 1, "prometheus_url": nobody},
    })  # fmt: skip
    async with job_running_in_cluster(emu, tmp_path, body):
        message = await eventually(
            lambda: "no decision: Prometheus at" in (m := job_object(emu)["status"].get(
                "message", "")) and m, 30, "the reason in the status")  # fmt: skip
        assert nobody in message
        await eventually(
            lambda: any(e["reason"] == "AutoscalerNoDecision" for e in events_of(emu)), 20,
            "an AutoscalerNoDecision event",
        )  # fmt: skip
        scale = await emu.get(f"{CR_API}/namespaces/{NS}/streamingjobs/clicks/scale")
        assert (await scale.json())["spec"]["replicas"] == 1
        for replicas in (3, 2, 3):
            await scale_to(emu, replicas)
        assert any(e["reason"] == "ManualRescale" for e in events_of(emu))
        assert job_object(emu)["status"]["phase"] in ("Running", "Rescaling")

        # An update re-reconciles: the rescales already done (a scale-in among them) must not
        # be replayed onto the StatefulSet.
        await emu.patch(f"{CR_API}/namespaces/{NS}/streamingjobs/clicks",
                        json={"spec": {"resources": {"limits": {"cpu": "2"}}}},
                        headers=MERGE)  # fmt: skip
        await eventually(lambda: job_object(emu)["status"].get("observedGeneration", 0) >= 5, 30,
                         "the update to be reconciled")  # fmt: skip
        writes = status_writes(emu)
        await eventually(lambda: status_writes(emu) >= writes + 3, 30, "three status updates")
        sts = stored(emu, "apps/v1/statefulsets", NS, "clicks-counts") or {}
        assert sts["spec"]["replicas"] == 3


async def test_standby_pods_wait_warm_a_scale_out_takes_one_and_a_deleted_one_comes_back(
    emu: Emulator, tmp_path: Path
) -> None:
    """`standby: 1`: the keyed StatefulSet runs one pod more than the parallelism; a scale-out
    makes that pod, already running, its new instance, and the grown StatefulSet starts the
    next standby; a standby pod deleted is made again and the job never notices."""
    body = streaming_job(job={
        "name": "clicks",
        "source": {"config": {"kind": "generator", "keys": 500, "profile": {"rate": 500}}},
        "keyed": {"name": "counts", "parallelism": 1, "standby": 1},
        "sink": {"config": {"kind": "log", "path": str(tmp_path / "out"), "format": "none"}},
    })  # fmt: skip
    logs = tmp_path / "logs"

    def counts() -> dict[str, Any]:
        stages = job_object(emu).get("status", {}).get("stages", [])
        return next((s for s in stages if s["name"] == "counts"), {})

    def waiting(pod: str) -> bool:
        """The coordinator holds pod's process as a standby."""
        pid = runner.pods[pod].pid if pod in runner.pods else None
        text = (logs / "clicks-coordinator-0.log").read_text()
        return f"standby of counts waiting (pid {pid})" in text and counts().get("standbys") == 1

    async with job_running_in_cluster(emu, tmp_path, body) as runner:
        await eventually(lambda: waiting("clicks-counts-1"), 60, "pod 1 to wait as a standby")
        standby = runner.pods["clicks-counts-1"]
        await scale_to(emu, 2, standby=1)
        assert runner.pods["clicks-counts-1"] is standby and standby.exit_code() is None
        assert "standby taken as counts/1" in (logs / "clicks-counts-1.log").read_text()
        await eventually(lambda: waiting("clicks-counts-2"), 60, "pod 2, the next standby")

        deleted = runner.pods["clicks-counts-2"]
        runner.delete("clicks-counts-2")
        await eventually(
            lambda: runner.pods.get("clicks-counts-2") not in (None, deleted)
            and waiting("clicks-counts-2"),
            60, "a new pod 2 waiting",
        )  # fmt: skip
        status = job_object(emu)["status"]
        assert status["phase"] == "Running" and status["parallelism"] == 2, status
        assert counts()["ready"] == 2 and status["recoveries"]["total"] == 0, status


def test_failing_checkpoints_make_the_job_degraded_and_a_failure_wins() -> None:
    """What the coordinator's status becomes in the CR: phase, Degraded reason, message."""
    checkpoints = {"degraded": True, "failures_in_a_row": 3, "last": {"error": "disk full"}}
    running = {"phase": "running", "errors": [], "checkpoints": checkpoints}
    assert observed_phase(running) == (
        "Degraded",
        "CheckpointsFailing",
        "3 checkpoints failed in a row; the last: disk full",
    )
    healthy = {**running, "checkpoints": {**checkpoints, "degraded": False}}
    assert observed_phase(healthy) == ("Running", None, "")
    assert observed_phase({**healthy, "rescale": {"stage": "k"}})[0] == "Rescaling"
    restarted = {"phase": "starting", "errors": [], "restored_from": 7}
    assert observed_phase(restarted) == ("Recovering", None, "")
    failed = {**running, "phase": "failed", "errors": ["instance keyed/0 was lost"]}
    assert observed_phase(failed) == ("Failed", "JobFailed", "instance keyed/0 was lost")


async def test_conditions_are_merged_and_carry_the_generation(emu: Emulator) -> None:
    """Each write upserts the conditions it knows: Ready and Rescaling (the observing timer's)
    survive create, update and resume, and a condition's time moves only when its status does."""
    async with running_operator(emu):
        await create(emu, streaming_job())
        first = await eventually(
            lambda: (c := condition(emu, "Degraded")).get("observedGeneration") == 1 and c,
            20, "the Degraded condition of generation 1",
        )  # fmt: skip
        assert first["status"] == "False" and first["lastTransitionTime"]
        # What the observing timer writes once the job runs (no job runs here), all from a
        # time long past: a kept time is told from a new one whatever second the test runs in.
        earlier = "2026-01-01T00:00:00+00:00"
        first = {**first, "lastTransitionTime": earlier}
        observed = [
            {"type": "Ready", "status": "True", "reason": "Running", "message": "",
             "observedGeneration": 1, "lastTransitionTime": earlier},
            {"type": "Rescaling", "status": "False", "reason": "Idle", "message": "",
             "observedGeneration": 1, "lastTransitionTime": earlier},
            first,
        ]  # fmt: skip
        reply = await emu.patch(f"{CR_API}/namespaces/{NS}/streamingjobs/clicks/status",
                                json={"status": {"conditions": observed}},
                                headers=MERGE)  # fmt: skip
        assert reply.status == 200, await reply.text()
        await emu.patch(f"{CR_API}/namespaces/{NS}/streamingjobs/clicks",
                        json={"spec": {"image": "ghcr.io/keyshift/keyshift:0.2.0"}},
                        headers=MERGE)  # fmt: skip
        await eventually(lambda: condition(emu, "Degraded").get("observedGeneration") == 2, 20,
                         "the update to be reconciled")  # fmt: skip
        status = job_object(emu)["status"]
        assert status["observedGeneration"] == 2
        assert [c["type"] for c in status["conditions"]] == ["Ready", "Rescaling", "Degraded"]
        assert condition(emu, "Degraded")["lastTransitionTime"] == first["lastTransitionTime"]
        assert condition(emu, "Ready") == observed[0]
        assert condition(emu, "Rescaling") == observed[1]

    async with running_operator(emu):  # resume
        await eventually(
            lambda: sum(e["reason"] == "Reconciled" for e in events_of(emu)) >= 3, 20,
            "a reconcile on resume",
        )  # fmt: skip
        assert condition(emu, "Ready") == observed[0]
        assert condition(emu, "Rescaling") == observed[1]
        assert condition(emu, "Degraded")["lastTransitionTime"] == first["lastTransitionTime"]

        # A spec the operator refuses: Degraded and Ready change status, so their times move.
        await emu.patch(f"{CR_API}/namespaces/{NS}/streamingjobs/clicks",
                        json={"spec": {"migration": {"options": {"teleport": 1}}}},
                        headers=MERGE)  # fmt: skip
        degraded = await degraded_condition(emu)
        assert degraded["observedGeneration"] == 3
        assert degraded["lastTransitionTime"] != first["lastTransitionTime"]
        ready = condition(emu, "Ready")
        assert ready["status"] == "False" and ready["reason"] == "InvalidSpec"
        assert ready["lastTransitionTime"] != earlier and ready["observedGeneration"] == 3
        assert condition(emu, "Rescaling") == observed[1]


def managers_of(obj: dict[str, Any], path: tuple[str, ...]) -> set[str]:
    """The field managers that own the field at `path` (f: names) of a live object."""
    found = set()
    for entry in obj["metadata"].get("managedFields", []):
        node = entry["fieldsV1"]
        for name in path:
            node = node.get(f"f:{name}")
            if node is None:
                break
        else:
            found.add(entry["manager"])
    return found


async def test_server_side_apply_removes_what_the_pod_template_no_longer_says(
    emu: Emulator,
) -> None:
    """A field dropped from podTemplate leaves the live StatefulSet; fields of other writers
    (an annotation, the scaler's replicas) stay, and the operator never owns the replicas of a
    StatefulSet that exists."""
    body = streaming_job(podTemplate={
        "spec": {"nodeSelector": {"disk": "ssd"},
                 "tolerations": [{"key": "spot", "operator": "Exists"}]},
    })  # fmt: skip
    sts_url = f"/apis/apps/v1/namespaces/{NS}/statefulsets/clicks-counts"

    def counts() -> dict[str, Any]:
        return stored(emu, "apps/v1/statefulsets", NS, "clicks-counts") or {}

    async with running_operator(emu):
        await create(emu, body)
        await eventually(lambda: set(owned_children(emu)) == EXPECTED_CHILDREN, 20, "children")
        await eventually(lambda: "keyshift-scaler" in managers_of(counts(), ("spec", "replicas")),
                         20, "the replicas handed to the scaler")  # fmt: skip
        await eventually(
            lambda: job_object(emu).get("status", {}).get("observedGeneration") == 1, 20,
            "the creation to be reconciled",
        )  # fmt: skip
        assert counts()["spec"]["template"]["spec"]["nodeSelector"] == {"disk": "ssd"}
        assert counts()["spec"]["replicas"] == 2
        reply = await emu.patch(sts_url, params={"fieldManager": "kubectl-annotate"},
                                json={"metadata": {"annotations": {"note": "kept"}}},
                                headers=MERGE)  # fmt: skip
        assert reply.status == 200, await reply.text()

        await emu.patch(f"{CR_API}/namespaces/{NS}/streamingjobs/clicks",
                        json={"spec": {"podTemplate": {"spec": {"nodeSelector": None}}}},
                        headers=MERGE)  # fmt: skip
        await eventually(
            lambda: job_object(emu).get("status", {}).get("observedGeneration") == 2, 20,
            "the update to be reconciled",
        )  # fmt: skip
        sts = await eventually(
            lambda: "nodeSelector" not in (s := counts())["spec"]["template"]["spec"] and s,
            20, "the node selector to leave the live StatefulSet",
        )  # fmt: skip
        pod = sts["spec"]["template"]["spec"]
        assert pod["tolerations"] == [{"key": "spot", "operator": "Exists"}]
        assert pod["containers"][0]["securityContext"]["allowPrivilegeEscalation"] is False
        assert sts["metadata"]["annotations"] == {"note": "kept"}
        assert sts["spec"]["replicas"] == 2
        assert managers_of(sts, ("spec", "replicas")) == {"keyshift-scaler"}
        assert "keyshift-operator" in managers_of(sts, ("spec", "template"))


async def test_the_operator_refuses_a_pod_template_that_undoes_the_hardening(
    emu: Emulator,
) -> None:
    """The CRD's CEL rules refuse these at kubectl apply time; an API server that does not run
    them (this emulator does not) leaves it to the operator, which names every problem and
    creates nothing."""
    body = streaming_job(podTemplate={"spec": {
        "hostNetwork": True,
        "containers": [{"name": "keyshift", "securityContext": {"privileged": True}}],
        "volumes": [{"name": "node", "hostPath": {"path": "/"}}],
    }})  # fmt: skip
    async with running_operator(emu):
        reply = await create(emu, body)
        assert reply.status in (200, 201), await reply.text()
        degraded = await degraded_condition(emu)
        assert degraded["reason"] == "InvalidSpec"
        for problem in (
            "spec.podTemplate.spec: podTemplate may not use the host's network (hostNetwork)",
            "spec.podTemplate.spec.containers[0].securityContext: podTemplate may not run "
            "privileged containers",
            "spec.podTemplate.spec.volumes[0]: podTemplate may not mount hostPath volumes",
        ):
            assert problem in degraded["message"]
        assert job_object(emu)["status"]["phase"] == "Degraded"
        await eventually(
            lambda: any(e["reason"] == "InvalidSpec" and "hostNetwork" in e["message"]
                        for e in events_of(emu)),
            10, "an InvalidSpec event",
        )  # fmt: skip
        assert owned_children(emu) == {}


async def test_a_replicas_handover_cut_short_is_finished_before_the_next_apply(
    emu: Emulator,
) -> None:
    """An operator that stopped between creating a StatefulSet and handing its replicas to the
    scaler: the next reconcile hands over the live count first, so leaving the replicas out of
    its own configuration does not remove them."""
    body = streaming_job()
    spec = StreamingJobSpec.model_validate(body["spec"])
    manifest = stage_stateful_set("clicks", NS, spec, spec.job_spec(), "counts", 3)
    reply = await emu.patch(f"/apis/apps/v1/namespaces/{NS}/statefulsets/clicks-counts",
                            params={"fieldManager": "keyshift-operator", "force": "true"},
                            json=manifest,
                            headers={"Content-Type": "application/apply-patch+yaml"})  # fmt: skip
    assert reply.status in (200, 201), await reply.text()
    async with running_operator(emu):
        await create(emu, body)
        await eventually(
            lambda: job_object(emu).get("status", {}).get("observedGeneration") == 1, 20,
            "the creation to be reconciled",
        )  # fmt: skip
        sts = stored(emu, "apps/v1/statefulsets", NS, "clicks-counts") or {}
        assert sts["spec"]["replicas"] == 3
        assert managers_of(sts, ("spec", "replicas")) == {"keyshift-scaler"}


async def test_every_keyed_stage_of_a_graph_job_rescales_and_the_status_shows_each(
    emu: Emulator, tmp_path: Path
) -> None:
    """A graph job with two keyed stages and two sinks (users feeds nested and the sink
    `copy`; nested feeds `out`): an edit of every stage's parallelism in spec.job.graph
    rescales them live, one after the other, each StatefulSet (one per sink too) follows, and
    the status shows every stage's parallelism and the autoscaler's latest decision for it
    (dry run: decided, never applied)."""

    def keyed(name: str, input: str, function: str) -> dict[str, Any]:
        operator = {"kind": "process", "function": f"tests.job_fns:{function}"}
        return {"name": name, "kind": "keyed", "input": input, "key_by": "key",
                "parallelism": 1, "operator": operator}  # fmt: skip

    source = {"kind": "generator", "keys": 500, "profile": {"rate": 500}}
    graph = [
        {"name": "clicks", "kind": "source", "config": source},
        keyed("users", "clicks", "track"),
        keyed("nested", "users", "nest"),
        # Output log files would need a claim every sink pod shares (the sink's partitions
        # move between them): this sink keeps offsets only.
        {
            "name": "out",
            "kind": "sink",
            "input": "nested",
            "partitions": 2,
            "config": {"kind": "log", "format": "none"},
        },
        {
            "name": "copy",
            "kind": "sink",
            "input": "users",
            "partitions": 2,
            "config": {"kind": "log", "path": "copy", "format": "none"},
        },
    ]
    job = {"name": "clicks", "graph": graph, "autoscaler": {"interval": 1, "dry_run": True}}
    body = streaming_job()
    body["spec"]["job"] = job
    async with job_running_in_cluster(emu, tmp_path, body):
        edited = copy.deepcopy(graph)
        for stage, width in zip(edited[1:], (2, 3, 2, 2), strict=True):
            stage["parallelism"] = width
        patch = {"spec": {"job": {"graph": edited}}}
        reply = await emu.patch(f"{CR_API}/namespaces/{NS}/streamingjobs/clicks", json=patch,
                                headers=MERGE)  # fmt: skip
        assert reply.status == 200, await reply.text()

        def stages() -> dict[str, dict[str, Any]]:
            return {s["name"]: s for s in job_object(emu)["status"].get("stages", [])}

        def replicas(stage: str) -> int | None:
            sts = stored(emu, "apps/v1/statefulsets", NS, f"clicks-{stage}") or {}
            return sts.get("spec", {}).get("replicas")

        def rescales() -> list[tuple[str, int, str]]:
            done = job_object(emu)["status"].get("rescales", [])
            return [(r["stage"], r["to"], r["phase"]) for r in done]

        try:
            await eventually(
                lambda: [(s.get("current"), s.get("ready")) for s in
                         (stages().get(name, {}) for name in ("users", "nested", "out", "copy"))]
                == [(2, 2), (3, 3), (2, 2), (2, 2)]
                and [replicas(s) for s in ("users", "nested", "out", "copy")] == [2, 3, 2, 2]
                and len(rescales()) == 4,
                120, "both keyed stages and both sinks rescaled",
            )  # fmt: skip
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {job_object(emu)['status']}") from None
        assert rescales() == [
            ("users", 2, "done"), ("nested", 3, "done"), ("out", 2, "done"), ("copy", 2, "done")
        ]  # fmt: skip
        assert any(e["reason"] == "ManualRescale" for e in events_of(emu))
        await eventually(
            lambda: all(stages()[s].get("lastDecision") for s in ("users", "nested")),
            30, "each stage's latest decision in the status",
        )  # fmt: skip
        assert stages()["users"]["lastDecision"].startswith("users: ")
