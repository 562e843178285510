"""Tests of keyshift.operator.k8s_children: the manifests a StreamingJob becomes.

Every manifest must pass the Kubernetes 1.30 schema (strict: no unknown fields), names, labels
and selectors must fit together, replicas follow the job or the operator's current counts, the
job file in the ConfigMap must read back as the same job, every pod must be locked down, and
the podTemplate must merge in without moving a pod out of its selector. Also the instance's
`--index hostname` parser, which the StatefulSets rely on.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import kubernetes_validate
import pytest
import yaml

from keyshift.operator.k8s_children import (
    APP_DIR,
    COORDINATOR_PORT,
    DATA_PORT,
    JOB_FILE,
    JOB_MOUNT,
    LABEL_COMPONENT,
    LABEL_JOB,
    LABEL_STAGE,
    METRICS_PORT,
    child_problems,
    children,
    config_map_name,
    coordinator_address,
    coordinator_service_name,
    deep_merge,
    stage_selector,
    stage_set_name,
)
from keyshift.operator.streamingjob import StreamingJobSpec
from keyshift.runtime.instance import _index
from keyshift.runtime.job import parse_job

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
    replicas: dict[str, int] | None = None, **changes: Any
) -> tuple[StreamingJobSpec, list[dict[str, Any]]]:
    spec = StreamingJobSpec.model_validate(spec_data(**changes))
    return spec, children(NAME, NAMESPACE, spec, spec.job_spec(), replicas)


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


def test_replicas_follow_the_job_unless_the_operator_passes_current_ones() -> None:
    _, manifests = build()
    sets = by_kind(manifests, "StatefulSet")
    assert {n: s["spec"]["replicas"] for n, s in sets.items()} == {
        "clicks-source": 1,
        "clicks-counts": 2,
        "clicks-sink": 1,
    }
    _, manifests = build(replicas={"counts": 5})
    sets = by_kind(manifests, "StatefulSet")
    assert sets["clicks-counts"]["spec"]["replicas"] == 5
    assert sets["clicks-source"]["spec"]["replicas"] == 1


def test_the_config_map_holds_the_same_job() -> None:
    spec, manifests = build()
    config = by_kind(manifests, "ConfigMap")[config_map_name(NAME)]
    text = config["data"][JOB_FILE]
    assert parse_job(yaml.safe_load(text), resolve_functions=False) == spec.job_spec()
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
