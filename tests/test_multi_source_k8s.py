"""A StreamingJob of several sources becomes Kubernetes objects: one StatefulSet and headless
Service per source, each ingest source's Service with its own ingest port, a Spark source app
pointed at the ingest source it names (`spec.sources[].stage`), the NetworkPolicy letting
Spark clients reach every fixed ingest port; and the problems refused before anything is
created: a Spark app naming no ingest source of several, or a stage that is not one. The
operator (against kmock's emulator, as tests/test_k8s_operator.py) creates those children, or
degrades the job without any."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from keyshift.operator.k8s_children import ChildOptions, child_problems, children
from keyshift.operator.streamingjob import StreamingJobSpec
from tests.kube_emulator import Emulator, eventually
from tests.test_k8s_children import NAME, NAMESPACE, OPTIONS, by_kind, spec_data
from tests.test_k8s_operator import (
    condition,
    create,
    emu,
    owned_children,
    running_operator,
    streaming_job,
)

__all__ = ["emu"]  # the emulator fixture, used by the operator's tests below

ROWS = {"key": "int", "value": "float"}


def graph(*, clicks_port: int = 7200, views_port: int = 7300) -> dict[str, Any]:
    """clicks (ingest), views (ingest) and gen (generator), unioned into counts -> out."""
    return {
        "name": "clicks",
        "graph": [
            {"name": "clicks", "kind": "source", "parallelism": 2, "fields": ROWS,
             "config": {"kind": "ingest", "port": clicks_port}},
            {"name": "views", "kind": "source", "fields": ROWS,
             "config": {"kind": "ingest", "port": views_port}},
            {"name": "gen", "kind": "source", "config": {"kind": "generator"}},
            {"name": "counts", "kind": "keyed", "inputs": ["clicks", "views", "gen"],
             "key_by": "key", "parallelism": 2},
            {"name": "out", "kind": "sink", "input": "counts",
             "config": {"kind": "log", "path": "out/clicks", "format": "jsonl"}},
        ],
    }  # fmt: skip


def spark_sources(*stages: str | None) -> list[dict[str, Any]]:
    return [
        {"name": f"app-{i}", "script": "/app/spark/events.py"} | ({"stage": s} if s else {})
        for i, s in enumerate(stages)
    ]


def spec_of(job: dict[str, Any], sources: list[dict[str, Any]]) -> StreamingJobSpec:
    return StreamingJobSpec.model_validate(spec_data(job=job, sources=sources))


def test_every_source_has_its_stateful_set_and_each_ingest_source_its_port() -> None:
    spec = spec_of(graph(), spark_sources("views", "clicks"))
    job = spec.job_spec()
    assert child_problems(NAME, spec, job) == []
    manifests = children(NAME, NAMESPACE, spec, job, options=ChildOptions.model_validate(OPTIONS))
    for m in manifests:
        kubernetes_validate.validate(m, "1.30", strict=True)
    sets = by_kind(manifests, "StatefulSet")
    assert {n: s["spec"]["replicas"] for n, s in sets.items()} == {
        "clicks-clicks": 2, "clicks-views": 1, "clicks-gen": 1, "clicks-counts": 2,
        "clicks-out": 1,
    }  # fmt: skip
    services = by_kind(manifests, "Service")

    def ingest_ports(service: str) -> list[int]:
        ports = services[service]["spec"]["ports"]
        return [p["port"] for p in ports if p["name"] == "ingest"]

    assert ingest_ports("clicks-clicks") == [7200]
    assert ingest_ports("clicks-views") == [7300]
    assert ingest_ports("clicks-gen") == []
    apps = by_kind(manifests, "Deployment")
    for app, target in [("clicks-source-app-0", "clicks-views.streams.svc:7300"),
                        ("clicks-source-app-1", "clicks-clicks.streams.svc:7200")]:  # fmt: skip
        (container,) = apps[app]["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["KEYSHIFT_INGEST"] == target
    (policy,) = by_kind(manifests, "NetworkPolicy").values()
    clients = policy["spec"]["ingress"][-1]
    assert [p["port"] for p in clients["ports"]] == [7000, 7200, 7300]


def test_a_spark_source_of_a_job_with_several_ingest_sources_must_name_one() -> None:
    spec = spec_of(graph(), spark_sources(None))
    (problem,) = child_problems(NAME, spec, spec.job_spec())
    assert "spec.sources 'app-0': the job has several ingest sources" in problem
    spec = spec_of(graph(), spark_sources("gen"))
    (problem,) = child_problems(NAME, spec, spec.job_spec())
    assert "stage 'gen' is not an ingest source of the job" in problem


def test_the_ingest_source_a_spark_source_writes_into_needs_a_fixed_port() -> None:
    spec = spec_of(graph(views_port=0), spark_sources("views"))
    (problem,) = child_problems(NAME, spec, spec.job_spec())
    assert "stage 'views': a job with Spark sources needs a fixed ingest port" in problem
    # The other ingest source may pick a free port: no Spark source writes into it.
    spec = spec_of(graph(views_port=0), spark_sources("clicks"))
    assert child_problems(NAME, spec, spec.job_spec()) == []


@pytest.mark.alone  # the operator in process, as tests/test_k8s_operator.py's
@pytest.mark.asyncio
@pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")
async def test_the_operator_makes_a_stateful_set_per_source(emu: Emulator) -> None:
    body = streaming_job(sources=spark_sources("views"))
    body["spec"]["job"] = graph()
    async with running_operator(emu):
        reply = await create(emu, body)
        assert reply.status in (200, 201), await reply.text()

        def sets() -> set[str]:
            return {name for kind, name in owned_children(emu) if kind == "StatefulSet"}

        every = {"clicks-clicks", "clicks-views", "clicks-gen", "clicks-counts", "clicks-out"}
        await eventually(lambda: sets() == every, 20, "a StatefulSet per stage")
        app = await eventually(
            lambda: owned_children(emu).get(("Deployment", "clicks-source-app-0")),
            20, "the Spark source's Deployment",
        )  # fmt: skip
        env = {
            e["name"]: e.get("value")
            for e in app["spec"]["template"]["spec"]["containers"][0]["env"]
        }
        assert env["KEYSHIFT_INGEST"] == "clicks-views.jobs.svc:7300"


@pytest.mark.alone  # the operator in process, as tests/test_k8s_operator.py's
@pytest.mark.asyncio
@pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")
async def test_the_operator_degrades_a_job_whose_spark_source_names_no_ingest_source(
    emu: Emulator,
) -> None:
    body = streaming_job(sources=spark_sources(None))
    body["spec"]["job"] = graph()
    async with running_operator(emu):
        reply = await create(emu, body)
        assert reply.status in (200, 201), await reply.text()
        degraded = await eventually(
            lambda: (c := condition(emu, "Degraded")).get("status") == "True" and c,
            20, "the Degraded condition",
        )  # fmt: skip
        assert "the job has several ingest sources" in degraded["message"]
        assert owned_children(emu) == {}
