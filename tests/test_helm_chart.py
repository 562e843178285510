"""Tests of the Helm chart helm/keyshift, rendered and linted offline with helm-python-sdk (real
Helm, no cluster, no network).

For the default values and each documented combination: `helm lint --strict` is clean for the
oldest and newest Kubernetes versions the chart claims, and every rendered manifest passes
kubernetes-validate in strict mode for both (the Prometheus Operator's kinds, which it does not
know, get a structural check here). Also: the RBAC is exactly what the operator and kopf use,
with no wildcard, per namespace when namespaces are listed; the operator Deployment runs
`keyshift operator` with the namespaces, locked down; the PodMonitor selects the job pods the
operator creates and not the operator; the alerts use only metrics the runtime exports and pass
promtool; each dashboards/*.json becomes a labelled ConfigMap; the chart's CRD is the generated
one; values.schema.json refuses wrong types with a message naming the value; every value in
values.yaml is documented and in the schema.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from helm_python.chart import Chart, lint
from helm_python.errors import HelmValuesError

from keyshift.operator.crd import CRD_FILE
from keyshift.operator.k8s_children import ChildOptions, child_options_from_env, children
from keyshift.operator.streamingjob import StreamingJob
from keyshift.runtime.metrics import INSTANCE_LABEL, JOB_LABEL, NAMESPACE_LABEL, MetricName

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "helm" / "keyshift"
RELEASE = "keyshift"
NAMESPACE = "keyshift"
IMAGE = "ghcr.io/keyshift/keyshift"
# The chart's kubeVersion is ">=1.27.0-0": the oldest version it claims, and the newest that
# kubernetes-validate knows.
OLDEST = "1.27.0"
NEWEST = kubernetes_validate.utils.latest_version()
VERSIONS = (OLDEST, NEWEST)
MONITORING = "monitoring.coreos.com/v1"
OUR_LABELS = {JOB_LABEL, INSTANCE_LABEL, NAMESPACE_LABEL}  # keyshift_* names that are labels
DIGEST = "sha256:" + "0123456789abcdef" * 4

COMBINATIONS: dict[str, dict[str, Any]] = {
    "default": {},
    "namespaced": {"watchNamespaces": ["team-a", "team-b"]},
    "monitoring": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        "podMonitor": {"enabled": True, "interval": "10s"},
        "prometheusRule": {
            "enabled": True,
            "latencyThresholdSeconds": 2.5,
            "alertLabels": {"team": "data"},
        },
    },
    "namespaced-monitoring": {
        "watchNamespaces": ["team-a"],
        "serviceMonitor": {"enabled": True},
        "podMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True},
    },
    "runbook-mirror": {
        "prometheusRule": {"enabled": True, "runbookBaseUrl": "https://docs.example/rb.md"}
    },
    "no-dashboards": {"dashboards": {"enabled": False}},
    "custom": {
        "image": {"repository": "registry.example/keyshift", "tag": "1.2", "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "registry"}],
        "resources": {
            "requests": {"cpu": "250m", "memory": "300Mi"},
            "limits": {"cpu": 2, "memory": "1Gi"},
        },
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": "pool", "operator": "In", "values": ["system"]}
                            ]
                        }
                    ]
                }
            }
        },
        "podLabels": {"team": "data", "app.kubernetes.io/component": "not-the-selector"},
        "podAnnotations": {"example.com/owner": "data"},
        "priorityClassName": "system-cluster-critical",
        "serviceAccount": {"annotations": {"iam.example/role": "keyshift"}},
        "metricsService": {"annotations": {"example.com/scrape": "true"}},
    },
    "own-rbac": {"serviceAccount": {"create": False, "name": "ops"}, "rbac": {"create": False}},
    "isolation": {
        "image": {"digest": DIGEST},
        "networkPolicy": {
            "enabled": True,
            "sparkClients": [
                {"podLabels": {"spark-role": "driver"}},
                {"podLabels": {"app": "etl"}, "namespaceLabels": {"team": "data"}},
            ],
        },
        "podDisruptionBudget": {"enabled": True, "maxUnavailable": 2},
    },
    "namespaced-isolation": {
        "watchNamespaces": ["team-a"],
        "networkPolicy": {
            "enabled": True,
            # Helm merges maps into the defaults: null drops a default key.
            "prometheus": {
                "namespaceLabels": None,
                "podLabels": {"app": "prometheus", "app.kubernetes.io/name": None},
            },
        },
        "podDisruptionBudget": {"enabled": True},
    },
}

# What the operator and kopf do, per (API group, resource): see the comments in
# templates/_helpers.tpl and the README's "Installing with Helm".
NAMESPACED_RULES = {
    ("keyshift.io", "streamingjobs"): {"list", "watch", "patch"},
    ("keyshift.io", "streamingjobs/status"): {"patch"},
    ("keyshift.io", "streamingjobs/finalizers"): {"update"},
    ("", "configmaps"): {"create", "patch"},
    ("", "services"): {"create", "patch"},
    ("", "secrets"): {"get", "create"},
    ("apps", "deployments"): {"create", "patch"},
    ("apps", "statefulsets"): {"get", "create", "patch"},
    ("", "events"): {"create"},
}
ISOLATION_RULES = {
    ("networking.k8s.io", "networkpolicies"): {"create", "patch"},
    ("policy", "poddisruptionbudgets"): {"create", "patch"},
}
CRD_RULES = {("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"}}
NAMESPACE_RULES = {("", "namespaces"): {"list", "watch"}}
PLURALS = {"ConfigMap": "configmaps", "Service": "services"}
PLURALS |= {"Deployment": "deployments", "StatefulSet": "statefulsets"}
PLURALS |= {"NetworkPolicy": "networkpolicies", "PodDisruptionBudget": "poddisruptionbudgets"}


# -- rendering -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chart() -> Iterator[Chart]:
    with Chart.load(CHART) as loaded:
        yield loaded


def documents(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """The manifests of a render (NOTES.txt left out), in a stable order."""
    docs: list[dict[str, Any]] = []
    for path in sorted(rendered):
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(rendered[path]) if d is not None)
    return docs


@cache
def _render(combination: str) -> tuple[dict[str, str], list[dict[str, Any]]]:
    with Chart.load(CHART) as loaded:
        values = copy.deepcopy(COMBINATIONS[combination])
        rendered = loaded.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return rendered, documents(rendered)


def render(combination: str) -> list[dict[str, Any]]:
    return copy.deepcopy(_render(combination)[1])


def notes(combination: str) -> str:
    rendered = _render(combination)[0]
    return next(text for path, text in rendered.items() if path.endswith("NOTES.txt"))


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = of_kind(docs, kind)
    assert len(found) == 1, f"{len(found)} {kind}s"
    return found[0]


def operator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    containers = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


# -- lint and schemas ---------------------------------------------------------------------------


@pytest.mark.parametrize("combination", sorted(COMBINATIONS))
def test_lint_is_clean_in_strict_mode(combination: str) -> None:
    for version in VERSIONS:
        report = lint(
            CHART,
            copy.deepcopy(COMBINATIONS[combination]),
            strict=True,
            namespace=NAMESPACE,
            kube_version=f"v{version}",
        )
        assert report["errors"] == [], report
        # Only the info that the chart has no icon (we have none to point at).
        problems = [m for m in report["messages"] if m["error"] != "icon is recommended"]
        assert problems == [], report


def validate_monitoring(doc: dict[str, Any]) -> None:
    """kubernetes-validate does not know the Prometheus Operator's kinds: their shape here."""
    assert doc["apiVersion"] == MONITORING
    metadata = doc["metadata"]
    assert set(metadata) <= {"name", "namespace", "labels", "annotations"}
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", metadata["name"])
    assert metadata["namespace"] == NAMESPACE
    assert all(isinstance(v, str) for v in metadata["labels"].values())
    spec = doc["spec"]
    if doc["kind"] == "ServiceMonitor":
        assert set(spec) == {"selector", "namespaceSelector", "endpoints"}
        assert set(spec["selector"]) == {"matchLabels"}
    elif doc["kind"] == "PodMonitor":
        assert set(spec) == {"selector", "namespaceSelector", "podMetricsEndpoints"}
        assert set(spec["selector"]) == {"matchLabels"}
    elif doc["kind"] == "PrometheusRule":
        assert set(spec) == {"groups"}
        for group in spec["groups"]:
            assert set(group) == {"name", "rules"}
            for rule in group["rules"]:
                assert {"alert", "expr", "labels", "annotations"} <= set(rule)
                assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}
                assert all(isinstance(v, str) for v in rule["annotations"].values())
    else:
        raise AssertionError(f"unexpected kind {doc['kind']}")
    for endpoint in spec.get("endpoints", []) + spec.get("podMetricsEndpoints", []):
        # No honorLabels: keyshift's labels (keyshift_job, keyshift_instance) never collide with
        # the target labels, which stay Prometheus' own.
        assert set(endpoint) == {"port", "path", "interval"}
        assert endpoint["port"] == "metrics"


