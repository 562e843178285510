"""The kind cluster of the end-to-end suite and the commands that drive it.

`Kube` runs docker, kind, kubectl and helm against one kind cluster (its own kubeconfig, never
the user's), logging every command to e2e/logs/commands.log; the module's functions build and
load the images, install Prometheus and the chart, copy the job's output off the node and dump
what a failure needs (describe, logs, events, `kind export logs`) into e2e/logs/. `JobWatch`
polls the StreamingJob and its keyed StatefulSet on a thread, so no change is missed between
two tests. Used by e2e/conftest.py (the fixtures) and e2e/test_kind.py.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml

from e2e.checks import Sample
from keyshift.operator.k8s_children import stage_set_name
from keyshift.operator.streamingjob import StreamingJob

REPO = Path(__file__).resolve().parent.parent
E2E = REPO / "e2e"
LOGS = E2E / "logs"
KIND_CONFIG = E2E / "kind-config.yaml"
PROMETHEUS = E2E / "prometheus.yaml"
STREAMING_JOB = E2E / "streamingjob.yaml"
SPARK_SMOKE = E2E / "spark-smoke.yaml"
OUTPUT_CLAIM = E2E / "output-claim.yaml"
CHART = REPO / "helm" / "keyshift"
DOCKERFILE = REPO / "Dockerfile"
SPARK_DOCKERFILE = REPO / "docker" / "spark.Dockerfile"

IMAGE_REPOSITORY = "keyshift"
IMAGE_TAG = "e2e"
IMAGE = f"{IMAGE_REPOSITORY}:{IMAGE_TAG}"
SPARK_IMAGE = f"keyshift-spark:{IMAGE_TAG}"
RELEASE = "keyshift"
OPERATOR_NAMESPACE = "keyshift"
JOB_NAMESPACE = "keyshift-e2e"
MONITORING_NAMESPACE = "monitoring"
# The node directory behind the job's output claim (e2e/output-claim.yaml), and where in it the
# job's Spark sink writes what it read (its --output in e2e/streamingjob.yaml).
OUTPUT_ON_NODE = "/var/local/keyshift-e2e"
SPARK_OUTPUT_ON_NODE = f"{OUTPUT_ON_NODE}/spark"
# What the chart and the operator label their objects with (checked gone after uninstall).
LEFTOVER_SELECTORS = (
    "app.kubernetes.io/managed-by=keyshift-operator",
    f"app.kubernetes.io/instance={RELEASE}",
)
# Every kind the chart or the operator may create (CRDs excepted: Helm never deletes them).
LEFTOVER_KINDS = (
    "pods,services,endpointslices,deployments,replicasets,statefulsets,controllerrevisions,"
    "daemonsets,jobs,cronjobs,configmaps,secrets,serviceaccounts,roles,rolebindings,"
    "clusterroles,clusterrolebindings,poddisruptionbudgets,networkpolicies,ingresses,"
    "horizontalpodautoscalers,persistentvolumeclaims,validatingwebhookconfigurations,"
    "mutatingwebhookconfigurations"
)

# The chart's isolation options, on in the suite: the job runs behind its NetworkPolicy (the
# chart's default Prometheus peer is e2e/prometheus.yaml's pods) with a budget per stage.
CHART_OPTIONS = ("networkPolicy.enabled=true", "podDisruptionBudget.enabled=true")

JOB_MANIFEST: dict[str, Any] = yaml.safe_load(STREAMING_JOB.read_text())
JOB_NAME: str = JOB_MANIFEST["metadata"]["name"]
JOB = StreamingJob.model_validate(JOB_MANIFEST).spec.job_spec()
KEYED_SET = stage_set_name(JOB_NAME, JOB.keyed.name)
SINK_SELECTOR = f"keyshift.io/job={JOB_NAME},keyshift.io/stage={JOB.sink.name}"

T = TypeVar("T")


class CommandFailed(RuntimeError):
    """A command exited non-zero; the message has its tail of stderr."""


@dataclass
class Kube:
    """docker, kind, kubectl and helm for one kind cluster."""

    cluster: str
    kubeconfig: Path
    log: Path

    def run(
        self,
        *cmd: str,
        timeout: float = 120,
        check: bool = True,
        stdin: str | None = None,
        output: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run a command with this cluster's kubeconfig; with `output`, its stdout and stderr
        go to that file (long builds) instead of being captured."""
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig), "DOCKER_BUILDKIT": "1"}
        started = time.monotonic()
        try:
            if output is None:
                proc = subprocess.run(
                    cmd,
                    env=env,
                    input=stdin,
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                    check=False,
                )
            else:
                output.parent.mkdir(parents=True, exist_ok=True)
                with output.open("w") as sink:
                    proc = subprocess.run(
                        cmd,
                        env=env,
                        input=stdin,
                        stdout=sink,
                        stderr=subprocess.STDOUT,
                        text=True,
                        timeout=timeout,
                        check=False,
                    )
        except subprocess.TimeoutExpired:
            self._note(cmd, f"timed out after {timeout:.0f} s")
            raise
        self._note(cmd, f"exit {proc.returncode} in {time.monotonic() - started:.1f} s")
        if check and proc.returncode != 0:
            detail = f"see {output}" if output is not None else (proc.stderr or "").strip()[-3000:]
            raise CommandFailed(f"`{shlex.join(cmd)}` exited {proc.returncode}: {detail}")
        return proc

    def _note(self, cmd: tuple[str, ...], outcome: str) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} {shlex.join(cmd)}  # {outcome}\n")

    def kubectl(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return self.run("kubectl", *args, **kwargs)

    def helm(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return self.run("helm", *args, **kwargs)

    def get_json(self, *args: str, timeout: float = 60) -> Any:
        """`kubectl get ... -o json`, parsed; None when --ignore-not-found found nothing."""
        out = self.kubectl("get", *args, "--output", "json", timeout=timeout).stdout
        return json.loads(out) if out.strip() else None

    # -- the cluster ---------------------------------------------------------------------------

    def create_cluster(self) -> None:
        self.run(
            "kind",
            "create",
            "cluster",
            "--name",
            self.cluster,
            "--config",
            str(KIND_CONFIG),
            "--kubeconfig",
            str(self.kubeconfig),
            "--wait",
            "300s",
            timeout=900,
        )

    def delete_cluster(self) -> None:
        self.run(
            "kind",
            "delete",
            "cluster",
            "--name",
            self.cluster,
            "--kubeconfig",
            str(self.kubeconfig),
            timeout=300,
            check=False,
        )

    def nodes(self) -> list[str]:
        return self.run("kind", "get", "nodes", "--name", self.cluster).stdout.split()

    def load_image(self, image: str) -> None:
        self.run("kind", "load", "docker-image", image, "--name", self.cluster, timeout=1800)


# -- setting the cluster up ---------------------------------------------------------------------


def build_images(kube: Kube) -> None:
    """Both images, as a developer builds them (BuildKit). Without provenance attestations:
    with Docker's containerd image store they make an image index that `kind load` cannot
    import."""
    kube.run(
        "docker",
        "build",
        "--provenance=false",
        "--tag",
        IMAGE,
        "--file",
        str(DOCKERFILE),
        str(REPO),
        timeout=2400,
        output=LOGS / "build-keyshift.log",
    )
    kube.run(
        "docker",
        "build",
        "--provenance=false",
        "--tag",
        SPARK_IMAGE,
        "--file",
        str(SPARK_DOCKERFILE),
        "--build-arg",
        f"KEYSHIFT_IMAGE={IMAGE}",
        str(REPO),
        timeout=2400,
        output=LOGS / "build-keyshift-spark.log",
    )


def prepare_output_dir(kube: Kube) -> None:
    """The hostPath the job's sink writes to, on every node, writable by uid 10001."""
    for node in kube.nodes():
        kube.run("docker", "exec", node, "mkdir", "-p", "-m", "0777", OUTPUT_ON_NODE)


def install_prometheus(kube: Kube) -> None:
    kube.kubectl("apply", "--filename", str(PROMETHEUS))
    kube.kubectl(
        "rollout",
        "status",
        "deployment/prometheus",
        "--namespace",
        MONITORING_NAMESPACE,
        "--timeout",
        "300s",
        timeout=360,
    )


def install_chart(kube: Kube) -> None:
    kube.helm(
        "install",
        RELEASE,
        str(CHART),
        "--namespace",
        OPERATOR_NAMESPACE,
        "--create-namespace",
        "--set",
        f"image.repository={IMAGE_REPOSITORY}",
        "--set",
        f"image.tag={IMAGE_TAG}",
        "--set",
        "image.pullPolicy=IfNotPresent",
        *(arg for option in CHART_OPTIONS for arg in ("--set", option)),
        "--wait",
        "--timeout",
        "5m",
        timeout=420,
    )


def apply_job(kube: Kube) -> None:
    kube.kubectl("create", "namespace", JOB_NAMESPACE)
    kube.kubectl("apply", "--filename", str(OUTPUT_CLAIM))
    kube.kubectl("apply", "--namespace", JOB_NAMESPACE, "--filename", str(STREAMING_JOB))


def copy_output(kube: Kube, dest: Path) -> Path:
    """The sink's output log, copied off the node it was written on."""
    found = []
    for node in kube.nodes():
        listing = kube.run("docker", "exec", node, "ls", "-A", OUTPUT_ON_NODE, check=False)
        if any(name.startswith("part-") for name in listing.stdout.split()):
            kube.run("docker", "cp", f"{node}:{OUTPUT_ON_NODE}", str(dest / node), timeout=600)
            found.append(dest / node)
    if len(found) != 1:
        pytest.fail(
            f"expected the output log on one node, found it on {len(found)}: {found}", pytrace=False
        )
    return found[0]


def copy_spark_output(kube: Kube, dest: Path) -> Path | None:
    """What the job's Spark sink wrote so far, copied off the node (None before it wrote)."""
    for node in kube.nodes():
        listing = kube.run("docker", "exec", node, "ls", "-A", SPARK_OUTPUT_ON_NODE, check=False)
        if "_spark_metadata" in listing.stdout.split():
            kube.run("docker", "cp", f"{node}:{SPARK_OUTPUT_ON_NODE}", str(dest), timeout=600)
            return dest
    return None


# -- watching the job ---------------------------------------------------------------------------


class JobWatch:
    """Polls the StreamingJob and its keyed StatefulSet every `every` seconds on a thread, keeps
    every sample (and appends it to `history` as JSON lines), and waits for conditions on them."""

    def __init__(self, kube: Kube, history: Path, every: float = 2.0) -> None:
        self.kube = kube
        self.history = history
        self.every = every
        self._samples: list[Sample] = []
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="e2e-job-watch", daemon=True)
        self._started = time.monotonic()

    def start(self) -> None:
        self._started = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)

    def samples(self) -> list[Sample]:
        with self._changed:
            return list(self._samples)

    def _run(self) -> None:
        self.history.parent.mkdir(parents=True, exist_ok=True)
        with self.history.open("a") as out:
            while not self._stop.is_set():
                sample = self._poll()
                if sample is not None:
                    out.write(json.dumps(asdict(sample)) + "\n")
                    out.flush()
                    with self._changed:
                        self._samples.append(sample)
                        self._changed.notify_all()
                self._stop.wait(self.every)

    def _poll(self) -> Sample | None:
        try:
            job = self.kube.get_json(
                "streamingjob",
                JOB_NAME,
                "--namespace",
                JOB_NAMESPACE,
                "--ignore-not-found",
                timeout=30,
            )
            stateful_set = self.kube.get_json(
                "statefulset",
                KEYED_SET,
                "--namespace",
                JOB_NAMESPACE,
                "--ignore-not-found",
                timeout=30,
            )
        except (CommandFailed, subprocess.TimeoutExpired, json.JSONDecodeError):
            return None  # the API server is busy: the next poll will tell
        return Sample.of(time.monotonic() - self._started, job, stateful_set)

    def wait_for(self, analyse: Callable[[list[Sample]], T | None], timeout: float, what: str) -> T:
        """The first non-None answer of `analyse` on the samples so far; fails the test after
        `timeout` seconds, or at once if the job has Failed."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                samples = list(self._samples)
                answer = analyse(samples)
                if answer is not None:
                    return answer
                last = samples[-1].brief() if samples else "no sample yet"
                if samples and samples[-1].phase == "Failed":
                    pytest.fail(
                        f"the job Failed while waiting for {what}; last: {last}", pytrace=False
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    pytest.fail(
                        f"timed out after {timeout:.0f} s waiting for {what}; last: {last}",
                        pytrace=False,
                    )
                self._changed.wait(min(left, 10.0))


def wait_until(
    condition: Callable[[], T | None], timeout: float, what: str, every: float = 2.0
) -> T:
    """Poll `condition` until it answers (not None); fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        answer = condition()
        if answer is not None:
            return answer
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}", pytrace=False)
        time.sleep(every)


