"""A running job exports every metric the runtime promises, with sane values; the names and
labels follow Prometheus' conventions."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from keyshift.runtime.metrics import (
    COUNTERS,
    HELP,
    INSTANCE_LABEL,
    JOB_LABEL,
    MIGRATION_KINDS,
    MIGRATION_SCALE,
    CoordinatorMetrics,
    InstanceMetrics,
    MetricName,
    OperatorMetrics,
)
from tests.conftest import count_job, running_job, wait_for


def scrape(address: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            samples.setdefault(sample.name, {})[labels] = sample.value
    return samples


def one(samples: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str) -> float:
    values = samples[name]
    assert len(values) == 1, (name, values)
    return next(iter(values.values()))


@pytest.mark.live
def test_every_instance_exports_its_metrics(tmp_path: Path) -> None:
    job = count_job(
        source={"config": {"kind": "generator", "keys": 1000, "profile": {"rate": 20000}}},
        keyed={"name": "counts", "parallelism": 2},
        sink={"config": {"kind": "log", "path": str(tmp_path / "out"), "format": "jsonl"}},
    )
    with running_job(tmp_path, job) as local:

        def all_flowing() -> dict[str, object] | None:
            status = local.status()
            instances = [i for s in status["stages"] for i in s["instances"]]
            ready = status["phase"] == "running" and all(
                i["stats"].get("records_in", 0) > 0 and i["metrics"] for i in instances
            )
            return status if ready else None

        status = wait_for(all_flowing, 30, "records to reach every instance")
        by_stage = {s["name"]: s for s in status["stages"]}
        for stage_name, stage in by_stage.items():
            for instance in stage["instances"]:
                samples = scrape(instance["metrics"])
                labels = tuple(
                    sorted(
                        {
                            INSTANCE_LABEL: str(instance["index"]),
                            JOB_LABEL: "t",
                            "stage": stage_name,
                        }.items()
                    )
                )
                for name in (*COUNTERS, MetricName.QUEUE_DEPTH, MetricName.STATE_KEYS):
                    assert labels in samples[name], (stage_name, name)
                assert one(samples, MetricName.RECORDS_IN) > 0
                assert one(samples, MetricName.BUSY_SECONDS) > 0
                assert one(samples, MetricName.STATE_BYTES) >= 0
                assert one(samples, MetricName.PARALLELISM) == stage["parallelism"]
                assert 0 <= one(samples, MetricName.QUEUE_DEPTH) <= 8 * 2
        keyed = scrape(by_stage["counts"]["instances"][0]["metrics"])
        assert one(keyed, MetricName.STATE_KEYS) > 0
        assert one(keyed, MetricName.STATE_BYTES) > 0
        assert one(keyed, MetricName.RECORDS_OUT) > 0
        source = scrape(by_stage["source"]["instances"][0]["metrics"])
        assert one(source, MetricName.SOURCE_TARGET_RATE) == 20000

        def latency_observed() -> dict[str, dict[tuple[tuple[str, str], ...], float]] | None:
            sink = scrape(by_stage["sink"]["instances"][0]["metrics"])
            return sink if one(sink, MetricName.LATENCY + "_count") > 0 else None

        sink = wait_for(latency_observed, 20, "the sink to observe latencies")
        count = one(sink, MetricName.LATENCY + "_count")
        mean = one(sink, MetricName.LATENCY + "_sum") / count
        assert 0 < mean < 5.0, mean
        buckets = sink[MetricName.LATENCY + "_bucket"]
        assert max(buckets.values()) == count  # the +Inf bucket holds every observation

        coordinator = scrape(f"127.0.0.1:{local.coordinator_metrics_port}")
        parallelism = coordinator[MetricName.JOB_PARALLELISM]
        assert parallelism[((JOB_LABEL, "t"), ("stage", "counts"))] == 2
        assert coordinator[MetricName.JOB_PHASE][((JOB_LABEL, "t"), ("phase", "running"))] == 1


# The 0/1 state gauges, a phase (a state set) and a flag, have no unit.
UNITLESS = {MetricName.JOB_PHASE, MetricName.RESCALE_RUNNING}
UNITS = ("_seconds", "_bytes", "_records", "_keys", "_key_groups", "_fetches", "_batches",
         "_instances", "_jobs", "_records_per_second")  # fmt: skip
TARGET_LABELS = {"job", "instance", "namespace", "pod", "container", "service", "endpoint"}


def test_every_name_ends_in_its_unit_and_no_label_collides_with_a_target_label() -> None:
    assert set(HELP) == set(MetricName)
    for name in MetricName:
        # A counter counts events (rescales, decisions) or units (records, bytes): `_total`.
        if name in UNITLESS or name.endswith("_total"):
            continue
        assert name.endswith(UNITS), name
    # Counters carry _total, the other families do not.
    registries = [
        InstanceMetrics("j", "s", "0").registry,
        CoordinatorMetrics("j").registry,
        OperatorMetrics().registry,
    ]
    for registry in registries:
        for family in registry.collect():
            for sample in family.samples:
                assert not set(sample.labels) & TARGET_LABELS, (sample.name, sample.labels)
            if family.type == "counter":
                assert MetricName(f"{family.name}_total") in MetricName
            else:
                assert not family.name.endswith("_total"), family.name


def test_a_move_counts_each_unit_in_its_own_metric() -> None:
    metrics = InstanceMetrics("j", "s", "0")
    stats = metrics.migration_stats()
    for kind in MIGRATION_KINDS:
        stats[kind] += 3
    stats["bytes_in"] += 1000
    labels = {JOB_LABEL: "j", "stage": "s", INSTANCE_LABEL: "0"}
    for kind, (metric, label) in MIGRATION_KINDS.items():
        # A move's durations are counted in ms and exported in seconds.
        expected = (1003 if kind == "bytes_in" else 3) * MIGRATION_SCALE.get(kind, 1)
        value = metrics.registry.get_sample_value(metric, {**labels, "kind": label})
        assert value == expected, (kind, metric, label)
    assert dict(stats)["bytes_in"] == 1003  # the move's own report keeps its names
    with pytest.raises(KeyError, match="unknown_kind"):
        stats["unknown_kind"] += 1
    assert "unknown_kind" not in stats