@pytest.mark.parametrize("combination", sorted(COMBINATIONS))
def test_every_manifest_passes_the_kubernetes_schemas(combination: str) -> None:
    docs = render(combination)
    assert docs
    for doc in docs:
        if doc["apiVersion"] == MONITORING:
            validate_monitoring(doc)
            continue
        for version in VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
        assert doc["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
        assert doc["metadata"]["labels"]["helm.sh/chart"] == "keyshift-0.1.0"
    names = [(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), "two manifests with the same kind and name"


def test_the_crd_is_the_generated_one_and_valid(chart: Chart) -> None:
    ours = CHART / "crds" / CRD_FILE
    assert ours.read_bytes() == (REPO / "crds" / CRD_FILE).read_bytes()
    assert [c["filename"] for c in chart.crds] == [f"keyshift/crds/{CRD_FILE}"]
    assert chart.crds[0]["data"].encode() == ours.read_bytes()
    crd = yaml.safe_load(ours.read_text(encoding="utf-8"))
    for version in VERSIONS:
        kubernetes_validate.validate(crd, version, strict=True)
    # crds/ is installed by Helm itself, never rendered as a template.
    assert not of_kind(render("default"), "CustomResourceDefinition")


def test_chart_metadata(chart: Chart) -> None:
    meta = chart.metadata
    assert meta["apiVersion"] == "v2" and meta["name"] == "keyshift"
    assert meta["version"] == "0.1.0" and meta["appVersion"] == "0.1.0"
    assert meta["kubeVersion"] == ">=1.27.0-0"


BAD_VALUES = [
    ({"replicas": 2}, "additional properties 'replicas' not allowed"),
    ({"image": {"tag": 1.2}}, "at '/image/tag': got number, want string"),
    ({"image": {"pullPolicy": "Sometimes"}}, "at '/image/pullPolicy'"),
    ({"watchNamespaces": "team-a"}, "at '/watchNamespaces': got string, want array"),
    ({"watchNamespaces": [7]}, "at '/watchNamespaces/0': got number, want string"),
    ({"watchNamespaces": ["Team A"]}, "at '/watchNamespaces/0'"),
    (
        {"serviceMonitor": {"enabled": "yes"}},
        "at '/serviceMonitor/enabled': got string, want boolean",
    ),
    ({"podMonitor": {"enabled": 1}}, "at '/podMonitor/enabled': got number, want boolean"),
    ({"dashboards": {"enabled": "false"}}, "at '/dashboards/enabled': got string, want boolean"),
    ({"rbac": {"create": "no"}}, "at '/rbac/create': got string, want boolean"),
    ({"prometheusRule": {"latencyThresholdSeconds": 0}}, "/prometheusRule/latencyThresholdSeconds"),
    (
        {"prometheusRule": {"latencyThresholdSeconds": -1}},
        "/prometheusRule/latencyThresholdSeconds",
    ),
    ({"prometheusRule": {"latencyThresholdSeconds": "5"}}, "got string, want number"),
    ({"serviceMonitor": {"interval": "often"}}, "at '/serviceMonitor/interval'"),
    ({"prometheusRule": {"runbookBaseUrl": "docs/runbook.md"}}, "/prometheusRule/runbookBaseUrl"),
    (
        {"prometheusRule": {"runbookBaseUrl": "https://x.example/runbook.md#top"}},
        "/prometheusRule/runbookBaseUrl",
    ),
    ({"resources": {"requests": {"gpu": 1}}}, "additional properties 'gpu' not allowed"),
    ({"image": {"registry": "x"}}, "additional properties 'registry' not allowed"),
    ({"image": {"digest": "sha256:abc"}}, "at '/image/digest'"),
    ({"image": {"digest": "0.1.0"}}, "at '/image/digest'"),
    ({"networkPolicy": {"enabled": "yes"}}, "at '/networkPolicy/enabled': got string"),
    ({"networkPolicy": {"sparkClients": [{}]}}, "at '/networkPolicy/sparkClients/0'"),
    ({"networkPolicy": {"prometheus": {"podLabels": {"a": 1}}}}, "/networkPolicy/prometheus"),
    ({"networkPolicy": {"ports": [7000]}}, "additional properties 'ports' not allowed"),
    ({"podDisruptionBudget": {"maxUnavailable": 0}}, "at '/podDisruptionBudget/maxUnavailable'"),
    ({"podDisruptionBudget": {"minAvailable": 1}}, "additional properties 'minAvailable'"),
]


@pytest.mark.parametrize(("values", "message"), BAD_VALUES, ids=[m for _, m in BAD_VALUES])
def test_schema_refuses_wrong_values(chart: Chart, values: dict[str, Any], message: str) -> None:
    with pytest.raises(HelmValuesError, match=re.escape(message)) as failed:
        chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    assert "values don't meet the specifications of the schema" in str(failed.value)
    report = lint(CHART, values, strict=True, namespace=NAMESPACE, kube_version=f"v{OLDEST}")
    assert any(message in error for error in report["errors"]), report


def test_schema_is_draft_07_and_takes_the_defaults(chart: Chart) -> None:
    schema = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    assert schema["additionalProperties"] is False
    jsonschema.Draft7Validator.check_schema(schema)
    defaults = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    jsonschema.Draft7Validator(schema).validate(defaults)
    for values in COMBINATIONS.values():
        chart.validate_schema(chart.merge_values(copy.deepcopy(values)))


def _schema_paths(schema: dict[str, Any], prefix: str = "") -> set[str]:
    paths = set()
    for key, sub in schema.get("properties", {}).items():
        paths.add(prefix + key)
        paths |= _schema_paths(sub, f"{prefix}{key}.")
    return paths


def _value_paths(values: dict[str, Any], schema: dict[str, Any], prefix: str = "") -> set[str]:
    """Paths of values.yaml's keys, down to where the schema stops naming properties."""
    paths = set()
    for key, value in values.items():
        paths.add(prefix + key)
        sub = schema.get("properties", {}).get(key, {})
        if isinstance(value, dict) and "properties" in sub:
            paths |= _value_paths(value, sub, f"{prefix}{key}.")
    return paths


def test_every_value_is_in_the_schema_and_every_property_in_values() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
    defaults = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    declared = _schema_paths(schema) - {"global"}
    assert _value_paths(defaults, schema) == declared


KEY = re.compile(r"^(?P<indent>\s*)(?P<key>[A-Za-z0-9_.-]+):(?P<rest>.*)$")


def test_every_value_is_documented() -> None:
    """values.yaml: a comment line right above every leaf key (a value on the key's line, or a
    list below it)."""
    lines = (CHART / "values.yaml").read_text(encoding="utf-8").splitlines()
    undocumented = []
    leaves = 0
    for i, line in enumerate(lines):
        match = KEY.match(line)
        if not match:
            continue
        rest = match["rest"].split(" #")[0].strip()
        following = next(
            (n for n in lines[i + 1 :] if n.strip() and not n.strip().startswith("#")), ""
        )
        is_list = following.strip().startswith("- ")
        if not rest and not is_list:
            continue  # a mapping: its keys are documented one by one
        leaves += 1
        if i == 0 or not lines[i - 1].strip().startswith("#"):
            undocumented.append(line.strip())
    assert leaves > 30
    assert undocumented == []


# -- the operator ---------------------------------------------------------------------------------


def test_operator_deployment() -> None:
    docs = render("default")
    deployment = one(docs, "Deployment")
    assert deployment["metadata"]["name"] == RELEASE
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    assert pod["serviceAccountName"] == one(docs, "ServiceAccount")["metadata"]["name"]
    container = operator_container(docs)
    assert container["image"] == f"{IMAGE}:0.1.0"
    assert container["imagePullPolicy"] == "IfNotPresent"
    assert container["command"] == ["keyshift"]
    assert container["args"] == ["operator", "--liveness-port", "8080", "--metrics-port", "9100"]
    probe = container["livenessProbe"]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert probe["path"] == "/healthz" and ports[probe["port"]] == 8080
    assert ports["metrics"] == 9100
    assert container["resources"] == {
        "requests": {"cpu": "100m", "memory": "256Mi"},
        "limits": {"cpu": "1", "memory": "512Mi"},
    }
    assert {k: pod["securityContext"][k] for k in ("runAsNonRoot", "runAsUser")} == {
        "runAsNonRoot": True,
        "runAsUser": 10001,
    }
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == 10001
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/tmp"]] == {"name": mounts["/tmp"], "emptyDir": {}}
    for key in ("nodeSelector", "tolerations", "affinity", "imagePullSecrets"):
        assert key not in pod


def test_operator_args_name_the_watched_namespaces() -> None:
    args = operator_container(render("namespaced"))["args"]
    assert args[:5] == ["operator", "--liveness-port", "8080", "--metrics-port", "9100"]
    assert args[5:] == ["--namespace", "team-a", "--namespace", "team-b"]


def test_custom_image_resources_and_scheduling() -> None:
    docs = render("custom")
    values = COMBINATIONS["custom"]
    pod = one(docs, "Deployment")["spec"]["template"]
    container = operator_container(docs)
    assert container["image"] == "registry.example/keyshift:1.2"
    assert container["imagePullPolicy"] == "Always"
    assert container["resources"] == values["resources"]
    for key in ("nodeSelector", "tolerations", "affinity", "imagePullSecrets", "priorityClassName"):
        assert pod["spec"][key] == values[key]
    # Extra labels are added, but never move the pod out of the Deployment's selector.
    assert pod["metadata"]["labels"]["team"] == "data"
    assert pod["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"
    assert pod["metadata"]["annotations"] == values["podAnnotations"]
    account = one(docs, "ServiceAccount")
    assert account["metadata"]["annotations"] == values["serviceAccount"]["annotations"]
    service = one(docs, "Service")
    assert service["metadata"]["annotations"] == values["metricsService"]["annotations"]


def test_metrics_service_selects_the_operator() -> None:
    docs = render("default")
    service = one(docs, "Service")
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 9100, "targetPort": "metrics", "protocol": "TCP"}
    ]


def test_long_release_names_fit_kubernetes_names(chart: Chart) -> None:
    release = "a-very-long-release-name-for-keyshift-that-goes-on-and-on-and-on"
    docs = documents(chart.render({}, name=release, namespace=NAMESPACE, is_install=True))
    for doc in docs:
        # Services (and label values) take 63 characters, other names 253.
        limit = 63 if doc["kind"] == "Service" else 253
        assert len(doc["metadata"]["name"]) <= limit, doc["metadata"]["name"]
        kubernetes_validate.validate(doc, NEWEST, strict=True)
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names))


