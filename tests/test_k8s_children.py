"""Tests of keyshift.operator.k8s_children: the manifests a StreamingJob becomes.

Every manifest must pass the Kubernetes 1.30 schema (strict: no unknown fields), names, labels
and selectors must fit together, replicas follow the job until the scaler owns them, the
job file in the ConfigMap must read back as the same job, every pod must be locked down, and
the podTemplate must merge in without moving a pod out of its selector. With the operator's
options: the job's NetworkPolicy and the stages' PodDisruptionBudgets (valid, selecting the
right pods, letting in exactly the named peers) and the default image of a job without one.
Also the instance's `--index hostname` parser, which the StatefulSets rely on.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from keyshift.operator.autoscaled_job import AutoscaledJob
from keyshift.operator.k8s_children import (
    APP_DIR,
    CHILD_OPTIONS_ENV,
    COORDINATOR_PORT,
    DATA_PORT,
    JOB_FILE,
    JOB_MOUNT,
    LABEL_COMPONENT,
    LABEL_JOB,
    LABEL_STAGE,
    METRICS_PORT,
    ChildOptions,
    ChildOptionsError,
    child_options_from_env,
    child_problems,
    children,
    config_map_name,
    coordinator_address,
    coordinator_service_name,
    deep_merge,
    sink_rescale_problem,
    stage_replicas,
    stage_selector,
    stage_set_name,
)
from keyshift.operator.state_memory import (
    HEADROOM_MIB,
    PROCESS_BASE_MIB,
    quantity_bytes,
    state_memory_mib,
)
from keyshift.operator.streamingjob import StreamingJobSpec
from keyshift.runtime.instance import _index
from keyshift.runtime.job import StateSettings, parse_job_as
from tests.conftest import KEYSHIFT, REPO

NAME = "clicks"
NAMESPACE = "streams"
COMMON = {
    "app.kubernetes.io/name": "keyshift",
    "app.kubernetes.io/instance": NAME,
    "app.kubernetes.io/managed-by": "keyshift-operator",
    LABEL_JOB: NAME,
}


def spec_data(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "image": "registry.example/keyshift:0.1.0",
        "imagePullPolicy": "Always",
        "job": {
            "name": "clicks",
            "source": {
                "parallelism": 1,
                "config": {
                    "kind": "generator",
                    "keys": 1000,
                    "profile": {"kind": "step", "rate": 1000, "to": 5000, "at": 10},
                },
            },
            "keyed": {
                "name": "counts",
                "parallelism": 2,
                "operator": {"kind": "aggregate", "function": "count"},
            },
            "sink": {"config": {"kind": "log", "path": "out/clicks", "format": "jsonl"}},
            "autoscaler": {"policy": "ds2", "interval": 2, "bounds": {"max_parallelism": 6}},
        },
        "sources": [
            {"name": "events", "script": "/app/spark/events.py", "args": ["--rate", "100"]},
        ],
        "resources": {
            "requests": {"cpu": "100m", "memory": "128Mi"},
            "limits": {"memory": "512Mi"},
        },
        "podTemplate": {
            "metadata": {
                "labels": {"team": "data", LABEL_JOB: "other", LABEL_STAGE: "other"},
                "annotations": {"owner": "data-team"},
            },
            "spec": {
                "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
                "nodeSelector": {"pool": "streaming"},
            },
        },
        "serviceAccountName": "keyshift-jobs",
    }
    data.update(changes)
    return data


def build(
    existing: frozenset[str] = frozenset(), **changes: Any
) -> tuple[StreamingJobSpec, list[dict[str, Any]]]:
    spec = StreamingJobSpec.model_validate(spec_data(**changes))
    return spec, children(NAME, NAMESPACE, spec, spec.job_spec(), existing)


def by_kind(manifests: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {m["metadata"]["name"]: m for m in manifests if m["kind"] == kind}


def pod_templates(manifests: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for m in manifests:
        if m["kind"] in ("Deployment", "StatefulSet"):
            yield m["metadata"]["name"], m["spec"]["template"]


def test_every_manifest_passes_the_kubernetes_schema() -> None:
    _, manifests = build()
    for m in manifests:
        kubernetes_validate.validate(m, "1.30", strict=True)
        assert m["metadata"]["namespace"] == NAMESPACE
        assert "ownerReferences" not in m["metadata"]
        assert COMMON.items() <= m["metadata"]["labels"].items()


def test_creation_order_and_names() -> None:
    _, manifests = build()
    names = [(m["kind"], m["metadata"]["name"]) for m in manifests]
    assert names == [
        ("ConfigMap", "clicks-job"),
        ("Deployment", "clicks-coordinator"),
        ("Service", "clicks-coordinator"),
        ("Service", "clicks-source"),
        ("StatefulSet", "clicks-source"),
        ("Service", "clicks-counts"),
        ("StatefulSet", "clicks-counts"),
        ("Service", "clicks-sink"),
        ("StatefulSet", "clicks-sink"),
        ("Deployment", "clicks-source-events"),
    ]
    assert config_map_name(NAME) == "clicks-job"
    assert coordinator_service_name(NAME) == "clicks-coordinator"
    assert stage_set_name(NAME, "counts") == "clicks-counts"
    assert coordinator_address(NAME, NAMESPACE) == "clicks-coordinator.streams.svc:7000"


def test_selectors_match_services_and_pod_labels() -> None:
    _, manifests = build()
    services = by_kind(manifests, "Service")
    sets = by_kind(manifests, "StatefulSet")
    deployments = by_kind(manifests, "Deployment")
    for stage in ("source", "counts", "sink"):
        sts = sets[stage_set_name(NAME, stage)]
        svc = services[stage_set_name(NAME, stage)]
        selector = sts["spec"]["selector"]["matchLabels"]
        pod_labels = sts["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= pod_labels.items()
        assert svc["spec"]["selector"] == selector
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["publishNotReadyAddresses"] is True
        assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
        assert sts["spec"]["podManagementPolicy"] == "Parallel"
        assert pod_labels[LABEL_STAGE] == stage
        assert pod_labels[LABEL_COMPONENT] == "stage"
        assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {
            "data": DATA_PORT,
            "metrics": METRICS_PORT,
        }
        # The selector string the status reports selects exactly these pods.
        pairs = dict(part.split("=") for part in stage_selector(NAME, stage).split(","))
        assert pairs == selector
    coordinator = deployments["clicks-coordinator"]
    service = services["clicks-coordinator"]
    selector = coordinator["spec"]["selector"]["matchLabels"]
    assert selector.items() <= coordinator["spec"]["template"]["metadata"]["labels"].items()
    assert service["spec"]["selector"] == selector
    assert service["spec"]["type"] == "ClusterIP"
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "grpc": COORDINATOR_PORT,
        "metrics": METRICS_PORT,
    }
    assert coordinator["spec"]["replicas"] == 1
    assert coordinator["spec"]["strategy"] == {"type": "Recreate"}
    # No workload's selector selects another workload's pods.
    workloads = [*sets.values(), *deployments.values()]
    for w in workloads:
        sel = w["spec"]["selector"]["matchLabels"].items()
        matched = [
            o for o in workloads if sel <= o["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert matched == [w]


def test_replicas_follow_the_job_and_are_left_out_once_the_scaler_owns_them() -> None:
    _, manifests = build()
    sets = by_kind(manifests, "StatefulSet")
    assert {n: s["spec"]["replicas"] for n, s in sets.items()} == {
        "clicks-source": 1,
        "clicks-counts": 2,
        "clicks-sink": 1,
    }
    _, manifests = build(existing=frozenset({"counts"}))
    sets = by_kind(manifests, "StatefulSet")
    assert "replicas" not in sets["clicks-counts"]["spec"]
    assert sets["clicks-source"]["spec"]["replicas"] == 1


def test_a_keyed_stage_with_standbys_runs_them_above_its_instances_as_pinned_standbys() -> None:
    """`standby: N`: N more pods in the stage's StatefulSet, every one of them started as a
    standby for its own ordinal; the other stages, and a stage at zero, run none."""
    job = spec_data()["job"]
    job["keyed"]["standby"] = 2
    spec, manifests = build(job=job)
    sets = by_kind(manifests, "StatefulSet")
    assert {n: s["spec"]["replicas"] for n, s in sets.items()} == {
        "clicks-source": 1,
        "clicks-counts": 4,
        "clicks-sink": 1,
    }
    for name, sts in sets.items():
        kubernetes_validate.validate(sts, "1.30", strict=True)
        args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
        assert ("--standby" in args) == (name == "clicks-counts"), name
        assert args[args.index("--index") + 1] == "hostname"
    job_spec = spec.job_spec()
    assert stage_replicas(job_spec, "counts", 3) == 5
    assert stage_replicas(job_spec, "counts", 0) == 0  # a finished job keeps no standbys
    assert stage_replicas(job_spec, "sink", 2) == 2


def test_the_config_map_holds_the_same_job() -> None:
    spec, manifests = build()
    config = by_kind(manifests, "ConfigMap")[config_map_name(NAME)]
    text = config["data"][JOB_FILE]
    loaded = parse_job_as(AutoscaledJob, yaml.safe_load(text), resolve_functions=False)
    assert loaded == spec.job_spec()
    coordinator = by_kind(manifests, "Deployment")["clicks-coordinator"]
    pod = coordinator["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["python", "-P", "-m", "keyshift.runtime.coordinator"]
    assert container["args"][:2] == ["--job", f"{JOB_MOUNT}/{JOB_FILE}"]
    assert {"name": "job", "mountPath": JOB_MOUNT, "readOnly": True} in container["volumeMounts"]
    assert {"name": "job", "configMap": {"name": "clicks-job"}} in pod["volumes"]


def test_every_pod_is_locked_down() -> None:
    spec, manifests = build()
    for name, template in pod_templates(manifests):
        pod = template["spec"]
        assert pod["securityContext"] == {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "runAsGroup": 10001,
            "fsGroup": 10001,
            "seccompProfile": {"type": "RuntimeDefault"},
        }, name
        assert pod["automountServiceAccountToken"] is False
        assert pod["serviceAccountName"] == "keyshift-jobs"
        for container in pod["containers"]:
            assert container["securityContext"] == {
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]},
            }, name
            assert container["image"] == spec.image
            assert container["imagePullPolicy"] == "Always"
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env["HOME"] == "/tmp"
            assert env["MALLOC_ARENA_MAX"] == "2"  # as the local host's processes
            tmp = next(m for m in container["volumeMounts"] if m["mountPath"] == "/tmp")
            volume = next(v for v in pod["volumes"] if v["name"] == tmp["name"])
            assert volume["emptyDir"] == {}


def test_the_log_sink_writes_to_an_empty_dir() -> None:
    _, manifests = build()
    sink = by_kind(manifests, "StatefulSet")["clicks-sink"]["spec"]["template"]["spec"]
    (container,) = sink["containers"]
    assert container["workingDir"] == APP_DIR
    output = next(m for m in container["volumeMounts"] if m["mountPath"] == "/app/out/clicks")
    assert next(v for v in sink["volumes"] if v["name"] == output["name"])["emptyDir"] == {}
    keyed = by_kind(manifests, "StatefulSet")["clicks-counts"]["spec"]["template"]["spec"]
    assert [m["mountPath"] for m in keyed["containers"][0]["volumeMounts"]] == [JOB_MOUNT, "/tmp"]
    job = spec_data()["job"]
    job["sink"]["config"]["path"] = "/data/out"
    _, manifests = build(job=job)
    sink = by_kind(manifests, "StatefulSet")["clicks-sink"]["spec"]["template"]["spec"]
    assert "/data/out" in [m["mountPath"] for m in sink["containers"][0]["volumeMounts"]]


def test_resources_and_pod_template_merge_without_touching_selectors() -> None:
    _, manifests = build()
    for name, template in pod_templates(manifests):
        labels = template["metadata"]["labels"]
        assert labels["team"] == "data"
        assert labels[LABEL_JOB] == NAME, name
        assert template["metadata"]["annotations"]["owner"] == "data-team"
        pod = template["spec"]
        assert pod["tolerations"] == [
            {"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}
        ]
        assert pod["nodeSelector"] == {"pool": "streaming"}
    sets = by_kind(manifests, "StatefulSet")
    counts = sets["clicks-counts"]["spec"]["template"]
    assert counts["metadata"]["labels"][LABEL_STAGE] == "counts"
    assert counts["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert counts["metadata"]["annotations"]["prometheus.io/port"] == "9100"
    assert counts["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "100m", "memory": "128Mi"},
        "limits": {"memory": "512Mi"},
    }
    spark = by_kind(manifests, "Deployment")["clicks-source-events"]["spec"]["template"]
    # The Spark app has its own resources (the defaults here).
    assert spark["spec"]["containers"][0]["resources"] == {
        "requests": {"cpu": "250m", "memory": "256Mi"},
        "limits": {"cpu": "1", "memory": "1Gi"},
    }


def test_a_pod_template_container_and_volume_merge_by_name() -> None:
    pod_template = {
        "spec": {
            "containers": [
                {"name": "keyshift", "env": [{"name": "EXTRA", "value": "1"}]},
                {"name": "sidecar", "image": "busybox"},
            ],
            "volumes": [{"name": "scratch", "emptyDir": {}}],
            "securityContext": {"runAsUser": 20002},
        }
    }
    _, manifests = build(podTemplate=pod_template)
    for m in manifests:
        kubernetes_validate.validate(m, "1.30", strict=True)
    pod = by_kind(manifests, "StatefulSet")["clicks-counts"]["spec"]["template"]["spec"]
    main, sidecar = pod["containers"]
    assert (main["name"], sidecar["name"]) == ("keyshift", "sidecar")
    env = {e["name"] for e in main["env"]}
    assert {"EXTRA", "POD_IP", "HOME", "KEYSHIFT_JOB"} <= env
    assert [v["name"] for v in pod["volumes"]] == ["job", "tmp", "scratch"]
    assert pod["securityContext"]["runAsUser"] == 20002
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_instances_take_their_index_from_the_hostname() -> None:
    _, manifests = build()
    sts = by_kind(manifests, "StatefulSet")["clicks-counts"]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["python", "-P", "-m", "keyshift.runtime.instance"]
    args = container["args"]
    assert args[args.index("--index") + 1] == "hostname"
    assert args[args.index("--coordinator") + 1] == "clicks-coordinator.streams.svc:7000"
    assert args[args.index("--stage") + 1] == "counts"
    assert args[args.index("--host") + 1] == "$(POD_IP)"
    pod_ip = next(e for e in container["env"] if e["name"] == "POD_IP")
    assert pod_ip["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    probe = {"path": "/metrics", "port": "metrics"}
    assert container["readinessProbe"]["httpGet"] == probe
    assert container["livenessProbe"]["httpGet"] == probe
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"data": DATA_PORT, "metrics": METRICS_PORT}


def test_a_job_with_checkpoints_restores_whenever_its_coordinator_starts() -> None:
    """The coordinator exits to recover a lost instance (or crashes): its restarted pod goes on
    from the latest checkpoint; without checkpoints there is nothing to restore."""

    def coordinator_args(manifests: list[dict[str, Any]]) -> list[str]:
        deployment = by_kind(manifests, "Deployment")["clicks-coordinator"]
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        return list(container["args"])

    job = {**spec_data()["job"], "checkpoints": {"storage": "s3://bucket/clicks"}}
    assert "--restore" in coordinator_args(build(job=job)[1])
    assert "--restore" not in coordinator_args(build()[1])


def test_local_checkpoints_live_on_a_claim_every_pod_mounts() -> None:
    """Checkpoints in a local directory (and an ingest source's log beside them) are written
    by every pod and read by restarted ones: a ReadWriteMany claim is mounted there in the
    coordinator and every stage; the operator refuses a local directory without a claim, and a
    claim nothing would use."""
    job = {**spec_data()["job"], "checkpoints": {"storage": "state/checkpoints"}}
    spec = StreamingJobSpec.model_validate(spec_data(job=job, checkpointClaim="clicks-state"))
    assert child_problems(NAME, spec, spec.job_spec()) == []
    _, manifests = build(job=job, checkpointClaim="clicks-state")
    for m in manifests:
        kubernetes_validate.validate(m, "1.30", strict=True)
    pods = [
        template["spec"]
        for _, template in pod_templates(manifests)
        if template["metadata"]["labels"][LABEL_COMPONENT] in ("coordinator", "stage")
    ]
    assert len(pods) == 4  # the coordinator and three stages
    for pod in pods:
        volume = {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "clicks-state"}}
        assert volume in pod["volumes"]
        (container,) = pod["containers"]
        mount = {"name": "checkpoints", "mountPath": "/app/state/checkpoints"}
        assert mount in container["volumeMounts"]

    unshared = StreamingJobSpec.model_validate(spec_data(job=job))
    (problem,) = child_problems(NAME, unshared, unshared.job_spec())
    assert "is a local directory" in problem and "spec.checkpointClaim" in problem
    s3 = {**job, "checkpoints": {"storage": "s3://bucket/clicks"}}
    for unused in (
        spec_data(checkpointClaim="clicks-state"),
        spec_data(job=s3, checkpointClaim="x"),
    ):
        spec = StreamingJobSpec.model_validate(unused)
        (problem,) = child_problems(NAME, spec, spec.job_spec())
        assert "is mounted where local checkpoints go, but the job has" in problem


def test_the_output_log_lives_on_a_claim_the_sink_pods_and_spark_sinks_mount() -> None:
    """With spec.output.claim the sink stage writes its log on a ReadWriteMany claim and every
    Spark sink mounts the same claim at the same path (named in KEYSHIFT_OUTPUT), so a query
    reads what the job wrote; no other pod mounts it."""
    sinks = [{"name": "report", "script": "/app/examples/spark/sink_job.py"}]
    spec = StreamingJobSpec.model_validate(spec_data(sinks=sinks, output={"claim": "clicks-out"}))
    assert child_problems(NAME, spec, spec.job_spec()) == []
    _, manifests = build(sinks=sinks, output={"claim": "clicks-out"})
    for m in manifests:
        kubernetes_validate.validate(m, "1.30", strict=True)
    claim = {"name": "output", "persistentVolumeClaim": {"claimName": "clicks-out"}}
    mount = {"name": "output", "mountPath": "/app/out/clicks"}
    mounted = {}
    for name, template in pod_templates(manifests):
        pod = template["spec"]
        (container,) = pod["containers"]
        mounted[name] = claim in pod["volumes"] and mount in container["volumeMounts"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert (env.get("KEYSHIFT_OUTPUT") == "/app/out/clicks") == (name == "clicks-sink-report")
    assert {name for name, yes in mounted.items() if yes} == {"clicks-sink", "clicks-sink-report"}
    # The app has the job file too, for the reader's schema (the `job` option).
    report = by_kind(manifests, "Deployment")["clicks-sink-report"]["spec"]["template"]["spec"]
    job_mount = {"name": "job", "mountPath": JOB_MOUNT, "readOnly": True}
    assert job_mount in report["containers"][0]["volumeMounts"]
    assert {"name": "job", "configMap": {"name": config_map_name(NAME)}} in report["volumes"]


def two_sinks_job() -> dict[str, Any]:
    """A graph job whose keyed stage feeds two log sinks, each in its own directory."""
    return {
        "name": "clicks",
        "graph": [
            {"name": "events", "kind": "source", "config": {"kind": "generator"}},
            {"name": "counts", "kind": "keyed", "input": "events", "key_by": "key"},
            {"name": "all", "kind": "sink", "input": "counts", "parallelism": 2,
             "config": {"kind": "log", "path": "out/all"}},
            {"name": "copy", "kind": "sink", "input": "counts",
             "config": {"kind": "log", "path": "out/copy"}},
        ],
    }  # fmt: skip


def test_each_sink_is_a_statefulset_with_its_own_subdirectory_of_the_output_claim() -> None:
    """Two log sinks: a StatefulSet each at its own width, each mounting its own subdirectory
    of the claim at its log's directory; a Spark sink mounts both, named in KEYSHIFT_OUTPUTS,
    and each sink is rescaled live on its own."""
    sinks = [{"name": "report", "script": "/app/examples/spark/sink_job.py"}]
    spec, manifests = build(job=two_sinks_job(), sinks=sinks, output={"claim": "clicks-out"})
    assert child_problems(NAME, spec, spec.job_spec()) == []
    for m in manifests:
        kubernetes_validate.validate(m, "1.30", strict=True)
    sets = by_kind(manifests, "StatefulSet")
    assert {n: s["spec"]["replicas"] for n, s in sets.items()} == {
        "clicks-events": 1, "clicks-counts": 1, "clicks-all": 2, "clicks-copy": 1
    }  # fmt: skip
    mounts = {
        name: [m for m in t["spec"]["containers"][0]["volumeMounts"] if m["name"] == "output"]
        for name, t in pod_templates(manifests)
    }
    all_mount = {"name": "output", "mountPath": "/app/out/all", "subPath": "all"}
    copy_mount = {"name": "output", "mountPath": "/app/out/copy", "subPath": "copy"}
    assert mounts["clicks-all"] == [all_mount] and mounts["clicks-copy"] == [copy_mount]
    assert mounts["clicks-sink-report"] == [all_mount, copy_mount]
    assert not mounts["clicks-counts"]
    report = by_kind(manifests, "Deployment")["clicks-sink-report"]["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in report["containers"][0]["env"]}
    assert env["KEYSHIFT_OUTPUT"] == "/app/out/all"
    assert json.loads(env["KEYSHIFT_OUTPUTS"]) == {"all": "/app/out/all", "copy": "/app/out/copy"}
    alone = StreamingJobSpec.model_validate(spec_data(job=two_sinks_job()))
    for sink in ("all", "copy"):
        problem = sink_rescale_problem(alone, alone.job_spec(), sink)
        assert problem is not None and f"/app/out/{sink} lives in each sink pod's" in problem


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        # Spark sinks could not read a log in the sink pods' emptyDir.
        ({}, "lives in the sink pods' emptyDir where no other pod can read it"),
        # A claim where no output log files go.
        ({"output": {"claim": "x"}, "format": "none"}, "writes no output log files"),
        ({"output": {"claim": "x"}, "path": "s3://bucket/out"}, "writes no output log files"),
    ],
    ids=["spark-sinks-without-a-claim", "format-none", "object-store-path"],
)
def test_an_output_claim_is_required_where_spark_sinks_read_and_refused_where_unused(
    changes: dict[str, Any], message: str
) -> None:
    job = spec_data()["job"]
    for field in ("format", "path"):
        if field in changes:
            job["sink"]["config"][field] = changes.pop(field)
    sinks = [{"name": "report", "script": "report.py"}]
    spec = StreamingJobSpec.model_validate(spec_data(job=job, sinks=sinks, **changes))
    (problem,) = child_problems(NAME, spec, spec.job_spec())
    assert message in problem and "spec.output.claim" in problem


def test_without_spark_sinks_or_a_claim_the_output_stays_in_the_pods_emptydir() -> None:
    spec = StreamingJobSpec.model_validate(spec_data())
    assert child_problems(NAME, spec, spec.job_spec()) == []
    with pytest.raises(ValueError, match="claim"):
        StreamingJobSpec.model_validate(spec_data(output={"claim": "Not A Name"}))


def test_spark_apps_run_spark_submit_with_the_job_in_their_environment() -> None:
    _, manifests = build()
    spark = by_kind(manifests, "Deployment")["clicks-source-events"]
    assert spark["spec"]["strategy"] == {"type": "Recreate"}
    assert spark["spec"]["template"]["metadata"]["labels"][LABEL_COMPONENT] == "source"
    (container,) = spark["spec"]["template"]["spec"]["containers"]
    assert container["command"] == [
        "spark-submit",
        "--master",
        "local[*]",
        "/app/spark/events.py",
        "--rate",
        "100",
    ]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["KEYSHIFT_JOB"] == NAME
    assert env["KEYSHIFT_ROLE"] == "source"
    assert env["KEYSHIFT_COORDINATOR"] == "clicks-coordinator.streams.svc:7000"
    assert "KEYSHIFT_INGEST" not in env  # the job's source is a generator


def test_an_ingest_source_is_reachable_by_the_spark_sources() -> None:
    job = spec_data()["job"]
    job["source"]["config"] = {"kind": "ingest", "port": 7200}
    _, manifests = build(job=job, sinks=[{"name": "report", "script": "report.py"}])
    for m in manifests:
        kubernetes_validate.validate(m, "1.30", strict=True)
    service = by_kind(manifests, "Service")["clicks-source"]
    assert {"name": "ingest", "port": 7200, "targetPort": "ingest", "protocol": "TCP"} in service[
        "spec"
    ]["ports"]
    deployments = by_kind(manifests, "Deployment")
    source = deployments["clicks-source-events"]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in source["env"]}
    assert env["KEYSHIFT_INGEST"] == "clicks-source.streams.svc:7200"
    sink = deployments["clicks-sink-report"]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in sink["env"]}
    assert env["KEYSHIFT_ROLE"] == "sink"
    assert "KEYSHIFT_INGEST" not in env


def test_child_problems() -> None:
    spec = StreamingJobSpec.model_validate(spec_data())
    assert child_problems(NAME, spec, spec.job_spec()) == []
    assert child_problems("Bad.Name", spec, spec.job_spec())
    assert child_problems("x" * 50, spec, spec.job_spec())  # x...x-counts is too long
    job = spec_data()["job"]
    job["keyed"]["name"] = "coordinator"
    spec = StreamingJobSpec.model_validate(spec_data(job=job))
    (problem,) = child_problems(NAME, spec, spec.job_spec())
    assert "clicks-coordinator" in problem
    job = spec_data()["job"]
    job["source"]["config"] = {"kind": "ingest"}
    spec = StreamingJobSpec.model_validate(spec_data(job=job))
    (problem,) = child_problems(NAME, spec, spec.job_spec())
    assert "port" in problem


def test_deep_merge() -> None:
    base = {"a": {"b": 1, "c": [1, 2]}, "d": "x", "e": {"f": 1}}
    override = {"a": {"c": [3], "g": {"h": 1}}, "d": "y", "e": None, "i": [{"j": 1}]}
    merged = deep_merge(base, override)
    assert merged == {"a": {"b": 1, "c": [3], "g": {"h": 1}}, "d": "y", "i": [{"j": 1}]}
    # Neither input changes, and the result shares nothing mutable with them.
    assert base == {"a": {"b": 1, "c": [1, 2]}, "d": "x", "e": {"f": 1}}
    merged["a"]["g"]["h"] = 2
    merged["i"][0]["j"] = 2
    assert override["a"] == {"c": [3], "g": {"h": 1}}
    assert override["i"] == [{"j": 1}]
    assert deep_merge({}, {}) == {}
    assert deep_merge({"a": {"b": 1}}, {"a": 5}) == {"a": 5}
    assert deep_merge({"a": 5}, {"a": {"b": 1}}) == {"a": {"b": 1}}
    keyed = deep_merge(
        {"items": [{"name": "x", "v": 1, "w": 1}]},
        {"items": [{"name": "x", "v": 2}, {"name": "y"}]},
        {"items": "name"},
    )
    assert keyed == {"items": [{"name": "x", "v": 2, "w": 1}, {"name": "y"}]}


@pytest.mark.parametrize(
    ("text", "hostname", "expected"),
    [
        ("hostname", "job-counts-3", 3),
        ("hostname", "clicks-source-0", 0),
        ("7", "", 7),
        ("0", "", 0),
    ],
)
def test_index_parser(
    text: str, hostname: str, expected: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOSTNAME", hostname)
    assert _index(text) == expected


@pytest.mark.parametrize(
    ("text", "hostname"),
    [
        ("hostname", "nohyphen"),
        ("hostname", "job-counts-"),
        ("hostname", ""),
        ("-1", ""),
        ("x", ""),
    ],
)
def test_index_parser_refuses(text: str, hostname: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOSTNAME", hostname)
    with pytest.raises(argparse.ArgumentTypeError):
        _index(text)


# -- the operator's options: NetworkPolicy, PodDisruptionBudgets, the default image --------------

OPERATOR_PEER = {
    "namespaceLabels": {"kubernetes.io/metadata.name": "keyshift-system"},
    "podLabels": {"app.kubernetes.io/name": "keyshift", "app.kubernetes.io/component": "operator"},
}
PROMETHEUS_PEER = {
    "namespaceLabels": {"kubernetes.io/metadata.name": "monitoring"},
    "podLabels": {"app.kubernetes.io/name": "prometheus"},
}
OPTIONS = {
    "jobImage": "ghcr.io/keyshift/keyshift@sha256:" + "ab" * 32,
    "networkPolicy": {
        "operator": OPERATOR_PEER,
        "prometheus": PROMETHEUS_PEER,
        "sparkClients": [{"podLabels": {"spark-role": "driver"}}, {"namespaceLabels": {}}],
    },
    "podDisruptionBudget": {"maxUnavailable": 2},
}


def build_with(options: dict[str, Any], **changes: Any) -> list[dict[str, Any]]:
    spec = StreamingJobSpec.model_validate(spec_data(**changes))
    parsed = ChildOptions.model_validate(options)
    return children(NAME, NAMESPACE, spec, spec.job_spec(), options=parsed)


def pods_of(manifests: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {name: t["metadata"]["labels"] for name, t in pod_templates(manifests)}


def test_no_policy_or_budget_unless_the_options_say_so() -> None:
    _, manifests = build()
    assert not by_kind(manifests, "NetworkPolicy") and not by_kind(manifests, "PodDisruptionBudget")


def test_the_network_policy_lets_in_only_the_job_the_operator_prometheus_and_spark_clients() -> (
    None
):
    job = spec_data()["job"]
    job["source"]["config"] = {"kind": "ingest", "port": 7200}
    manifests = build_with(OPTIONS, job=job)
    for m in manifests:
        kubernetes_validate.validate(m, "1.30", strict=True)
        assert COMMON.items() <= m["metadata"]["labels"].items()
    assert manifests[0]["kind"] == "NetworkPolicy"  # before any pod exists
    (policy,) = by_kind(manifests, "NetworkPolicy").values()
    assert policy["metadata"]["name"] == NAME
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]  # egress is left alone
    # It selects every pod of the job (Spark apps included), and only them.
    selector = spec["podSelector"]["matchLabels"].items()
    assert all(selector <= labels.items() for labels in pods_of(manifests).values())
    # Another job's pods in the namespace are not selected.
    spec_other = StreamingJobSpec.model_validate(spec_data())
    other = children("views", NAMESPACE, spec_other, spec_other.job_spec())
    assert not any(selector <= labels.items() for labels in pods_of(other).values())
    own, operator, prometheus, clients = spec["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": {LABEL_JOB: NAME}}}]}
    assert operator == {
        "from": [
            {
                "namespaceSelector": {"matchLabels": OPERATOR_PEER["namespaceLabels"]},
                "podSelector": {"matchLabels": OPERATOR_PEER["podLabels"]},
            }
        ],
        "ports": [{"protocol": "TCP", "port": COORDINATOR_PORT}],
    }
    assert prometheus["ports"] == [{"protocol": "TCP", "port": METRICS_PORT}]
    assert prometheus["from"][0]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "prometheus"
    }
    # A client without namespace labels is one of the job's namespace; `{}` is any namespace.
    assert clients["from"] == [
        {"podSelector": {"matchLabels": {"spark-role": "driver"}}},
        {"podSelector": {"matchLabels": {}}, "namespaceSelector": {"matchLabels": {}}},
    ]
    assert [p["port"] for p in clients["ports"]] == [COORDINATOR_PORT, 7200]


def test_without_spark_clients_or_an_ingest_port_the_policy_has_no_client_rule() -> None:
    options = {**OPTIONS, "networkPolicy": {"operator": OPERATOR_PEER, "prometheus": {}}}
    (policy,) = by_kind(build_with(options), "NetworkPolicy").values()
    assert len(policy["spec"]["ingress"]) == 3
    # An empty Prometheus peer: any pod of the job's namespace (never the whole cluster).
    assert policy["spec"]["ingress"][2]["from"] == [{"podSelector": {"matchLabels": {}}}]
    (policy,) = by_kind(build_with(OPTIONS), "NetworkPolicy").values()  # a generator source
    assert [p["port"] for p in policy["spec"]["ingress"][3]["ports"]] == [COORDINATOR_PORT]


def test_each_stage_gets_a_disruption_budget_over_its_pods() -> None:
    manifests = build_with(OPTIONS)
    budgets = by_kind(manifests, "PodDisruptionBudget")
    sets = by_kind(manifests, "StatefulSet")
    assert (
        set(budgets) == set(sets) == {stage_set_name(NAME, s) for s in ("source", "counts", "sink")}
    )
    for name, budget in budgets.items():
        kubernetes_validate.validate(budget, "1.30", strict=True)
        assert budget["spec"]["maxUnavailable"] == 2
        # It selects exactly its stage's pods.
        selector = budget["spec"]["selector"]["matchLabels"].items()
        matched = [n for n, labels in pods_of(manifests).items() if selector <= labels.items()]
        assert matched == [name]
    names = [(m["kind"], m["metadata"]["name"]) for m in manifests]
    # Each stage's budget right after its StatefulSet.
    for stage in ("source", "counts", "sink"):
        at = names.index(("StatefulSet", stage_set_name(NAME, stage)))
        assert names[at + 1] == ("PodDisruptionBudget", stage_set_name(NAME, stage))


def test_a_job_without_an_image_runs_the_operators_job_image() -> None:
    data = spec_data()
    del data["image"]
    spec = StreamingJobSpec.model_validate(data)
    (problem,) = child_problems(NAME, spec, spec.job_spec())
    assert "spec.image is not set" in problem and CHILD_OPTIONS_ENV in problem
    options = ChildOptions.model_validate(OPTIONS)
    assert child_problems(NAME, spec, spec.job_spec(), options) == []
    manifests = children(NAME, NAMESPACE, spec, spec.job_spec(), options=options)
    images = {c["image"] for _, t in pod_templates(manifests) for c in t["spec"]["containers"]}
    assert images == {OPTIONS["jobImage"]}
    # A job's own image wins over the operator's.
    assert {
        c["image"] for _, t in pod_templates(build_with(OPTIONS)) for c in t["spec"]["containers"]
    } == {spec_data()["image"]}


def test_options_are_read_from_the_environment() -> None:
    assert child_options_from_env({}) == ChildOptions()
    assert child_options_from_env({CHILD_OPTIONS_ENV: " "}) == ChildOptions()
    parsed = child_options_from_env({CHILD_OPTIONS_ENV: json.dumps(OPTIONS)})
    assert parsed == ChildOptions.model_validate(OPTIONS)
    assert parsed.network_policy is not None and len(parsed.network_policy.spark_clients) == 2


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("{", "Invalid JSON"),
        ('{"networkPolicy": {"operator": {}}}', "networkPolicy.prometheus: Field required"),
        ('{"podDisruptionBudget": {"maxUnavailable": 0}}', "podDisruptionBudget.maxUnavailable"),
        ('{"jobImage": ""}', "jobImage"),
        ('{"networkPolicies": {}}', "networkPolicies: Extra inputs are not permitted"),
        (
            '{"networkPolicy": {"operator": {"podLabels": {"a": 1}}, "prometheus": {}}}',
            "podLabels.a",
        ),
    ],
)
def test_bad_options_are_refused_naming_the_field(raw: str, message: str) -> None:
    with pytest.raises(ChildOptionsError, match=re.escape(message)) as failed:
        child_options_from_env({CHILD_OPTIONS_ENV: raw})
    assert str(failed.value).startswith(f"{CHILD_OPTIONS_ENV}: ")


@pytest.mark.live
def test_keyshift_operator_refuses_bad_options_before_it_starts(tmp_path: Path) -> None:
    """The entry point: a bad KEYSHIFT_CHILD_OPTIONS stops `keyshift operator` at once, naming
    the field (before it looks for cluster credentials, which this machine has none of)."""
    bad = '{"podDisruptionBudget": {"maxUnavailable": "two"}}'
    out = subprocess.run(
        [KEYSHIFT, "operator"],
        env={**os.environ, CHILD_OPTIONS_ENV: bad, "KUBECONFIG": str(tmp_path / "none")},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    text = " ".join((out.stdout + out.stderr).split())
    assert f"{CHILD_OPTIONS_ENV}: podDisruptionBudget.maxUnavailable" in text


@pytest.mark.parametrize("path", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_manifest_renders_valid_children(path: Path) -> None:
    """The examples a user applies: each StreamingJob's children, and the other objects in the
    file (a claim), are valid Kubernetes objects; a job's Spark sinks find its output claim."""
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d]
    jobs = [d for d in documents if d.get("kind") == "StreamingJob"]
    for other in (d for d in documents if d.get("kind") != "StreamingJob"):
        if "apiVersion" in other:
            kubernetes_validate.validate(other, "1.30", strict=True)
    claims = {d["metadata"]["name"] for d in documents if d.get("kind") == "PersistentVolumeClaim"}
    for document in jobs:
        spec = StreamingJobSpec.model_validate(document["spec"])
        assert spec.problems() == []
        name = document["metadata"]["name"]
        for manifest in children(name, "examples", spec, spec.job_spec()):
            kubernetes_validate.validate(manifest, "1.30", strict=True)
        if spec.sinks:
            assert spec.output is not None and spec.output.claim in claims