# -- when something fails -----------------------------------------------------------------------


def dump_diagnostics(kube: Kube, dest: Path) -> None:
    """What a failure needs, written to `dest`: the cluster's objects, events, pod descriptions
    and logs (the previous container's too, after a restart), Helm's releases and the node logs
    (`kind export logs`). Never raises: a dump must not hide the failure it documents."""

    def save(name: str, *cmd: str, timeout: float = 120) -> str:
        stdout = ""
        try:
            proc = kube.run(*cmd, check=False, timeout=timeout)
            stdout = proc.stdout or ""
            text = stdout + (proc.stderr or "")
        except (OSError, subprocess.SubprocessError) as exc:
            text = f"{shlex.join(cmd)}: {exc}\n"
        path = dest / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return stdout

    dest.mkdir(parents=True, exist_ok=True)
    save("nodes.txt", "kubectl", "get", "nodes", "--output", "wide")
    save(
        "objects.txt",
        "kubectl",
        "get",
        "all,configmaps,streamingjobs",
        "--all-namespaces",
        "--output",
        "wide",
    )
    save(
        "streamingjobs.yaml",
        "kubectl",
        "get",
        "streamingjobs",
        "--all-namespaces",
        "--output",
        "yaml",
    )
    save(
        "events.txt",
        "kubectl",
        "get",
        "events",
        "--all-namespaces",
        "--sort-by",
        ".metadata.creationTimestamp",
    )
    save("helm.txt", "helm", "list", "--all-namespaces")
    for ns in (OPERATOR_NAMESPACE, JOB_NAMESPACE, MONITORING_NAMESPACE):
        save(
            f"describe-{ns}.txt",
            "kubectl",
            "describe",
            "pods,statefulsets,deployments",
            "--namespace",
            ns,
        )
        listing = save(
            f"pods-{ns}.json", "kubectl", "get", "pods", "--namespace", ns, "--output", "json"
        )
        try:
            pods = json.loads(listing).get("items", []) if listing.strip() else []
        except json.JSONDecodeError:
            pods = []
        for pod in pods:
            name = pod["metadata"]["name"]
            statuses = pod.get("status", {}).get("containerStatuses") or []
            restarted = {s["name"] for s in statuses if s.get("restartCount", 0) > 0}
            for container in pod["spec"]["containers"]:
                c = container["name"]
                base = ("kubectl", "logs", name, "--namespace", ns, "--container", c)
                save(f"logs/{ns}/{name}.{c}.log", *base, "--timestamps")
                if c in restarted:
                    save(f"logs/{ns}/{name}.{c}.previous.log", *base, "--timestamps", "--previous")
    save(
        "kind-export.txt",
        "kind",
        "export",
        "logs",
        str(dest / "kind"),
        "--name",
        kube.cluster,
        timeout=300,
    )