# -- RBAC -----------------------------------------------------------------------------------------


def rules(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    """(apiGroup, resource) -> verbs, checking that no rule uses a wildcard."""
    found: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, rule  # no resourceNames, URLs
        for field in ("apiGroups", "resources", "verbs"):
            assert not any("*" in item for item in rule[field]), f"wildcard in {rule}"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                found.setdefault((group, resource), set()).update(rule["verbs"])
    return found


def check_bindings(docs: list[dict[str, Any]], account: str) -> None:
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs}
    for binding in of_kind(docs, "RoleBinding") + of_kind(docs, "ClusterRoleBinding"):
        ref = binding["roleRef"]
        namespace = binding["metadata"].get("namespace") if ref["kind"] == "Role" else None
        assert (ref["kind"], namespace, ref["name"]) in roles
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}
        ]


def test_cluster_wide_rbac_is_exactly_what_the_operator_uses() -> None:
    docs = render("default")
    assert of_kind(docs, "Role") == [] and of_kind(docs, "RoleBinding") == []
    # kopf lists/watches namespaces only when it is not cluster-wide.
    assert rules(one(docs, "ClusterRole")) == NAMESPACED_RULES | CRD_RULES
    assert len(of_kind(docs, "ClusterRoleBinding")) == 1
    check_bindings(docs, RELEASE)