def test_a_keyed_stage_on_rocksdb_gets_a_writable_state_directory_and_the_others_none() -> None:
    """The root filesystem is read-only: the RocksDB state path is an emptyDir in the keyed
    pods (rebuilt from checkpoints at every start), and no other pod mounts one."""
    job = spec_data()["job"]
    job["keyed"]["state"] = {"backend": "rocksdb", "path": "state", "block_cache_mb": 32}
    _, manifests = build(job=job)
    for m in manifests:
        kubernetes_validate.validate(m, "1.30", strict=True)
    for name, template in pod_templates(manifests):
        pod = template["spec"]
        (container,) = pod["containers"]
        mounts = [m for m in container.get("volumeMounts", []) if m["name"] == "state"]
        if name == f"{NAME}-counts":
            assert mounts == [{"name": "state", "mountPath": "/app/state"}]
            assert {"name": "state", "emptyDir": {}} in pod["volumes"]
        else:
            assert mounts == [], name
    _, in_memory = build()
    assert all(
        v["name"] != "state" for _, t in pod_templates(in_memory) for v in t["spec"]["volumes"]
    )


def test_a_keyed_stage_on_rocksdb_requests_the_memory_its_cache_and_write_buffers_need() -> None:
    """Raised to base + cache + two write buffers (limit: plus headroom), never lowered; the
    other stages keep the job's resources."""
    job = spec_data()["job"]
    job["keyed"]["state"] = {"backend": "rocksdb", "block_cache_mb": 1024, "write_buffer_mb": 64}
    _, manifests = build(job=job)
    request = PROCESS_BASE_MIB + 1024 + 2 * 64
    resources = {
        name: t["spec"]["containers"][0]["resources"] for name, t in pod_templates(manifests)
    }
    assert resources[f"{NAME}-counts"] == {
        "requests": {"cpu": "100m", "memory": f"{request}Mi"},
        "limits": {"memory": f"{request + HEADROOM_MIB}Mi"},
    }
    assert resources[f"{NAME}-sink"]["requests"]["memory"] == "128Mi"
    # A job that asks for more keeps what it asks for.
    small: dict[str, Any] = {"backend": "rocksdb", "block_cache_mb": 8, "write_buffer_mb": 1}
    job["keyed"]["state"] = small
    _, manifests = build(job=job)
    (counts,) = [t for name, t in pod_templates(manifests) if name == f"{NAME}-counts"]
    assert counts["spec"]["containers"][0]["resources"]["limits"] == {"memory": "512Mi"}
    assert state_memory_mib(StateSettings(**small))[0] == PROCESS_BASE_MIB + 8 + 2


