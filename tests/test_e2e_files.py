"""The kind end-to-end suite's files, checked without Docker: `make test` guards what e2e/ and
the workflow can only exercise on a machine with Docker and kind.

The YAML parses; the Prometheus, Spark smoke and job-child manifests are valid Kubernetes
objects; Prometheus' own checker takes its configuration; the e2e StreamingJob is valid for the
CRD and the models and steps its load up and down; the Dockerfiles use pinned bases and run as
uid 10001; .dockerignore keeps .venv and .git out; the workflows run `pytest e2e` and
`.ci/run`; the release workflow builds both images multi-arch (the Spark one on the keyshift
image's digest) and pushes the chart, at the version of its tag, which tools/release_version.py
holds to pyproject.toml and Chart.yaml; the suite's checks (e2e/checks.py) find what they
should, on real job output too; and the suite skips itself, exiting 0, where its tools are
missing.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import numpy as np
import pyarrow as pa
import pytest
import yaml
from helm_python.chart import Chart

from e2e import checks
from e2e.cluster import (
    CHART,
    CHART_OPTIONS,
    IMAGE,
    JOB_MANIFEST,
    KIND_CONFIG,
    MONITORING_NAMESPACE,
    OUTPUT_CLAIM,
    OUTPUT_ON_NODE,
    PROMETHEUS,
    SPARK_IMAGE,
    SPARK_SMOKE,
)
from keyshift.operator.k8s_children import (
    APP_DIR,
    USER_ID,
    child_options_from_env,
    child_problems,
    children,
    stage_set_name,
)
from keyshift.operator.streamingjob import StreamingJob
from keyshift.runtime.generator import KeyGenerator, records_due
from keyshift.runtime.job import GeneratorSource, LogSink, PointsProfile
from keyshift.runtime.keyed_stage import process_output_schema
from keyshift.runtime.output_log import OutputLogReader, OutputLogWriter
from tests.conftest import REPO, cli, wait_for
from tests.docker_build import ignored, logical_lines, parse_dockerignore
from tests.test_crd import schema_errors

KUBE_VERSION = "1.31"
WORKFLOWS = REPO / ".github" / "workflows"
E2E_WORKFLOW = WORKFLOWS / "e2e.yaml"
CI_WORKFLOW = WORKFLOWS / "ci.yaml"
RELEASE_WORKFLOW = WORKFLOWS / "release.yaml"


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


# --- YAML and manifests ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [*sorted((REPO / "e2e").glob("*.yaml")), *sorted(WORKFLOWS.glob("*.yaml"))],
    ids=lambda p: str(p.relative_to(REPO)),
)
def test_yaml_files_parse(path: Path) -> None:
    found = docs(path)
    assert found and all(isinstance(d, dict) for d in found)


def test_kind_config_has_a_control_plane_and_a_worker_on_a_pinned_node_image() -> None:
    (config,) = docs(KIND_CONFIG)
    assert config["kind"] == "Cluster" and config["apiVersion"] == "kind.x-k8s.io/v1alpha4"
    assert [n["role"] for n in config["nodes"]] == ["control-plane", "worker"]
    pinned = re.compile(r"^kindest/node:v1\.31\.\d+@sha256:[0-9a-f]{64}$")
    images = {n["image"] for n in config["nodes"]}
    assert len(images) == 1 and all(pinned.match(i) for i in images), images


@pytest.mark.parametrize("path", [PROMETHEUS, SPARK_SMOKE, OUTPUT_CLAIM], ids=lambda p: p.name)
def test_manifests_are_valid_kubernetes_objects(path: Path) -> None:
    for doc in docs(path):
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def prometheus_objects() -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in docs(PROMETHEUS)}


def test_prometheus_scrapes_annotated_pods_every_2s_with_their_namespace(tmp_path: Path) -> None:
    config = yaml.safe_load(prometheus_objects()["ConfigMap"]["data"]["prometheus.yml"])
    assert config["global"]["scrape_interval"] == "2s"
    (scrape,) = config["scrape_configs"]
    # keyshift's labels never collide with the target labels: Prometheus keeps its own, and
    # the namespace the autoscaler selects a job by is one of them.
    assert "honor_labels" not in scrape
    namespace = [r for r in scrape["relabel_configs"] if r.get("target_label") == "namespace"]
    assert namespace and namespace[0]["source_labels"] == ["__meta_kubernetes_namespace"]
    assert scrape["kubernetes_sd_configs"] == [{"role": "pod"}]
    keep = scrape["relabel_configs"][0]
    assert keep["action"] == "keep" and keep["regex"] == "true"
    assert keep["source_labels"] == ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"]
    # The ClusterRole lets pod discovery list and watch pods.
    (rule,) = prometheus_objects()["ClusterRole"]["rules"]
    assert rule["resources"] == ["pods"] and {"list", "watch"} <= set(rule["verbs"])
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool (Debian's prometheus package, which `make test` installs) missing")
    # Debian's Prometheus is built without Kubernetes discovery: check the rest of the file
    # (durations, relabel rules and their regexes) with a static target in its place.
    scrape["static_configs"] = [{"targets": ["127.0.0.1:9100"]}]
    del scrape["kubernetes_sd_configs"]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    out = subprocess.run(
        [promtool, "check", "config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_chart_options_of_the_suite_admit_its_prometheus() -> None:
    """The suite installs the chart with NetworkPolicies on: the Prometheus peer the operator is
    told (the chart's defaults) must be e2e/prometheus.yaml's pods, or nothing would scrape the
    job and the autoscaler would never decide."""
    values: dict[str, Any] = {}
    for option in CHART_OPTIONS:
        path, _, raw = option.partition("=")
        *parents, last = path.split(".")
        node = values
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = yaml.safe_load(raw)
    with Chart.load(CHART) as chart:
        rendered = chart.render(values, name="keyshift", namespace="keyshift", is_install=True)
    deployment = next(
        d
        for path, text in rendered.items()
        if path.endswith(".yaml")
        for d in yaml.safe_load_all(text)
        if isinstance(d, dict) and d.get("kind") == "Deployment"
    )
    env = {
        e["name"]: e["value"]
        for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    options = child_options_from_env(env)
    assert options.network_policy is not None and options.pod_disruption_budget is not None
    peer = options.network_policy.prometheus
    pod = prometheus_objects()["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert peer.pod_labels and peer.pod_labels.items() <= pod.items()
    assert peer.namespace_labels == {"kubernetes.io/metadata.name": MONITORING_NAMESPACE}
    assert prometheus_objects()["Deployment"]["metadata"]["namespace"] == MONITORING_NAMESPACE


def test_the_job_reads_the_in_cluster_prometheus() -> None:
    objects = prometheus_objects()
    service = objects["Service"]
    (port,) = service["spec"]["ports"]
    name, namespace = service["metadata"]["name"], service["metadata"]["namespace"]
    url = JOB_MANIFEST["spec"]["job"]["autoscaler"]["prometheus_url"]
    assert url == f"http://{name}.{namespace}.svc:{port['port']}"
    assert objects["Deployment"]["spec"]["template"]["spec"]["containers"][0]["image"].startswith(
        "prom/prometheus:v"
    )


# --- the e2e StreamingJob ----------------------------------------------------------------------


def test_e2e_job_is_valid_for_the_crd_and_the_models() -> None:
    assert schema_errors(JOB_MANIFEST) == []
    parsed = StreamingJob.model_validate(JOB_MANIFEST)
    assert parsed.spec.problems() == []
    assert parsed.spec.image == IMAGE
    job = parsed.spec.job_spec()
    assert job.keyed.operator.kind == "process"
    assert job.keyed.operator.function == "examples.lookups:enrich"
    assert isinstance(job.sink.config, LogSink) and job.sink.config.format == "jsonl"
    auto = job.autoscaler
    assert auto is not None and auto.prometheus_url and not auto.dry_run
    assert auto.bounds_of(job.keyed.name).max_parallelism == 4
    for fixed in (job.source.name, job.sink.name):
        bounds = auto.bounds_of(fixed)
        assert bounds.min_parallelism == bounds.max_parallelism == 1


def test_e2e_load_steps_up_then_down_and_the_job_ends_after_the_drop() -> None:
    job = StreamingJob.model_validate(JOB_MANIFEST).spec.job_spec()
    source = job.source.config
    assert isinstance(source, GeneratorSource) and isinstance(source.profile, PointsProfile)
    rates = [rate for _, rate in source.profile.points]
    assert len(rates) == 3 and rates[0] < rates[1] and rates[2] < rates[1]
    drop_at = source.profile.points[-1][0]
    due = records_due(source.profile, drop_at)
    assert due is not None and source.total is not None
    # After the drop the job runs on at the low rate for at least a minute (time to scale in).
    assert source.total - due >= 60 * rates[2]


def test_e2e_job_children_are_valid_and_share_the_output_claim_on_the_node() -> None:
    """The sink stage and the Spark sink mount the output claim where the log is written, the
    claim is bound to the node directory the suite copies out, and the Spark sink reads that
    directory with the job file the operator mounts and writes where the suite looks."""
    parsed = StreamingJob.model_validate(JOB_MANIFEST)
    job = parsed.spec.job_spec()
    name = JOB_MANIFEST["metadata"]["name"]
    assert child_problems(name, parsed.spec, job) == []
    manifests = children(name, "keyshift-e2e", parsed.spec, job)
    for manifest in manifests:
        kubernetes_validate.validate(manifest, KUBE_VERSION, strict=True)
    assert isinstance(job.sink.config, LogSink)
    output_dir = f"{APP_DIR}/{job.sink.config.path}"
    readers = {stage_set_name(name, "sink"), f"{name}-sink-count"}
    claims = set()
    for m in manifests:
        if m["metadata"]["name"] not in readers or m["kind"] not in ("StatefulSet", "Deployment"):
            continue
        pod = m["spec"]["template"]["spec"]
        mounts = pod["containers"][0]["volumeMounts"]
        (mount,) = [m for m in mounts if m["mountPath"] == output_dir]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        claims.add(volume["persistentVolumeClaim"]["claimName"])
    assert len(claims) == 1
    volume, claim = (next(d for d in docs(OUTPUT_CLAIM) if d["kind"] == k)
                     for k in ("PersistentVolume", "PersistentVolumeClaim"))  # fmt: skip
    assert claim["metadata"]["name"] in claims and claim["metadata"]["namespace"] == "keyshift-e2e"
    assert "ReadWriteMany" in claim["spec"]["accessModes"]
    assert volume["spec"]["claimRef"] == {"namespace": "keyshift-e2e", "name": "e2e-output"}
    assert volume["spec"]["hostPath"]["path"] == OUTPUT_ON_NODE
    (app,) = parsed.spec.sinks
    args = dict(zip(app.args[::2], app.args[1::2], strict=True))
    assert args["--log"] == output_dir and args["--job"] == "/etc/keyshift/job.yaml"
    assert args["--output"] == f"{output_dir}/spark"


def test_committed_spark_files_are_those_of_committed_batches() -> None:
    batch = 'v1\n{"path":"file:///o/spark/part-0.parquet","action":"add"}\n'
    later = 'v1\n{"path":"file:///o/spark/part-1.parquet","action":"add"}\n'
    compact = (
        'v1\n{"path":"file:///o/spark/part-0.parquet","action":"add"}\n'
        '{"path":"file:///o/spark/part-1.parquet","action":"add"}\n'
        '{"path":"file:///o/spark/part-0.parquet","action":"delete"}\n'
    )
    assert checks.committed_spark_files([batch, later]) == ["part-0.parquet", "part-1.parquet"]
    assert checks.committed_spark_files([batch, later, compact]) == ["part-1.parquet"]
    assert checks.committed_spark_files([]) == []
    with pytest.raises(ValueError, match="not a Spark file sink metadata batch"):
        checks.committed_spark_files(["{}"])


def test_same_records_finds_a_repeat_a_loss_and_a_changed_value() -> None:
    log = pa.table({"offset": [0, 1, 0], "partition": pa.array([0, 0, 1], pa.int32()),
                    "key": [5, 6, 7]})  # fmt: skip
    read = log.select(["partition", "offset", "key"])
    assert checks.same_records(read, log) == []
    # As many records as the log, but one read twice and one never.
    assert checks.same_records(read.take([0, 0, 2]), log) == ["1 records read more than once"]
    lost = checks.same_records(read.slice(1), log)
    assert lost == ["the query read 2 records, the log holds 3"]
    changed = read.set_column(2, "key", pa.array([5, 6, 8]))
    assert checks.same_records(changed, log) == ["column key differs between the query and the log"]


def test_spark_smoke_pod_runs_as_the_operator_runs_spark_apps() -> None:
    pod = next(d for d in docs(SPARK_SMOKE) if d["kind"] == "Pod")
    spec = pod["spec"]
    (container,) = spec["containers"]
    assert container["image"] == SPARK_IMAGE
    assert container["command"][0] == "spark-submit" and "workingDir" not in container
    assert spec["securityContext"]["runAsUser"] == USER_ID
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]


# --- images ------------------------------------------------------------------------------------


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, as tests/docker_build.py reads it."""
    return [(i.op, i.args) for i in logical_lines(path.read_text())]


def test_keyshift_image_is_pinned_multi_stage_and_non_root() -> None:
    found = instructions(REPO / "Dockerfile")
    bases = [args.split()[0] for op, args in found if op == "FROM"]
    assert len(bases) == 2
    assert all(re.fullmatch(r"python:3\.11\.\d+-slim-bookworm", b) for b in bases), bases
    final = found[max(i for i, (op, _) in enumerate(found) if op == "FROM") :]
    assert ("USER", f"{USER_ID}:{USER_ID}") in final
    assert [args for op, args in final if op == "USER"][-1] == f"{USER_ID}:{USER_ID}"
    assert ("WORKDIR", APP_DIR) in final
    assert any(op == "COPY" and args.startswith("examples ") for op, args in final)
    assert any(op == "RUN" and "pip install" in args and "/wheels" in args for op, args in final)
    env = " ".join(args for op, args in final if op == "ENV")
    assert "PYTHONUNBUFFERED=1" in env and "PYTHONDONTWRITEBYTECODE=1" in env
    assert any(op == "LABEL" and "org.opencontainers.image.title" in args for op, args in final)
    assert ("CMD", '["keyshift", "--help"]') in final
    assert not any(op == "ENTRYPOINT" for op, _ in found)
    # The passwd entry the pods' uid needs.
    assert any(op == "RUN" and f"useradd --uid {USER_ID}" in args for op, args in final)


def test_spark_image_builds_on_a_pinned_keyshift_image_and_stays_non_root() -> None:
    found = instructions(REPO / "docker" / "spark.Dockerfile")
    args = dict(a.split("=", 1) for op, a in found if op == "ARG" and "=" in a)
    base = args["KEYSHIFT_IMAGE"]
    assert re.fullmatch(r"[\w./-]+/keyshift:\d+\.\d+\.\d+", base), base
    assert [a for op, a in found if op == "FROM"] == ["${KEYSHIFT_IMAGE}"]
    # The version of the `spark` extra.
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [f"pyspark=={args['PYSPARK_VERSION']}"] == extra["spark"]
    assert [a for op, a in found if op == "USER"][-1] == f"{USER_ID}:{USER_ID}"
    env = " ".join(a for op, a in found if op == "ENV")
    assert "JAVA_HOME=" in env and "PYSPARK_PYTHON=" in env
    run = " ".join(a for op, a in found if op == "RUN")
    assert "openjdk-17-jre-headless" in run and "pyspark==${PYSPARK_VERSION}" in run
    assert "rm -rf /var/lib/apt/lists/*" in run


def test_dockerignore_sends_only_what_the_images_need() -> None:
    patterns = parse_dockerignore((REPO / ".dockerignore").read_text())
    for out in (
        ".venv/bin/python",
        ".git/HEAD",
        "tests/test_job.py",
        "e2e/test_kind.py",
        "out/autoscale/part-00000",
        "bench/reports/x.json",
        ".mypy_cache/x",
        "helm/keyshift/Chart.yaml",
        "runtime/__pycache__/job.cpython-311.pyc",
        "keyshift.egg-info/PKG-INFO",
    ):
        assert ignored(out, patterns), out
    for kept in (
        "pyproject.toml",
        "README.md",
        "runtime/job.py",
        "policies/ds2.py",
        "operator/cli.py",
        "spark/datasource.py",
        "examples/lookups.py",
    ):
        assert not ignored(kept, patterns), kept
    # What the Dockerfiles copy is in the context.
    for op, args in instructions(REPO / "Dockerfile"):
        if op == "COPY" and not args.startswith("--from"):
            for source in args.split()[:-1]:
                assert not ignored(source, patterns), source


# --- workflows ---------------------------------------------------------------------------------


def workflow(path: Path) -> dict[str, Any]:
    data: dict[Any, Any] = yaml.safe_load(path.read_text())
    if True in data:  # YAML 1.1 reads the key `on` as True
        data["on"] = data.pop(True)
    return data


def steps(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for job in data["jobs"].values() for s in job["steps"]]


def test_e2e_workflow_runs_the_kind_suite_and_keeps_its_logs() -> None:
    data = workflow(E2E_WORKFLOW)
    assert {"push", "pull_request"} <= set(data["on"])
    (job,) = data["jobs"].values()
    assert job["runs-on"] == "ubuntu-latest" and job["timeout-minutes"] == 60
    assert job["env"]["KEYSHIFT_E2E_REQUIRE"] == "1"
    found = steps(data)
    uses = {s["uses"].split("@")[0]: s for s in found if "uses" in s}
    for action in ("helm/kind-action", "azure/setup-helm"):
        assert re.fullmatch(r"v\d+\.\d+\.\d+", uses[action]["uses"].split("@")[1]), action
        assert re.fullmatch(r"v\d+\.\d+\.\d+", uses[action]["with"]["version"]), action
    assert uses["helm/kind-action"]["with"]["install_only"] is True
    # The kind release whose node image kind-config.yaml pins.
    assert uses["helm/kind-action"]["with"]["version"] in KIND_CONFIG.read_text()
    assert str(uses["actions/setup-python"]["with"]["python-version"]) == "3.11"
    runs = [s.get("run", "") for s in found]
    assert any("make .venv/.installed-stamp" in r for r in runs)
    assert not any("python -m" in r for r in runs)
    assert any(".venv/bin/pytest e2e -m e2e" in r for r in runs)
    upload = uses["actions/upload-artifact"]
    assert upload["with"]["path"].rstrip("/") == "e2e/logs" and upload["if"] == "failure()"


def test_ci_workflow_runs_the_ci_script() -> None:
    data = workflow(CI_WORKFLOW)
    assert {"push", "pull_request"} <= set(data["on"])
    assert any(s.get("run") == ".ci/run" for s in steps(data))


def release_steps() -> dict[str, dict[str, Any]]:
    """The release workflow's steps by id (or name)."""
    return {
        s.get("id", s.get("name", s.get("uses", ""))): s for s in steps(workflow(RELEASE_WORKFLOW))
    }


def test_release_runs_on_version_tags_that_match_the_project() -> None:
    data = workflow(RELEASE_WORKFLOW)
    assert set(data["on"]) == {"push"} and set(data["on"]["push"]) == {"tags"}
    (pattern,) = data["on"]["push"]["tags"]
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert fnmatch.fnmatchcase(f"v{version}", pattern)
    assert not fnmatch.fnmatchcase("main", pattern)
    # The version comes from the tag, checked against the files before anything is built.
    check = release_steps()["version"]["run"]
    assert 'python3 tools/release_version.py "$GITHUB_REF_NAME"' in check
    assert data["permissions"] == {"contents": "read"}
    for job in data["jobs"].values():
        assert job["permissions"] == {"contents": "read", "packages": "write"}
    for step in steps(data):
        if "uses" in step and not step["uses"].startswith("actions/"):
            assert re.fullmatch(r"[\w-]+/[\w-]+@v\d+\.\d+\.\d+", step["uses"]), step["uses"]


def test_release_builds_both_images_multi_arch_and_the_spark_one_on_the_keyshift_digest() -> None:
    data = workflow(RELEASE_WORKFLOW)
    found = release_steps()
    keyshift, spark = found["keyshift"]["with"], found["spark"]["with"]
    assert keyshift["file"] == "Dockerfile" and keyshift["context"] == "."
    assert spark["file"] == "docker/spark.Dockerfile" and spark["context"] == "."
    assert (REPO / keyshift["file"]).is_file() and (REPO / spark["file"]).is_file()
    platforms = data["env"]["PLATFORMS"].split(",")
    assert {"linux/amd64", "linux/arm64"} <= set(platforms)
    for image in (keyshift, spark):
        assert image["push"] is True and image["platforms"] == "${{ env.PLATFORMS }}"
        assert "org.opencontainers.image" in found[image["labels"].split(".")[1]]["with"]["labels"]
    # The build arguments the Dockerfiles declare, from the tag's version and the commit.
    assert "VERSION=${{ steps.version.outputs.version }}" in keyshift["build-args"]
    assert "REVISION=${{ github.sha }}" in keyshift["build-args"]
    declared = {a.split("=")[0] for op, a in instructions(REPO / "Dockerfile") if op == "ARG"}
    assert {"VERSION", "REVISION"} <= declared
    spark_args = {a.split("=")[0] for op, a in instructions(REPO / spark["file"]) if op == "ARG"}
    assert "KEYSHIFT_IMAGE" in spark_args
    assert "keyshift@${{ steps.keyshift.outputs.digest }}" in spark["build-args"]
    assert spark["build-args"].startswith("KEYSHIFT_IMAGE=")
    # Tags from the tag's semver; the digests are outputs of the job.
    for meta in ("keyshift-meta", "spark-meta"):
        assert "type=semver,pattern={{version}}" in found[meta]["with"]["tags"]
    outputs = data["jobs"]["images"]["outputs"]
    assert outputs["keyshift-digest"] == "${{ steps.keyshift.outputs.digest }}"
    assert outputs["spark-digest"] == "${{ steps.spark.outputs.digest }}"


def test_release_packages_and_pushes_the_chart_at_the_tags_version() -> None:
    data = workflow(RELEASE_WORKFLOW)
    chart = data["jobs"]["chart"]
    assert chart["needs"] == "images"
    runs = {s.get("name"): s for s in chart["steps"]}
    package = runs["Package the chart"]
    assert package["env"]["VERSION"] == "${{ needs.images.outputs.version }}"
    assert (
        'helm package helm/keyshift --version "$VERSION" --app-version "$VERSION"'
        in (package["run"])
    )
    push = runs["Push the chart (OCI)"]["run"]
    assert 'helm push "dist/keyshift-$VERSION.tgz" "oci://$REGISTRY/$OWNER/charts"' in push
    assert "helm registry login" in push
    summary = runs["Digests"]
    assert "--set image.digest=$KEYSHIFT_DIGEST" in summary["run"]
    assert summary["env"]["KEYSHIFT_DIGEST"] == "${{ needs.images.outputs.keyshift-digest }}"


def release_version(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-P", str(REPO / "tools" / "release_version.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_release_version_agrees_with_pyproject_and_the_chart() -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    chart = yaml.safe_load((REPO / "helm" / "keyshift" / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == version
    out = release_version(f"v{version}")
    assert out.returncode == 0 and out.stdout.strip() == version, out.stderr


@pytest.mark.parametrize(
    ("tag", "message"),
    [
        ("v99.0.0", "tag v99.0.0 is version 99.0.0, but pyproject.toml project.version is"),
        ("0.1.0", "is not vMAJOR.MINOR.PATCH"),
        ("v0.1", "is not vMAJOR.MINOR.PATCH"),
        ("main", "is not vMAJOR.MINOR.PATCH"),
    ],
)
def test_release_version_refuses_a_tag_that_is_not_the_projects(tag: str, message: str) -> None:
    out = release_version(tag)
    assert out.returncode == 1 and out.stdout == ""
    assert message in out.stderr
    assert release_version().returncode == 2


def test_release_version_names_the_file_that_disagrees(tmp_path: Path) -> None:
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "helm" / "keyshift").mkdir(parents=True)
    chart = (REPO / "helm" / "keyshift" / "Chart.yaml").read_text()
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    stale = chart.replace(f'appVersion: "{version}"', 'appVersion: "0.0.9"')
    assert stale != chart
    (tmp_path / "helm" / "keyshift" / "Chart.yaml").write_text(stale)
    script = tmp_path / "tools" / "release_version.py"
    script.parent.mkdir()
    shutil.copy(REPO / "tools" / "release_version.py", script)
    out = subprocess.run(
        [sys.executable, "-P", str(script), f"v{version}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 1
    assert out.stderr.strip().endswith("helm/keyshift/Chart.yaml appVersion is 0.0.9")


def test_make_test_does_not_collect_the_e2e_suite() -> None:
    options = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert options["testpaths"] == ["tests"]
    assert any(m.startswith("e2e:") for m in options["markers"])


def test_suite_skips_itself_with_the_reason_where_its_tools_are_missing(tmp_path: Path) -> None:
    # An empty PATH: no docker, kind, helm or kubectl, whatever this machine has.
    pytest_bin = str(Path(sys.executable).with_name("pytest"))
    out = subprocess.run(
        [pytest_bin, "e2e", "-q", "-p", "no:cacheprovider"],
        cwd=REPO,
        env={"PATH": str(tmp_path), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SKIPPED e2e/test_kind.py: kind end-to-end suite: needs docker, kind, helm, kubectl" in (
        out.stdout
    )
    assert "1 skipped" in out.stdout


# --- the suite's checks ------------------------------------------------------------------------


def test_missing_prerequisites_names_what_is_missing() -> None:
    def run_ok(*_: Any, **__: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(["docker", "info"], 0, "Server: ...", "")

    def run_down(*_: Any, **__: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(["docker", "info"], 1, "", "\nCannot connect\nmore\n")

    def everything(tool: str) -> str:
        return f"/usr/bin/{tool}"

    assert checks.missing_prerequisites(which=everything, run=run_ok) is None
    reason = checks.missing_prerequisites(which=everything, run=run_down)
    assert reason is not None and reason.endswith("`docker info` failed: Cannot connect")
    no_kind = checks.missing_prerequisites(
        which=lambda t: None if t in ("kind", "helm") else t, run=run_ok
    )
    assert no_kind is not None and "kind, helm not on PATH" in no_kind and "\n" not in no_kind


def sample(at: float, replicas: int | None, phase: str = "Running", **status: Any) -> checks.Sample:
    return checks.Sample(
        at=at,
        phase=phase,
        ready=phase == "Running",
        replicas=replicas,
        ready_replicas=replicas or 0,
        **status,
    )


def test_scaling_is_read_from_the_replicas_over_time() -> None:
    samples = [sample(0, None, "Pending"), sample(2, 1, "Pending"), sample(4, 1), sample(6, 1)]
    assert checks.ready(samples) == samples[2]
    assert checks.scaled_out(samples) is None and checks.scaled_in(samples) is None
    samples += [sample(8, 2, "Rescaling"), sample(10, 3), sample(12, 3)]
    assert checks.scaled_out(samples) == samples[4]
    assert checks.scaled_in(samples) is None
    # Going to zero when the job finishes is no scale-in.
    assert checks.scaled_in([*samples, sample(14, 0, "Finished")]) is None
    samples += [sample(14, 1), sample(16, 0, "Finished")]
    found = checks.scaled_in(samples)
    assert found is not None and found.peak == samples[5] and found.after == samples[7]
    assert checks.finished(samples) == samples[-1]
    assert checks.replica_values(samples) == [1, 2, 3, 1, 0]


def decision(action: str, frm: int, to: int, at: str, reason: str | None = None) -> dict[str, Any]:
    text = reason or f"enrich: {frm}→{to}, true rate 20.7k/s per instance, target 20k/s"
    return {
        "time": at,
        "stage": "enrich",
        "from": frm,
        "to": to,
        "action": action,
        "reason": text,
        "inputs": {},
    }


def test_decisions_are_explained_by_status_and_events() -> None:
    up, down = decision("scale_up", 1, 2, "t1"), decision("scale_down", 2, 1, "t2")
    hold = {**decision("hold", 2, 2, "t1b"), "reason": "enrich: no busy time measured"}
    samples = [
        sample(0, 1, decisions=(up, hold)),
        sample(2, 2, decisions=(up, hold)),
        sample(4, 1, decisions=(hold, down)),  # the status keeps only the latest
    ]
    decisions = checks.scale_decisions(samples, "enrich")
    assert decisions == [up, down]
    events = [
        {"reason": "AutoscalerDecision", "message": up["reason"]},
        {"reason": "AutoscalerDecision", "message": down["reason"]},
        {"reason": "Scaled", "message": "e2e-enrich -> 2"},
        {"reason": "Scaled", "message": "e2e-enrich -> 1"},
    ]
    replicas = checks.replica_values(samples)
    assert checks.unexplained(decisions, events, "e2e-enrich", replicas) == []
    problems = checks.unexplained(
        [up, decision("scale_down", 2, 1, "t3", "enrich: 2→1, because")],
        events[:1] + events[2:3],
        "e2e-enrich",
        replicas,
    )
    assert len(problems) == 3, problems
    assert "does not give the true rate" in problems[0]
    assert "no AutoscalerDecision Event" in problems[1]
    assert "no Scaled Event for e2e-enrich -> 1" in problems[2]
    assert checks.unexplained([up], events, "e2e-enrich", [1]) == [
        "no scale_down decision in the status"
    ]


def test_rescales_must_be_done_both_ways_and_none_failed() -> None:
    def rescale(i: int, frm: int, to: int, phase: str) -> dict[str, Any]:
        return {"id": i, "stage": "enrich", "from": frm, "to": to, "phase": phase, "error": None}

    running = [sample(0, 2, rescales=(rescale(1, 1, 2, "moving"),))]
    done = [sample(2, 2, rescales=(rescale(1, 1, 2, "done"), rescale(2, 2, 1, "done")))]
    assert checks.rescale_problems(done, "enrich") == []
    assert len(checks.rescale_problems(running, "enrich")) == 2
    failed = [sample(2, 2, rescales=(rescale(1, 1, 2, "done"), rescale(2, 2, 1, "failed")))]
    assert [p[:9] for p in checks.rescale_problems(failed, "enrich")] == ["rescale 2", "no finish"]


def enrich_output(source: GeneratorSource, total: int) -> pa.Table:
    """What examples.lookups:enrich's job writes for a generator source: each record's key
    and the key's running count (as the sink's JSON lines hold it)."""
    keys, _ = KeyGenerator(source, 0).records(0, total)
    seen: dict[int, int] = {}
    counts = []
    for key in keys.tolist():
        seen[key] = seen.get(key, 0) + 1
        counts.append(str(seen[key]))
    columns = {
        "key": pa.array(keys, pa.int64()),
        "value": pa.array(counts, pa.string()),
        "event_time": pa.array(np.zeros(total, np.int64)),
        "ingest_time": pa.array(np.zeros(total, np.int64)),
        "source": pa.array(np.zeros(total, np.int32)),
        "seq": pa.array(np.arange(total, dtype=np.int64)),
        "_group": pa.array(np.zeros(total, np.int32)),
    }
    return pa.table(columns, schema=process_output_schema(pa.int64()))


def through_the_log(table: pa.Table, path: Path) -> pa.Table:
    with OutputLogWriter(path, 0, "jsonl", 700) as writer:
        for batch in table.to_batches(max_chunksize=333):
            writer.append(batch)
    return OutputLogReader(path).read_all()


def test_output_check_accepts_exactly_once_and_finds_every_kind_of_fault(tmp_path: Path) -> None:
    source = GeneratorSource(keys=50, distribution="zipf", seed=7, total=2000)
    table = enrich_output(source, 2000)
    good = through_the_log(table, tmp_path / "good")
    report = checks.check_output(good, source, 2000)
    assert report.problems == [] and report.records == 2000 and report.per_source == {0: 2000}
    # The sink may see the old and the new owner's outputs interleaved: still exactly once.
    by_key = np.argsort(table.column("key").to_numpy(), kind="stable")
    assert checks.check_output(table.take(by_key), source, 2000).problems == []

    def problems(changed: pa.Table) -> list[str]:
        return checks.check_output(changed, source, 2000).problems

    twice = pa.concat_tables([table, table.slice(10, 1)])
    assert any("more than once" in p for p in problems(twice))
    lost = pa.concat_tables([table.slice(0, 10), table.slice(11)])
    assert any("1 missing" in p for p in problems(lost))
    assert any("records in the output, expected 2000" in p for p in problems(lost))
    # A key's first two records applied the other way round.
    keys = table.column("key").to_pylist()
    first, second = [i for i, k in enumerate(keys) if k == keys[0]][:2]
    values = table.column("value").to_pylist()
    values[first], values[second] = values[second], values[first]
    swapped = table.set_column(1, "value", pa.array(values, pa.string()))
    assert any("out of their source's order" in p for p in problems(swapped))
    # A record applied to a state that missed another.
    values = table.column("value").to_pylist()
    values[second] = values[first]
    skipped = table.set_column(1, "value", pa.array(values, pa.string()))
    assert any("break the count sequence" in p for p in problems(skipped))
    wrong_key = table.set_column(0, "key", pa.array(table.column("key").to_numpy() + 1))
    assert any("carry a key the generator" in p for p in problems(wrong_key))
    assert any("no column" in p for p in problems(table.drop_columns(["seq"])))


@pytest.mark.live
def test_output_check_on_a_real_run_of_the_e2e_pipeline(tmp_path: Path) -> None:
    """The e2e job's pipeline (generator, examples.lookups:enrich over two instances, JSON
    lines), run locally and briefly: the check takes the output the runtime really writes."""
    job = json.loads(json.dumps(JOB_MANIFEST["spec"]["job"]))
    job.pop("autoscaler")
    total = 30_000
    job["source"]["config"].update(total=total, profile={"kind": "constant", "rate": 15_000})
    job["keyed"]["parallelism"] = 2
    job["sink"]["config"]["path"] = str(tmp_path / "out")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    with cli(["run", str(path), "--no-view", "--log-dir", str(tmp_path / "logs")]) as proc:
        wait_for(lambda: proc.poll() is not None, 120, "the job to finish")
        output = proc.stdout.read() if proc.stdout else ""
        assert proc.returncode == 0, output
    source = GeneratorSource.model_validate(job["source"]["config"])
    report = checks.check_output(OutputLogReader(tmp_path / "out").read_all(), source, total)
    assert report.problems == [] and report.records == total, report.problems