@pytest.mark.parametrize("combination", ["namespaced", "namespaced-monitoring"])
def test_namespaced_rbac_gives_roles_in_exactly_the_listed_namespaces(combination: str) -> None:
    docs = render(combination)
    listed = COMBINATIONS[combination]["watchNamespaces"]
    for kind in ("Role", "RoleBinding"):
        assert sorted(d["metadata"]["namespace"] for d in of_kind(docs, kind)) == sorted(listed)
    for role in of_kind(docs, "Role"):
        assert rules(role) == NAMESPACED_RULES
    # Cluster-wide only what is cluster-scoped, and only read.
    assert rules(one(docs, "ClusterRole")) == CRD_RULES | NAMESPACE_RULES
    check_bindings(docs, RELEASE)


def test_no_rbac_when_brought_by_the_user() -> None:
    docs = render("own-rbac")
    for kind in ("ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"):
        assert of_kind(docs, kind) == []
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "ops"


def example_children(options: ChildOptions | None = None) -> list[dict[str, Any]]:
    obj = yaml.safe_load((REPO / "examples" / "streamingjob.yaml").read_text(encoding="utf-8"))
    spec = StreamingJob.model_validate(obj).spec
    return children("clicks", "team-a", spec, spec.job_spec(), options=options)


def chart_child_options(combination: str) -> ChildOptions:
    """What the rendered operator Deployment tells the operator, parsed as the operator does."""
    env = {e["name"]: e["value"] for e in operator_container(render(combination))["env"]}
    return child_options_from_env(env)