@pytest.mark.parametrize("bad", ["", "1.", "12Q", "-1Mi", "Mi"])
def test_a_quantity_that_is_not_kubernetes_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        quantity_bytes(bad)
    assert quantity_bytes("1.5Gi") == 1.5 * 2**30 and quantity_bytes("250m") == 0.25


def test_a_job_written_as_a_graph_gets_a_stateful_set_per_process_stage() -> None:
    graph = [
        {"name": "clicks", "kind": "source", "parallelism": 2, "config": {"kind": "generator"}},
        {"name": "keep", "kind": "filter", "input": "clicks", "function": "mod:keep",
         "parallelism": 2},
        {"name": "counts", "kind": "keyed", "input": "keep", "key_by": "key", "parallelism": 3},
        {"name": "out", "kind": "sink", "input": "counts", "config": {"kind": "log"}},
    ]  # fmt: skip
    spec, manifests = build(job={"name": "clicks", "graph": graph})
    sets = by_kind(manifests, "StatefulSet")
    # The filter runs chained in the source's pods: it has no StatefulSet of its own.
    assert {name: s["spec"]["replicas"] for name, s in sets.items()} == {
        "clicks-clicks": 2,
        "clicks-counts": 3,
        "clicks-out": 1,
    }
    text = by_kind(manifests, "ConfigMap")[config_map_name(NAME)]["data"][JOB_FILE]
    assert "graph" in yaml.safe_load(text)
    loaded = parse_job_as(AutoscaledJob, yaml.safe_load(text), resolve_functions=False)
    assert loaded == spec.job_spec()


def test_the_sink_rescales_only_where_every_sink_pod_sees_its_output_log() -> None:
    """Its partitions move between sink pods: a log on each pod's own emptyDir would strand
    them; a shared claim, or a sink that writes no files, rescales."""
    alone = StreamingJobSpec.model_validate(spec_data())
    problem = sink_rescale_problem(alone, alone.job_spec(), "sink")
    assert (
        problem is not None and "/app/out/clicks lives in each sink pod's own emptyDir" in problem
    )
    assert "give spec.output.claim" in problem
    shared = StreamingJobSpec.model_validate(spec_data(output={"claim": "clicks-out"}))
    assert sink_rescale_problem(shared, shared.job_spec(), "sink") is None
    job = spec_data()["job"]
    job["sink"]["config"]["format"] = "none"
    offsets = StreamingJobSpec.model_validate(spec_data(job=job))
    assert sink_rescale_problem(offsets, offsets.job_spec(), "sink") is None
