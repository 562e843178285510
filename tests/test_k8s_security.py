"""The operator's side of who can talk to a job, against the Kubernetes API emulator
(tests/kube_emulator.py): the job's token Secret (created once, random, owned by the
StreamingJob, never overwritten) reaches every pod through `secretKeyRef` and never the
ConfigMap; storage credentials come only from the Secret the CR names (inline ones are
refused); TLS files come from the CR's TLS Secret. The full-loop tests in test_k8s_operator.py
run real processes with the secret the test kubelet reads from this Secret.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import Any

import kmock
import pytest
import pytest_asyncio

from keyshift.operator.k8s_children import TLS_MOUNT, children, job_secret_name
from keyshift.operator.streamingjob import StreamingJobSpec
from keyshift.runtime.job_secret import MIN_SECRET_CHARS, SECRET_ENV
from tests.kube_emulator import (
    CR,
    CR_API,
    Emulator,
    eventually,
    listed,
    register_resources,
    stored,
)
from tests.test_k8s_operator import (
    MERGE,
    NS,
    create,
    degraded_condition,
    job_object,
    owned_children,
    running_operator,
    streaming_job,
)

pytestmark = [
    pytest.mark.alone,
    pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning"),
]

# A Spark sink reads the output log on a shared claim (the operator refuses one without it).
SPARK: dict[str, Any] = {"sources": [{"name": "bids", "script": "/app/bids.py"}],
         "sinks": [{"name": "report", "script": "/app/report.py"}],
         "output": {"claim": "clicks-out"}}  # fmt: skip
CREDENTIALS: dict[str, Any] = {"secretName": "s3-creds"}


@pytest_asyncio.fixture
async def emu() -> AsyncIterator[Emulator]:
    async with Emulator() as handler, kmock.Server(handler):
        register_resources(handler)
        yield handler


def token_secret(emu: Emulator) -> dict[str, Any] | None:
    return stored(emu, "v1/secrets", NS, job_secret_name("clicks"))


def secret_value(emu: Emulator) -> str:
    secret = token_secret(emu)
    assert secret is not None
    return base64.b64decode(secret["data"]["secret"]).decode()


def pod_containers(emu: Emulator) -> dict[str, dict[str, Any]]:
    """The keyshift container of every workload of the job, by workload name."""
    return {
        name: obj["spec"]["template"]["spec"]["containers"][0]
        for (kind, name), obj in owned_children(emu).items()
        if kind in ("Deployment", "StatefulSet")
    }


def env_refs(container: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {
        e["name"]: e["valueFrom"]["secretKeyRef"]
        for e in container.get("env", [])
        if "secretKeyRef" in e.get("valueFrom", {})
    }


@pytest.mark.asyncio
async def test_the_token_secret_is_created_once_owned_and_mounted_in_every_pod(
    emu: Emulator,
) -> None:
    body = streaming_job(**SPARK, storageCredentials=CREDENTIALS)
    async with running_operator(emu):
        reply = await create(emu, body)
        assert reply.status in (200, 201), await reply.text()
        await eventually(lambda: len(pod_containers(emu)) == 6, 20, "the workloads")
        secret = token_secret(emu)
        assert secret is not None and secret["type"] == "Opaque"
        uid = job_object(emu)["metadata"]["uid"]
        assert [o["uid"] for o in secret["metadata"]["ownerReferences"]] == [uid]
        value = secret_value(emu)
        assert len(value) >= MIN_SECRET_CHARS
        # Every pod (coordinator, stages, Spark apps) gets it from the Secret, and the storage
        # credentials from the Secret the CR names; no manifest holds a value.
        containers = pod_containers(emu)
        assert set(containers) == {
            "clicks-coordinator", "clicks-source", "clicks-counts", "clicks-sink",
            "clicks-source-bids", "clicks-sink-report",
        }  # fmt: skip
        for name, container in containers.items():
            refs = env_refs(container)
            assert refs[SECRET_ENV] == {"name": "clicks-secret", "key": "secret"}, name
            assert refs["AWS_SECRET_ACCESS_KEY"] == {
                "name": "s3-creds",
                "key": "AWS_SECRET_ACCESS_KEY",
            }
            assert refs["AWS_ACCESS_KEY_ID"]["name"] == "s3-creds"
        for obj in owned_children(emu).values():
            assert value not in str(obj), obj["metadata"]["name"]
        await eventually(
            lambda: job_object(emu).get("status", {}).get("observedGeneration") == 1, 20,
            "the creation reconciled",
        )  # fmt: skip
        # An update re-applies the children but never replaces the secret the pods hold.
        await emu.patch(f"{CR_API}/namespaces/{NS}/streamingjobs/clicks",
                        json={"spec": {"image": "ghcr.io/keyshift/keyshift:0.2.0"}},
                        headers=MERGE)  # fmt: skip
        await eventually(
            lambda: job_object(emu).get("status", {}).get("observedGeneration") == 2, 20,
            "the update reconciled",
        )  # fmt: skip
        assert secret_value(emu) == value
    # Nor does an operator restart (resume).
    async with running_operator(emu):
        await eventually(
            lambda: sum(e.get("reason") == "Reconciled" for e in listed(emu, "v1/events", NS))
            >= 3, 20, "a reconcile on resume",
        )  # fmt: skip
        assert secret_value(emu) == value


@pytest.mark.asyncio
async def test_an_existing_token_secret_is_kept(emu: Emulator) -> None:
    """A Secret made before the job (restored from a backup, or by hand) is used as it is."""
    mine = "m" * MIN_SECRET_CHARS
    manifest = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "clicks-secret"},
                "data": {"secret": base64.b64encode(mine.encode()).decode()}}  # fmt: skip
    reply = await emu.post(f"/api/v1/namespaces/{NS}/secrets", json=manifest)
    assert reply.status in (200, 201), await reply.text()
    async with running_operator(emu):
        assert (await create(emu, streaming_job())).status in (200, 201)
        await eventually(lambda: len(pod_containers(emu)) == 4, 20, "the workloads")
        assert secret_value(emu) == mine


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "options",
    [
        {"key": "AKIA...", "secret": "hunter2"},
        {"client_kwargs": {"endpoint_url": "http://s3"}, "config_kwargs": {"token": "t"}},
    ],
)
async def test_inline_storage_credentials_are_refused(
    emu: Emulator, options: dict[str, Any]
) -> None:
    body = streaming_job()
    body["spec"]["job"]["checkpoints"] = {"storage": "s3://bucket/cp", "storage_options": options}
    async with running_operator(emu):
        assert (await create(emu, body)).status in (200, 201)
        degraded = await degraded_condition(emu)
        assert "credentials do not go inline" in degraded["message"]
        assert "spec.storageCredentials" in degraded["message"]
        assert owned_children(emu) == {} and token_secret(emu) is None
    assert stored(emu, CR, NS, "clicks") is not None


def test_tls_files_come_from_the_crs_secret_in_every_pod() -> None:
    spec = StreamingJobSpec.model_validate(
        {**streaming_job(**SPARK)["spec"], "tls": {"secretName": "job-tls", "serverName": "k"}}
    )
    workloads = [
        c for c in children("clicks", NS, spec, spec.job_spec())
        if c["kind"] in ("Deployment", "StatefulSet")
    ]  # fmt: skip
    assert len(workloads) == 6
    for child in workloads:
        pod = child["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert {"name": "tls", "secret": {"secretName": "job-tls"}} in pod["volumes"]
        assert {"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True} in container[
            "volumeMounts"
        ]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["KEYSHIFT_TLS_CA"] == f"{TLS_MOUNT}/ca.crt"
        assert env["KEYSHIFT_TLS_CERT"] == f"{TLS_MOUNT}/tls.crt"
        assert env["KEYSHIFT_TLS_KEY"] == f"{TLS_MOUNT}/tls.key"
        assert env["KEYSHIFT_TLS_SERVER_NAME"] == "k"
