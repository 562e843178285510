"""keyshift on a real cluster: kind, the images built here, the Helm chart, a load step.

The session (e2e/conftest.py) creates a kind cluster, builds and loads both images, installs
Prometheus and the chart; then these tests, in order, follow one StreamingJob
(e2e/streamingjob.yaml) whose generator steps its load up and back down and stops:

1. it becomes Ready (behind its NetworkPolicy: the chart is installed with NetworkPolicies and
   PodDisruptionBudgets on), and the operator made the policy and a budget per stage;
2. the operator scales the keyed stage out after the step ...
3. ... and back in after the drop;
4. the CR's status and its Events explain each decision (DS2's true rates), and the status's
   rescale history shows both rescales done;
5. it finishes, and its output holds every record exactly once, in order, with the right keys;
6. its Spark sink, a PySpark query the operator runs in the cluster, reads that output from the
   job's output claim exactly once;
7. the Spark image runs a PySpark app as the operator runs Spark sources and sinks;
8. deleting the job and `helm uninstall` leave nothing of keyshift behind.

Every wait polls `kubectl get -o json` against a deadline. Run it with `pytest e2e -m e2e -v`
(see e2e/README.md); without docker, kind, helm, kubectl or a Docker engine it skips itself with
the reason (set KEYSHIFT_E2E_REQUIRE=1 to make that an error instead, as the workflow does).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from e2e import checks
from e2e.cluster import (
    JOB,
    JOB_NAME,
    JOB_NAMESPACE,
    KEYED_SET,
    LEFTOVER_KINDS,
    LEFTOVER_SELECTORS,
    OPERATOR_NAMESPACE,
    RELEASE,
    SINK_SELECTOR,
    SPARK_SMOKE,
    JobWatch,
    Kube,
    copy_output,
    copy_spark_output,
    wait_until,
)
from keyshift.operator.k8s_children import stage_set_name
from keyshift.runtime.job import GeneratorSource
from keyshift.runtime.output_log import OutputLogReader

REASON = checks.missing_prerequisites()
if REASON is not None:
    if os.environ.get("KEYSHIFT_E2E_REQUIRE") == "1":
        pytest.fail(f"KEYSHIFT_E2E_REQUIRE=1, but {REASON}", pytrace=False)
    pytest.skip(f"kind end-to-end suite: {REASON}", allow_module_level=True)

# The whole suite runs in one session fixture's cluster: no per-test limit below the workflow's.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3000)]

READY_TIMEOUT = 360.0  # pods scheduled and started, every instance registered
SCALE_OUT_TIMEOUT = 360.0  # the step comes 45 s into the job
SCALE_IN_TIMEOUT = 420.0  # the drop comes 75 s after the step
FINISH_TIMEOUT = 600.0  # the last record comes 240 s into the job
SMOKE_TIMEOUT = 420.0
SPARK_SINK_TIMEOUT = 600.0  # the Spark sink reads the last records after the job finished
UNINSTALL_TIMEOUT = 300.0


def test_job_becomes_ready(job: JobWatch) -> None:
    sample = job.wait_for(
        checks.ready, READY_TIMEOUT, "the StreamingJob to become Ready (Ready=True or Running)"
    )
    assert sample.replicas == JOB.keyed.parallelism, sample.brief()


def test_the_operator_made_the_jobs_network_policy_and_budgets(kube: Kube, job: JobWatch) -> None:
    """Runs in the kind workflow only: the NetworkPolicy and the PodDisruptionBudgets exist,
    owned by the StreamingJob, and each budget covers its stage's running pods (the job became
    Ready through the policy, so the coordinator, instances, operator and Prometheus it admits
    really talk where the network plugin enforces it)."""
    listing = kube.get_json(
        "networkpolicies,poddisruptionbudgets",
        "--namespace",
        JOB_NAMESPACE,
        "--selector",
        f"keyshift.io/job={JOB_NAME}",
    )
    expected = [f"NetworkPolicy {JOB_NAMESPACE}/{JOB_NAME}"] + [
        f"PodDisruptionBudget {JOB_NAMESPACE}/{stage_set_name(JOB_NAME, s.name)}"
        for s in JOB.stages()
    ]
    assert checks.leftovers(listing["items"]) == sorted(expected)
    for item in listing["items"]:
        owners = item["metadata"].get("ownerReferences", [])
        assert [(o["kind"], o["name"]) for o in owners] == [("StreamingJob", JOB_NAME)], item
        if item["kind"] == "PodDisruptionBudget":
            assert (item.get("status") or {}).get("expectedPods", 0) >= 1, item


def test_keyed_stage_scales_out_after_the_load_step(job: JobWatch) -> None:
    out = job.wait_for(
        checks.scaled_out, SCALE_OUT_TIMEOUT, f"{KEYED_SET} to scale out after the load step"
    )
    bounds = JOB.autoscaler.bounds_of(JOB.keyed.name) if JOB.autoscaler else None
    assert out.replicas is not None and bounds is not None
    assert 2 <= out.replicas <= bounds.max_parallelism, out.brief()
    wanted = out.replicas
    job.wait_for(
        lambda samples: next((s for s in samples if s.ready_replicas >= wanted), None),
        READY_TIMEOUT,
        f"{wanted} ready pods in {KEYED_SET}",
    )


def test_keyed_stage_scales_back_in_after_the_drop(job: JobWatch) -> None:
    scale_in = job.wait_for(
        checks.scaled_in, SCALE_IN_TIMEOUT, f"{KEYED_SET} to scale back in after the load drop"
    )
    assert scale_in.after.at > scale_in.peak.at
    assert 1 <= (scale_in.after.replicas or 0) < (scale_in.peak.replicas or 0)


def test_status_and_events_explain_each_decision(kube: Kube, job: JobWatch) -> None:
    selector = f"involvedObject.kind=StreamingJob,involvedObject.name={JOB_NAME}"

    def problems() -> list[str]:
        samples = job.samples()
        events = kube.get_json(
            "events", "--namespace", JOB_NAMESPACE, "--field-selector", selector
        )["items"]
        return checks.unexplained(
            checks.scale_decisions(samples, JOB.keyed.name),
            events,
            KEYED_SET,
            checks.replica_values(samples),
        ) + checks.rescale_problems(samples, JOB.keyed.name)

    # Events are posted a moment after the status changes: give the latest ones time to land.
    found = problems()
    deadline = time.monotonic() + 60
    while found and time.monotonic() < deadline:
        time.sleep(3)
        found = problems()
    assert not found, "\n".join(found)


def test_job_finishes_with_every_record_exactly_once(
    kube: Kube, job: JobWatch, tmp_path: Path
) -> None:
    source = JOB.source.config
    assert isinstance(source, GeneratorSource) and source.total is not None
    job.wait_for(checks.finished, FINISH_TIMEOUT, "the job to finish (phase Finished)")

    # The operator stops a finished job's workers; once the sink's pod is gone, its last
    # segment is on the node.
    def sink_gone() -> bool | None:
        pods = kube.get_json("pods", "--namespace", JOB_NAMESPACE, "--selector", SINK_SELECTOR)
        return True if not pods["items"] else None

    wait_until(sink_gone, 180, "the finished job's sink pod to stop")
    out = copy_output(kube, tmp_path)
    report = checks.check_output(OutputLogReader(out).read_all(), source, source.total)
    assert not report.problems, "\n".join(report.problems)
    assert report.records == source.total and report.keys > 1


def test_a_spark_query_in_the_cluster_reads_the_output_exactly_once(
    kube: Kube, job: JobWatch, tmp_path: Path
) -> None:
    """The job's Spark sink (spec.sinks `count`, examples/spark/sink_job.py) runs in its own
    Deployment with the job's output claim mounted where the sink stage writes the log, reads
    it with `spark.readStream.format("keyshift")` and writes what it read as Parquet on the same
    claim. Once the job has finished, the committed Parquet files hold every record of the log
    once. Needs the kind cluster: it runs in the GitHub e2e workflow only."""
    source = JOB.source.config
    assert isinstance(source, GeneratorSource) and source.total is not None
    job.wait_for(checks.finished, FINISH_TIMEOUT, "the job to finish (phase Finished)")
    (tmp_path / "log").mkdir()
    log = OutputLogReader(copy_output(kube, tmp_path / "log")).read_all(with_partition=True)
    polls = iter(range(1_000_000))

    def read_everything() -> pa.Table | None:
        copied = copy_spark_output(kube, tmp_path / f"spark-{next(polls)}")
        if copied is None:
            return None
        metadata = sorted(
            (copied / "_spark_metadata").iterdir(), key=lambda p: int(p.name.split(".")[0])
        )
        names = checks.committed_spark_files(p.read_text() for p in metadata)
        if not names:
            return None
        table = pa.concat_tables([pq.read_table(copied / name) for name in names])
        return table if table.num_rows >= log.num_rows else None

    what = "the Spark sink to read the whole log"
    read = wait_until(read_everything, SPARK_SINK_TIMEOUT, what, every=15.0)
    problems = checks.same_records(read, log)
    assert not problems, "\n".join(problems)
    report = checks.check_output(read, source, source.total)
    assert not report.problems, "\n".join(report.problems)


def test_spark_image_runs_a_pyspark_app_as_the_operator_would(kube: Kube) -> None:
    kube.kubectl("apply", "--namespace", JOB_NAMESPACE, "--filename", str(SPARK_SMOKE))
    try:

        def phase() -> str | None:
            pod = kube.get_json("pod", "spark-smoke", "--namespace", JOB_NAMESPACE)
            value = (pod.get("status") or {}).get("phase")
            return value if value in ("Succeeded", "Failed") else None

        outcome = wait_until(phase, SMOKE_TIMEOUT, "the Spark smoke pod to complete")
        logs = kube.kubectl("logs", "spark-smoke", "--namespace", JOB_NAMESPACE).stdout
        assert outcome == "Succeeded", logs[-4000:]
        assert "keyshift-e2e-smoke range=499500 workers=4950" in logs, logs[-4000:]
    finally:
        kube.kubectl(
            "delete",
            "--namespace",
            JOB_NAMESPACE,
            "--filename",
            str(SPARK_SMOKE),
            "--ignore-not-found",
            "--wait=false",
            check=False,
        )


def test_uninstall_removes_everything(kube: Kube, job: JobWatch) -> None:
    job.stop()
    # The job first: its finalizer needs the operator, which `helm uninstall` removes.
    kube.kubectl(
        "delete",
        "streamingjob",
        JOB_NAME,
        "--namespace",
        JOB_NAMESPACE,
        "--wait=true",
        "--timeout=180s",
        timeout=240,
    )
    kube.helm(
        "uninstall",
        RELEASE,
        "--namespace",
        OPERATOR_NAMESPACE,
        "--wait",
        "--timeout",
        "5m",
        timeout=360,
    )
    releases = json.loads(kube.helm("list", "--all-namespaces", "--output", "json").stdout)
    assert RELEASE not in [r["name"] for r in releases], releases

    deadline = time.monotonic() + UNINSTALL_TIMEOUT
    while True:
        found = []
        for selector in LEFTOVER_SELECTORS:
            listing = kube.get_json(LEFTOVER_KINDS, "--all-namespaces", "--selector", selector)
            found += [f"{item} ({selector})" for item in checks.leftovers(listing["items"])]
        if not found:
            break
        if time.monotonic() > deadline:
            pytest.fail(
                f"still there {UNINSTALL_TIMEOUT:.0f} s after uninstall:\n" + "\n".join(found),
                pytrace=False,
            )
        time.sleep(3)