@pytest.mark.parametrize("combination", ["default", "isolation"])
def test_rbac_covers_every_child_the_operator_creates(combination: str) -> None:
    granted = rules(one(render(combination), "ClusterRole"))
    kinds = set()
    for manifest in example_children(chart_child_options(combination)):
        group = manifest["apiVersion"].rpartition("/")[0]
        kinds.add(manifest["kind"])
        assert {"create", "patch"} <= granted[(group, PLURALS[manifest["kind"]])], manifest["kind"]
    isolation = {"NetworkPolicy", "PodDisruptionBudget"}
    assert kinds == set(PLURALS) - (isolation if combination == "default" else set())


# -- monitoring -----------------------------------------------------------------------------------


def test_monitors_and_rules_are_off_by_default() -> None:
    docs = render("default")
    assert not [d for d in docs if d["apiVersion"] == MONITORING]


def test_service_monitor_scrapes_the_metrics_service() -> None:
    docs = render("monitoring")
    monitor = one(docs, "ServiceMonitor")
    service = one(docs, "Service")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "30s"}
    ]


def test_pod_monitor_selects_the_job_pods_and_not_the_operator() -> None:
    docs = render("monitoring")
    monitor = one(docs, "PodMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector["app.kubernetes.io/name"] == "keyshift"
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    assert monitor["spec"]["podMetricsEndpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "10s"}
    ]
    scraped = 0
    for manifest in example_children():
        if manifest["kind"] not in ("Deployment", "StatefulSet"):
            continue
        template = manifest["spec"]["template"]
        assert selector.items() <= template["metadata"]["labels"].items(), manifest["kind"]
        ports = [p.get("name") for c in template["spec"]["containers"] for p in c["ports"]]
        assert "metrics" in ports
        scraped += 1
    assert scraped >= 4  # the coordinator and three stages
    operator_pod = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert not selector.items() <= operator_pod.items()
    namespaced = one(render("namespaced-monitoring"), "PodMonitor")
    assert namespaced["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]}


def alert_rules(combination: str) -> list[dict[str, Any]]:
    groups = one(render(combination), "PrometheusRule")["spec"]["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_alerts_use_only_metrics_the_runtime_exports() -> None:
    by_name = {r["alert"]: r for r in alert_rules("monitoring")}
    assert set(by_name) == {
        "KeyshiftJobDegraded",
        "KeyshiftJobFailed",
        "KeyshiftRescaleFailing",
        "KeyshiftSustainedBackpressure",
        "KeyshiftHighLatency",
    }
    exported = {m.value for m in MetricName}
    histograms = {MetricName.LATENCY.value}
    for rule in by_name.values():
        for name in set(re.findall(r"keyshift_[a-z0-9_]+", rule["expr"])) - OUR_LABELS:
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            assert name in exported or base in histograms, f"{rule['alert']}: {name}"
        assert rule["labels"] == {"severity": "warning", "team": "data"}
    assert by_name["KeyshiftJobDegraded"]["for"] == "5m"
    assert by_name["KeyshiftSustainedBackpressure"]["for"] == "10m"
    latency = by_name["KeyshiftHighLatency"]
    assert latency["for"] == "10m" and latency["expr"].endswith("> 2.5")
    assert "histogram_quantile(0.99," in latency["expr"]
    # Prometheus' own templates reach Prometheus, not Helm.
    degraded = by_name["KeyshiftJobDegraded"]["annotations"]["summary"]
    assert "{{ $labels.keyshift_job }}" in degraded
    # Alerts select and name jobs by keyshift's labels, never by Prometheus' job/instance.
    for rule in by_name.values():
        assert not re.search(r"\b(job|instance)\b", rule["expr"]), rule["alert"]
        assert "$labels.job " not in str(rule["annotations"]), rule["alert"]


RUNBOOK = REPO / "docs" / "runbook.md"
RUNBOOK_BASE = "https://github.com/keyshift/keyshift/blob/main/docs/runbook.md"  # the default


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_alert_links_its_section_of_the_runbook() -> None:
    sections = {
        github_anchor(line.removeprefix("## "))
        for line in RUNBOOK.read_text(encoding="utf-8").splitlines()
        if line.startswith("## ")
    }
    rules = alert_rules("monitoring")
    for rule in rules:
        url = rule["annotations"]["runbook_url"]
        assert url == f"{RUNBOOK_BASE}#{github_anchor(rule['alert'])}", rule["alert"]
        assert url.partition("#")[2] in sections, f"docs/runbook.md has no section {url}"
    assert len(sections) == len(rules)  # one section per alert, none for a removed one
    mirror = one(render("runbook-mirror"), "PrometheusRule")
    urls = [r["annotations"]["runbook_url"] for g in mirror["spec"]["groups"] for r in g["rules"]]
    assert urls and all(u.startswith("https://docs.example/rb.md#keyshift") for u in urls)


PROMTOOL = shutil.which("promtool")


def series(name: str, values: str, **labels: str) -> dict[str, str]:
    text = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{name}{{{text}}}", "values": values}


def alert(at: str, name: str, *firing: tuple[dict[str, str], str, str]) -> dict[str, Any]:
    """An alert_rule_test: `name` at `at` fires once per (labels, summary, description)."""
    expected = [
        {
            "exp_labels": {"severity": "warning", "team": "data", **labels},
            "exp_annotations": {
                "summary": summary,
                "description": description,
                "runbook_url": f"{RUNBOOK_BASE}#{name.lower()}",
            },
        }
        for labels, summary, description in firing
    ]
    return {"eval_time": at, "alertname": name, "exp_alerts": expected}


JOBS = MetricName.OPERATOR_JOBS.value
RESCALES = MetricName.RESCALES.value
BACKPRESSURED = MetricName.BACKPRESSURED_SECONDS.value
BUCKET = f"{MetricName.LATENCY.value}_bucket"
# A job pod's series as Prometheus stores them: keyshift's labels and the target's namespace.
SINK = {"namespace": "ns", "stage": "sink", "keyshift_instance": "0"}
RESCALE = {"namespace": "ns", "keyshift_job": "j", "stage": "enrich", "strategy": "hot-first"}
JOB_POD = {"namespace": "ns", "keyshift_instance": "0"}

# `promtool test rules`: one of each problem, and their healthy twins.
RULE_TESTS: dict[str, Any] = {
    "rule_files": ["rules.yaml"],
    "evaluation_interval": "1m",
    "tests": [
        {
            "interval": "1m",
            "input_series": [
                series(JOBS, "1x20", keyshift_namespace="ns", keyshift_job="bad", phase="Degraded"),
                series(JOBS, "0x20", keyshift_namespace="ns", keyshift_job="ok", phase="Degraded"),
                series(
                    JOBS, "0 0 1x20", keyshift_namespace="ns", keyshift_job="bad", phase="Failed"
                ),
                series(JOBS, "0x20", keyshift_namespace="ns", keyshift_job="ok", phase="Failed"),
                series(RESCALES, "0 0 0 1 1 1 1 1 1 1 1", **RESCALE, result="failed"),
                series(RESCALES, "0+1x10", **RESCALE, result="done"),
                series(BACKPRESSURED, "0+48x30", keyshift_job="j", stage="src", **JOB_POD),
                series(BACKPRESSURED, "0+6x30", keyshift_job="j", stage="enrich", **JOB_POD),
                # p99 of `slow` is near 10 s, of `fast` under 1 s.
                series(BUCKET, "0+10x30", keyshift_job="slow", **SINK, le="1"),
                series(BUCKET, "0+1000x30", keyshift_job="slow", **SINK, le="10"),
                series(BUCKET, "0+1000x30", keyshift_job="slow", **SINK, le="+Inf"),
                series(BUCKET, "0+1000x30", keyshift_job="fast", **SINK, le="1"),
                series(BUCKET, "0+1000x30", keyshift_job="fast", **SINK, le="10"),
                series(BUCKET, "0+1000x30", keyshift_job="fast", **SINK, le="+Inf"),
            ],
            "alert_rule_test": [
                alert("4m", "KeyshiftJobDegraded"),
                alert(
                    "6m",
                    "KeyshiftJobDegraded",
                    (
                        {"keyshift_namespace": "ns", "keyshift_job": "bad", "phase": "Degraded"},
                        "StreamingJob ns/bad is Degraded",
                        "The operator cannot run the job as specified (kubectl describe sj bad "
                        "-n ns shows the reason: an invalid spec or a failed job).",
                    ),
                ),
                alert("2m", "KeyshiftJobFailed"),
                alert(
                    "3m",
                    "KeyshiftJobFailed",
                    (
                        {"keyshift_namespace": "ns", "keyshift_job": "bad", "phase": "Failed"},
                        "StreamingJob ns/bad has Failed",
                        "The job stopped and is not restarted again (kubectl describe sj bad -n "
                        "ns: the Degraded condition says why, RestartsExhausted when its restart "
                        "strategy gave up).",
                    ),
                ),
                alert(
                    "5m",
                    "KeyshiftRescaleFailing",
                    (
                        {**RESCALE, "result": "failed"},
                        "Rescales of ns/j/enrich are failing",
                        "1 rescale(s) of stage enrich (strategy hot-first) failed in the last "
                        "15 minutes; the autoscaler backs off after each failure.",
                    ),
                ),
                alert("30m", "KeyshiftRescaleFailing"),
                # rate() over 5m of a counter from 0 passes 0.5 after about 4m; then 10m more.
                alert("8m", "KeyshiftSustainedBackpressure"),
                alert(
                    "16m",
                    "KeyshiftSustainedBackpressure",
                    (
                        {"namespace": "ns", "keyshift_job": "j", "stage": "src"},
                        "ns/j/src is backpressured",
                        "Instances of stage src spent 80% of the last 5 minutes waiting for "
                        "downstream credit, for 10 minutes: a downstream stage or the sink is "
                        "too slow (at its max_parallelism?).",
                    ),
                ),
                alert("8m", "KeyshiftHighLatency"),
                alert(
                    "12m",
                    "KeyshiftHighLatency",
                    (
                        {"namespace": "ns", "keyshift_job": "slow"},
                        "p99 end-to-end latency of ns/slow is high",
                        "The p99 ingest-to-sink latency of slow is 9.909s, above 2.5s for 10 "
                        "minutes.",
                    ),
                ),
            ],
        }
    ],
}


@pytest.mark.skipif(PROMTOOL is None, reason="promtool (Debian's prometheus package) not found")
def test_alerts_pass_promtool_and_fire_when_they_should(tmp_path: Path) -> None:
    groups = one(render("monitoring"), "PrometheusRule")["spec"]["groups"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}), encoding="utf-8")
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(RULE_TESTS), encoding="utf-8")
    assert PROMTOOL is not None
    for command in (["check", "rules", "rules.yaml"], ["test", "rules", "tests.yaml"]):
        done = subprocess.run(
            [PROMTOOL, *command], cwd=tmp_path, capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0, done.stdout + done.stderr


# -- dashboards -----------------------------------------------------------------------------------


DASHBOARDS = {
    # Grafana's own templates must reach Grafana: .Files.Get does not render them.
    "job-overview.json": {
        "title": "keyshift / job overview",
        "panels": [{"id": 1, "targets": [{"legendFormat": "{{stage}} {{ $labels.job }}"}]}],
    },
    "Operator_View.json": {"title": "keyshift / operator", "uid": "ks-op", "tags": ["keyshift"]},
}


@pytest.fixture(scope="module")
def chart_with_dashboards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the chart whose dashboards/ holds our fixtures instead of the real ones."""
    copy_dir = tmp_path_factory.mktemp("chart") / "keyshift"
    shutil.copytree(CHART, copy_dir, ignore=shutil.ignore_patterns("dashboards"))
    (copy_dir / "dashboards").mkdir()
    for name, dashboard in DASHBOARDS.items():
        (copy_dir / "dashboards" / name).write_text(json.dumps(dashboard, indent=2) + "\n")
    (copy_dir / "dashboards" / "notes.txt").write_text("not a dashboard\n")
    return copy_dir


def render_chart(path: Path, values: dict[str, Any]) -> list[dict[str, Any]]:
    with Chart.load(path) as loaded:
        rendered = loaded.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return documents(rendered)


def test_each_dashboard_file_becomes_a_labelled_config_map(chart_with_dashboards: Path) -> None:
    values = {"dashboards": {"annotations": {"grafana_folder": "keyshift"}}}
    maps = of_kind(render_chart(chart_with_dashboards, values), "ConfigMap")
    by_key = {key: m for m in maps for key in m["data"]}
    assert set(by_key) == set(DASHBOARDS)
    for key, config_map in by_key.items():
        text = (chart_with_dashboards / "dashboards" / key).read_text()
        assert config_map["data"][key] == text.rstrip("\n")
        assert json.loads(config_map["data"][key]) == DASHBOARDS[key]
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert config_map["metadata"]["annotations"] == {"grafana_folder": "keyshift"}
        assert config_map["metadata"]["namespace"] == NAMESPACE
        for version in VERSIONS:
            kubernetes_validate.validate(config_map, version, strict=True)
    assert by_key["Operator_View.json"]["metadata"]["name"] == "keyshift-dashboard-operator-view"
    assert lint(chart_with_dashboards, {}, strict=True, kube_version=f"v{OLDEST}")["errors"] == []


def test_dashboard_label_is_configurable_and_dashboards_can_be_off(
    chart_with_dashboards: Path,
) -> None:
    values = {"dashboards": {"label": "example.com/dashboard", "labelValue": "keyshift"}}
    maps = of_kind(render_chart(chart_with_dashboards, values), "ConfigMap")
    assert len(maps) == len(DASHBOARDS)
    for config_map in maps:
        assert config_map["metadata"]["labels"]["example.com/dashboard"] == "keyshift"
        assert "grafana_dashboard" not in config_map["metadata"]["labels"]
    off = render_chart(chart_with_dashboards, {"dashboards": {"enabled": False}})
    assert of_kind(off, "ConfigMap") == []


def test_the_real_dashboards_are_all_packaged() -> None:
    files = sorted(p.name for p in (CHART / "dashboards").glob("*.json"))
    maps = of_kind(render("default"), "ConfigMap")
    assert sorted(key for m in maps for key in m["data"]) == files
    assert of_kind(render("no-dashboards"), "ConfigMap") == []


# -- notes and offline ----------------------------------------------------------------------------


def test_notes_say_what_to_do_next() -> None:
    text = notes("default")
    assert "kubectl apply -f examples/streamingjob.yaml" in text
    assert "kubectl get sj" in text and "in every namespace" in text
    assert "namespaces: team-a, team-b" in notes("namespaced")


OFFLINE_RENDER = """
import sys
from helm_python.chart import Chart, lint
with Chart.load(sys.argv[1]) as chart:
    out = chart.render({"prometheusRule": {"enabled": True}}, name="k", namespace="k",
                       is_install=True)
assert any("PrometheusRule" in text for text in out.values())
assert lint(sys.argv[1], {}, strict=True)["errors"] == []
print("rendered offline")
"""


def _can_drop_network() -> bool:
    unshare = shutil.which("unshare")
    if unshare is None:
        return False
    done = subprocess.run([unshare, "-rn", "true"], capture_output=True, timeout=10)
    return done.returncode == 0


@pytest.mark.skipif(not _can_drop_network(), reason="cannot run without network (unshare -rn)")
def test_render_and_lint_need_no_network(tmp_path: Path) -> None:
    script = tmp_path / "offline.py"
    script.write_text(OFFLINE_RENDER, encoding="utf-8")
    done = subprocess.run(
        ["unshare", "-rn", sys.executable, "-P", str(script), str(CHART)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rendered offline" in done.stdout


# -- image digest, startup probe, NetworkPolicies, PodDisruptionBudgets ---------------------------


def test_operator_waits_for_its_start_before_liveness_counts() -> None:
    container = operator_container(render("default"))
    startup, liveness = container["startupProbe"], container["livenessProbe"]
    assert startup["httpGet"] == liveness["httpGet"] == {"path": "/healthz", "port": "healthz"}
    # Minutes to start on a loaded node; once up, liveness needs no initial delay.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120
    assert "initialDelaySeconds" not in liveness


def test_by_default_jobs_get_the_operators_image_and_no_isolation() -> None:
    docs = render("default")
    assert chart_child_options("default") == ChildOptions(jobImage=f"{IMAGE}:0.1.0")
    assert not of_kind(docs, "NetworkPolicy")
    assert not ISOLATION_RULES.keys() & rules(one(docs, "ClusterRole")).keys()


def test_a_pinned_digest_reaches_the_operator_and_the_jobs() -> None:
    pinned = f"{IMAGE}@{DIGEST}"
    assert operator_container(render("isolation"))["image"] == pinned
    options = chart_child_options("isolation")
    assert options.job_image == pinned
    obj = yaml.safe_load((REPO / "examples" / "streamingjob.yaml").read_text(encoding="utf-8"))
    del obj["spec"]["image"]
    spec = StreamingJob.model_validate(obj).spec
    images = {
        c["image"]
        for m in children("clicks", "team-a", spec, spec.job_spec(), options=options)
        if m["kind"] in ("Deployment", "StatefulSet")
        for c in m["spec"]["template"]["spec"]["containers"]
    }
    assert images == {pinned}


def test_the_operator_is_told_the_isolation_settings_and_makes_valid_children() -> None:
    docs = render("isolation")
    options = chart_child_options("isolation")
    assert options.network_policy is not None and options.pod_disruption_budget is not None
    assert options.pod_disruption_budget.max_unavailable == 2
    # The operator's peer is exactly the operator's pods, in the release's namespace.
    operator_pod = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    peer = options.network_policy.operator
    assert peer.pod_labels.items() <= operator_pod.items()
    assert peer.namespace_labels == {"kubernetes.io/metadata.name": NAMESPACE}
    values = COMBINATIONS["isolation"]["networkPolicy"]
    assert [
        c.model_dump(by_alias=True, exclude_none=True) for c in options.network_policy.spark_clients
    ] == values["sparkClients"]
    made = example_children(options)
    kinds = [m["kind"] for m in made]
    assert kinds.count("NetworkPolicy") == 1 and kinds.count("PodDisruptionBudget") == 3
    for manifest in made:
        for version in VERSIONS:
            kubernetes_validate.validate(manifest, version, strict=True)
    assert rules(one(docs, "ClusterRole")).items() >= ISOLATION_RULES.items()


def test_namespaced_isolation_grants_the_children_in_each_namespace() -> None:
    docs = render("namespaced-isolation")
    for role in of_kind(docs, "Role"):
        assert rules(role) == NAMESPACED_RULES | ISOLATION_RULES
    options = chart_child_options("namespaced-isolation")
    assert options.network_policy is not None
    # namespace labels set to null (Helm drops the key): Prometheus in the job's own namespace.
    assert options.network_policy.prometheus.namespace_labels is None


def test_the_operators_network_policy_lets_only_prometheus_reach_its_metrics() -> None:
    docs = render("isolation")
    policy = one(docs, "NetworkPolicy")
    pod = one(docs, "Deployment")["spec"]["template"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"protocol": "TCP", "port": "metrics"}]
    ports = {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]}
    assert "metrics" in ports
    assert rule["from"] == [
        {
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        }
    ]
    # Prometheus in the release's own namespace: no namespace selector.
    (rule,) = one(render("namespaced-isolation"), "NetworkPolicy")["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": {"app": "prometheus"}}}]
