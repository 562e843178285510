"""Every Prometheus metric keyshift exports, defined in one place, and the per-process registry.

Each coordinator and stage instance serves its own registry over HTTP. Names are `keyshift_*`
and end in their unit as Prometheus' naming asks (`_total` for counters, after the unit:
`_records_total`, `_seconds_total`, `_bytes_total`; gauges in `_seconds`, `_bytes`, `_records`,
`_instances`...; only the 0/1 state gauges `keyshift_job_phase` and
`keyshift_rescale_in_progress` have none). Rates are not exported: PromQL computes them from the
counters. keyshift's own labels are `keyshift_job`, `stage` and `keyshift_instance` (and
`keyshift_namespace` for the operator's per-StreamingJob series), so they never collide with the
`job`, `instance` and `namespace` target labels Prometheus attaches: scrape without
honor_labels. The sink's latency histogram takes whole batches of observations (numpy), because
one `observe` call per record would cost more than the record. Used by the stage instances, the
coordinator, the autoscaler and operator, and the tests that check what is exported.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from enum import StrEnum
from typing import Any, Literal, Protocol

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

JOB_LABEL = "keyshift_job"
INSTANCE_LABEL = "keyshift_instance"
NAMESPACE_LABEL = "keyshift_namespace"
LABELS = (JOB_LABEL, "stage", INSTANCE_LABEL)
LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
)  # fmt: skip


class MetricName(StrEnum):
    RECORDS_IN = "keyshift_input_records_total"
    RECORDS_OUT = "keyshift_output_records_total"
    BUSY_SECONDS = "keyshift_busy_seconds_total"
    IDLE_SECONDS = "keyshift_idle_seconds_total"
    BACKPRESSURED_SECONDS = "keyshift_backpressured_seconds_total"
    QUEUE_DEPTH = "keyshift_input_queue_batches"
    LATENCY = "keyshift_end_to_end_latency_seconds"
    STATE_KEYS = "keyshift_state_keys"
    STATE_BYTES = "keyshift_state_bytes"
    PARALLELISM = "keyshift_stage_instances"
    INVALID_RECORDS = "keyshift_invalid_records_total"
    LATE_RECORDS = "keyshift_late_records_total"
    SOURCE_TARGET_RATE = "keyshift_source_target_records_per_second"
    SOURCE_BACKLOG = "keyshift_source_backlog_records"
    CLIENT_BACKLOG = "keyshift_source_client_backlog_records"
    CLIENT_BACKLOG_AGE = "keyshift_source_client_backlog_age_seconds"
    JOB_PARALLELISM = "keyshift_job_stage_instances"
    JOB_PHASE = "keyshift_job_phase"
    MIGRATION_KEY_GROUPS = "keyshift_migration_key_groups_total"
    MIGRATION_KEYS = "keyshift_migration_keys_total"
    MIGRATION_BYTES = "keyshift_migration_bytes_total"
    MIGRATION_SECONDS = "keyshift_migration_transfer_seconds_total"
    MIGRATION_FETCHES = "keyshift_migration_fetches_total"
    MIGRATION_RECORDS = "keyshift_migration_records_total"
    PARKED_NOW = "keyshift_migration_parked_records"
    RESCALE_RUNNING = "keyshift_rescale_in_progress"
    RESCALES = "keyshift_rescales_total"
    HANDOVER_BYTES = "keyshift_rescale_handover_bytes_total"
    HANDOVER_FALLBACKS = "keyshift_rescale_handover_fallbacks_total"
    AUTOSCALER_PARALLELISM = "keyshift_autoscaler_current_instances"
    AUTOSCALER_RECOMMENDED = "keyshift_autoscaler_recommended_instances"
    AUTOSCALER_DECISIONS = "keyshift_autoscaler_decisions_total"
    AUTOSCALER_ERRORS = "keyshift_autoscaler_errors_total"
    OPERATOR_RECONCILES = "keyshift_operator_reconciles_total"
    OPERATOR_JOBS = "keyshift_operator_jobs"
    CHECKPOINTS = "keyshift_checkpoints_total"
    CHECKPOINT_SECONDS = "keyshift_checkpoint_duration_seconds"
    CHECKPOINT_BYTES = "keyshift_checkpoint_size_bytes"
    CHECKPOINT_COMPLETED_TIME = "keyshift_checkpoint_last_completed_timestamp_seconds"
    RECOVERIES = "keyshift_recoveries_total"
    RECOVERY_SECONDS = "keyshift_recovery_duration_seconds"
    RECOVERY_LOCAL = "keyshift_recovery_local_instances"
    RPC_UNAUTHENTICATED = "keyshift_rpc_unauthenticated_total"
    STORAGE_FAILURES = "keyshift_storage_failures_total"
    WATERMARK = "keyshift_watermark_seconds"
    WATERMARK_LAG = "keyshift_watermark_lag_seconds"


COUNTERS = (
    MetricName.RECORDS_IN,
    MetricName.RECORDS_OUT,
    MetricName.BUSY_SECONDS,
    MetricName.IDLE_SECONDS,
    MetricName.BACKPRESSURED_SECONDS,
    MetricName.LATE_RECORDS,
)

HELP: dict[MetricName, str] = {
    MetricName.RECORDS_IN: "Records received by this instance.",
    MetricName.RECORDS_OUT: "Records emitted by this instance.",
    MetricName.BUSY_SECONDS: "Seconds spent processing records (DS2's useful time).",
    MetricName.IDLE_SECONDS: "Seconds spent waiting for input.",
    MetricName.BACKPRESSURED_SECONDS: "Seconds spent waiting for downstream credit.",
    MetricName.QUEUE_DEPTH: "Batches waiting in this instance's input queue.",
    MetricName.LATENCY: "Ingest-to-sink latency of records, in seconds.",
    MetricName.STATE_KEYS: "Keys held in this instance's keyed state.",
    MetricName.STATE_BYTES: "Estimated bytes of this instance's keyed state.",
    MetricName.PARALLELISM: "Instances of this instance's stage (its parallelism).",
    MetricName.INVALID_RECORDS: "Records rejected because they do not fit the job's schema.",
    MetricName.LATE_RECORDS: "Rows of event-time windows (one per record and window) that came "
    "after the watermark passed their window's end plus the allowed lateness: not applied, "
    "written to the job's late-records log if it names one.",
    MetricName.SOURCE_TARGET_RATE: "Records per second the source's load profile asks for now.",
    MetricName.SOURCE_BACKLOG: "Records that arrived (or fell due) but the source has not "
    "taken in yet.",
    MetricName.CLIENT_BACKLOG: "Records an ingest source's clients report due but not pushed "
    "yet (outside the job), summed over the clients heard from in the last minute.",
    MetricName.CLIENT_BACKLOG_AGE: "How long ago the oldest record an ingest source's clients "
    "have not pushed yet fell due, in seconds (0 without such records).",
    MetricName.JOB_PARALLELISM: "Instances of each stage (its parallelism), as the coordinator "
    "assigns them.",
    MetricName.JOB_PHASE: "1 for the job's current phase, 0 for the others.",
    MetricName.MIGRATION_KEY_GROUPS: "Key groups a live migration moved, by kind (in, out, "
    "pushed in the background).",
    MetricName.MIGRATION_KEYS: "Keys whose state a live migration moved, by kind (in, out, "
    "fetched on demand, fetched_out: served on demand).",
    MetricName.MIGRATION_BYTES: "Bytes of state a live migration moved, by kind (in, out).",
    MetricName.MIGRATION_SECONDS: "Seconds a live migration spent moving state, by kind (out: "
    "from freezing the groups to sending their last chunk; in: from the move's start to the last "
    "group's state in); bytes / seconds of a kind is that end's MB/s.",
    MetricName.MIGRATION_FETCHES: "On-demand state fetches, by kind (requested by a new owner, "
    "served by an old one).",
    MetricName.MIGRATION_RECORDS: "Records a live migration held up, by kind (parked waiting "
    "for their key's state, forwarded to the key's new owner).",
    MetricName.PARKED_NOW: "Records parked at this instance, waiting for their key's state.",
    MetricName.RESCALE_RUNNING: "1 while a rescale of the stage runs.",
    MetricName.RESCALES: "Finished rescales by strategy and result (done or failed).",
    MetricName.HANDOVER_BYTES: "Bytes of keyed state the rescales of a checkpointed job moved "
    "with hand-over from checkpoints, by kind (preloaded: read from the checkpoint by the new "
    "owners before the switch; switch: moved between the instances at switch time).",
    MetricName.HANDOVER_FALLBACKS: "Rescales of a checkpointed job that moved state directly "
    "instead of (or, for some groups, besides) handing it over from a checkpoint, by cause "
    "(preload: a checkpoint missing, corrupt or unreadable; changes: an old owner did not know "
    "the changes since the checkpoint; none: no checkpoint had completed).",
    MetricName.AUTOSCALER_PARALLELISM: "Instances of each stage when the autoscaler last looked.",
    MetricName.AUTOSCALER_RECOMMENDED: "Instances the autoscaler's policy recommends per stage.",
    MetricName.AUTOSCALER_DECISIONS: "Autoscaler decisions by stage and action (scale_up, "
    "scale_down, hold).",
    MetricName.AUTOSCALER_ERRORS: "Ticks without a decision or failed rescales, by reason "
    "(metrics, rescale).",
    MetricName.OPERATOR_RECONCILES: "StreamingJob reconciles by result (applied, invalid, error).",
    MetricName.OPERATOR_JOBS: "StreamingJobs the operator manages, by phase.",
    MetricName.CHECKPOINTS: "Checkpoints by result (completed, failed).",
    MetricName.CHECKPOINT_SECONDS: "Seconds the last completed checkpoint took, start to metadata.",
    MetricName.CHECKPOINT_BYTES: "Bytes of the last completed checkpoint: written by it "
    "(incremental) and named by it (full).",
    MetricName.CHECKPOINT_COMPLETED_TIME: "When the last checkpoint completed (Unix seconds; "
    "its age is time() minus this).",
    MetricName.RECOVERIES: "Restarts of the job from a checkpoint after a lost process, over "
    "the job's life (kept with its checkpoints).",
    MetricName.RECOVERY_SECONDS: "Seconds the last recovery took, from the failure noticed to "
    "the job running again.",
    MetricName.RECOVERY_LOCAL: "Instances the last recovery started again alone, the others "
    "rewound in place (1: a local recovery; 0: every process was restarted).",
    MetricName.RPC_UNAUTHENTICATED: "gRPC calls refused because they lacked the job's token, "
    "by service.",
    MetricName.STORAGE_FAILURES: "Failures of storage by use: checkpoint (a keyed instance's "
    "state could not be written), ingest_log (rows refused), output_log (a sink's write to its "
    "log refused, e.g. a full disk: the sink stalls).",
    MetricName.WATERMARK: "This instance's event-time watermark (Unix seconds): a source's "
    "own, a keyed instance's the minimum over its live inputs.",
    MetricName.WATERMARK_LAG: "How far the watermark trails the wall clock, in seconds (at the "
    "last report).",
}


class BatchHistogram(Collector):
    """A Prometheus histogram fed with numpy arrays of observations and weights."""

    def __init__(self, name: str, doc: str, buckets: Sequence[float], labels: dict[str, str]):
        self._name = name
        self._doc = doc
        self._bounds = np.asarray(buckets, dtype=np.float64)
        self._labels = labels
        self._counts = np.zeros(len(buckets) + 1, dtype=np.int64)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe_many(self, values: np.ndarray, weights: np.ndarray | None = None) -> None:
        idx = np.searchsorted(self._bounds, values, side="left")
        counts = np.bincount(idx, weights=weights, minlength=len(self._counts)).astype(np.int64)
        total = float(np.dot(values, weights) if weights is not None else values.sum())
        with self._lock:
            self._counts += counts
            self._sum += total

    def bucket_counts(self) -> list[int]:
        """Non-cumulative counts per bucket, the last one above the highest bound."""
        with self._lock:
            return list(self._counts.tolist())

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self._lock:
            cumulative = np.cumsum(self._counts).tolist()
            total = self._sum
        family = HistogramMetricFamily(self._name, self._doc, labels=list(self._labels))
        bounds = [*(repr(float(b)) for b in self._bounds), "+Inf"]
        family.add_metric(
            list(self._labels.values()), list(zip(bounds, cumulative, strict=True)), total
        )
        yield family


class UnauthenticatedCalls(Collector):
    """Calls this process's gRPC servers refused (no or wrong token), by service. One per
    process (`UNAUTHENTICATED`): the servers start before the process knows its labels, and
    every registry the process serves includes it."""

    def __init__(self) -> None:
        self._counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def refused(self, service: str) -> None:
        with self._lock:
            self._counts[service] += 1

    def count(self, service: str) -> int:
        with self._lock:
            return self._counts[service]

    def collect(self) -> Iterator[CounterMetricFamily]:
        name = MetricName.RPC_UNAUTHENTICATED
        family = CounterMetricFamily(name.removesuffix("_total"), HELP[name], labels=["service"])
        with self._lock:
            for service, value in sorted(self._counts.items()):
                family.add_metric([service], value)
        yield family


UNAUTHENTICATED = UnauthenticatedCalls()


def serve_registry(registry: CollectorRegistry, host: str, port: int) -> int:
    """Serve a registry's /metrics on a thread; return the bound port (0 picks a free one)."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)


def serve_idle(host: str, port: int) -> Callable[[], None]:
    """An empty /metrics on `port` for a process that has no metrics yet (a standby waiting
    in a pod, whose probes ask there); the function returned closes it and frees the port."""
    server, _thread = start_http_server(port, addr=host, registry=CollectorRegistry())

    def close() -> None:
        server.shutdown()
        server.server_close()

    return close


def counter(name: MetricName, labels: Sequence[str], registry: CollectorRegistry) -> Any:
    """A counter family; prometheus_client adds the `_total` our names already carry."""
    return Counter(name.removesuffix("_total"), HELP[name], labels, registry=registry)


def gauge(name: MetricName, labels: Sequence[str], registry: CollectorRegistry) -> Any:
    return Gauge(name, HELP[name], labels, registry=registry)


# A move's counters (keyshift.runtime.migration) by name -> the metric of their unit and its
# `kind` label: one metric per unit, so that no sum mixes bytes with keys.
MIGRATION_KINDS: dict[str, tuple[MetricName, str]] = {
    "groups_in": (MetricName.MIGRATION_KEY_GROUPS, "in"),
    "groups_out": (MetricName.MIGRATION_KEY_GROUPS, "out"),
    "groups_pushed": (MetricName.MIGRATION_KEY_GROUPS, "pushed"),
    # A hand-over from checkpoints: groups pushed as their changes since the checkpoint, or
    # whole (the old owner did not know their changes); keys and bytes a new owner preloaded.
    "groups_changes": (MetricName.MIGRATION_KEY_GROUPS, "changes"),
    "groups_whole": (MetricName.MIGRATION_KEY_GROUPS, "whole"),
    "keys_preloaded": (MetricName.MIGRATION_KEYS, "preloaded"),
    "bytes_preloaded": (MetricName.MIGRATION_BYTES, "preloaded"),
    "keys_in": (MetricName.MIGRATION_KEYS, "in"),
    "keys_out": (MetricName.MIGRATION_KEYS, "out"),
    "keys_fetched": (MetricName.MIGRATION_KEYS, "fetched"),
    "keys_fetched_out": (MetricName.MIGRATION_KEYS, "fetched_out"),
    "bytes_in": (MetricName.MIGRATION_BYTES, "in"),
    "bytes_out": (MetricName.MIGRATION_BYTES, "out"),
    "ms_in": (MetricName.MIGRATION_SECONDS, "in"),
    "ms_out": (MetricName.MIGRATION_SECONDS, "out"),
    "fetch_requests": (MetricName.MIGRATION_FETCHES, "requested"),
    "fetch_retries": (MetricName.MIGRATION_FETCHES, "retried"),
    "fetches": (MetricName.MIGRATION_FETCHES, "served"),
    "records_parked": (MetricName.MIGRATION_RECORDS, "parked"),
    "records_forwarded": (MetricName.MIGRATION_RECORDS, "forwarded"),
}
# Counters kept in another unit than their metric's: a move's durations are whole milliseconds.
MIGRATION_SCALE = {"ms_in": 1e-3, "ms_out": 1e-3}
MIGRATION_METRICS = tuple(dict.fromkeys(metric for metric, _ in MIGRATION_KINDS.values()))


class MigrationStats(collections.Counter[str]):
    """One move's counters (sent to the coordinator when it ends), mirrored to Prometheus:
    each to the metric of its unit (MIGRATION_KINDS)."""

    def __init__(self, families: dict[MetricName, Any], labels: list[str]) -> None:
        super().__init__()
        self._families = families
        self._labels = labels

    def __setitem__(self, kind: str, value: int) -> None:
        metric, label = MIGRATION_KINDS[kind]  # a kind no metric counts is a KeyError
        delta = value - self.get(kind, 0)
        super().__setitem__(kind, value)
        if delta > 0:
            scaled = delta * MIGRATION_SCALE.get(kind, 1)
            self._families[metric].labels(*self._labels, label).inc(scaled)


class InstanceMetrics:
    """The metrics of one process, in their own registry, served on their own port."""

    def __init__(self, job: str, stage: str, instance: str) -> None:
        self.registry = CollectorRegistry()
        self.labels = {JOB_LABEL: job, "stage": stage, INSTANCE_LABEL: instance}
        values = list(self.labels.values())

        def own(name: MetricName) -> Any:
            return gauge(name, LABELS, self.registry).labels(*values)

        self.totals: dict[MetricName, float] = dict.fromkeys(COUNTERS, 0.0)
        self._counters = {
            name: counter(name, LABELS, self.registry).labels(*values) for name in COUNTERS
        }
        self.invalid_counter = counter(
            MetricName.INVALID_RECORDS, (*LABELS, "reason"), self.registry
        )
        self.queue_depth = own(MetricName.QUEUE_DEPTH)
        self.state_keys = own(MetricName.STATE_KEYS)
        self.state_bytes = own(MetricName.STATE_BYTES)
        self.parallelism = own(MetricName.PARALLELISM)
        self.source_target_rate = own(MetricName.SOURCE_TARGET_RATE)
        self.source_backlog = own(MetricName.SOURCE_BACKLOG)
        self.client_backlog = own(MetricName.CLIENT_BACKLOG)
        self.client_backlog_age = own(MetricName.CLIENT_BACKLOG_AGE)
        self._migration = {
            name: counter(name, (*LABELS, "kind"), self.registry) for name in MIGRATION_METRICS
        }
        self.parked_now = own(MetricName.PARKED_NOW)
        self.watermark = own(MetricName.WATERMARK)
        self.watermark_lag = own(MetricName.WATERMARK_LAG)
        self._storage_failures = counter(
            MetricName.STORAGE_FAILURES, (*LABELS, "use"), self.registry
        )
        self.latency = BatchHistogram(
            MetricName.LATENCY, HELP[MetricName.LATENCY], LATENCY_BUCKETS, self.labels
        )
        self.registry.register(self.latency)
        self.registry.register(UNAUTHENTICATED)
        self.invalid_total = 0

    def migration_stats(self) -> MigrationStats:
        """A fresh per-move counter whose increments are also exported."""
        return MigrationStats(self._migration, list(self.labels.values()))

    def count(self, name: MetricName, amount: float) -> None:
        """Add to one of the COUNTERS; `totals` keeps the values for reports."""
        self.totals[name] += amount
        self._counters[name].inc(amount)

    def storage_failed(self, use: str) -> None:
        """Count a failure of storage; `use` is checkpoint, ingest_log or output_log."""
        self._storage_failures.labels(*self.labels.values(), use).inc()

    def invalid(self, reason: str, count: int = 1) -> None:
        self.invalid_counter.labels(*self.labels.values(), reason).inc(count)
        self.invalid_total += count

    def serve(self, host: str, port: int) -> int:
        return serve_registry(self.registry, host, port)


def quantile_from_buckets(counts: Sequence[int], q: float) -> float | None:
    """The q-quantile of non-cumulative bucket counts, interpolated inside its bucket."""
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    bounds = (0.0, *LATENCY_BUCKETS)
    seen = 0
    for i, count in enumerate(counts):
        if seen + count >= rank and count:
            if i >= len(LATENCY_BUCKETS):
                return LATENCY_BUCKETS[-1]
            lo, hi = bounds[i], bounds[i + 1]
            return lo + (hi - lo) * (rank - seen) / count
        seen += count
    return LATENCY_BUCKETS[-1]


PHASES = ("starting", "running", "draining", "finished", "stopping", "failed", "recovering")


# Why a rescale's hand-over from checkpoints fell back to a direct transfer (the metric's label).
HandoverCause = Literal["preload", "changes", "none"]


class CheckpointOutcomeLike(Protocol):
    ok: bool
    seconds: float
    written: int
    full: int
    started: float


class CoordinatorMetrics:
    """The coordinator's view: parallelism per stage and the job's phase."""

    def __init__(self, job: str) -> None:
        self.registry = CollectorRegistry()
        self.job = job
        self._parallelism = gauge(MetricName.JOB_PARALLELISM, (JOB_LABEL, "stage"), self.registry)
        self._phase = gauge(MetricName.JOB_PHASE, (JOB_LABEL, "phase"), self.registry)
        self._rescale_running = gauge(
            MetricName.RESCALE_RUNNING, (JOB_LABEL, "stage"), self.registry
        )
        self._rescales = counter(
            MetricName.RESCALES, (JOB_LABEL, "stage", "strategy", "result"), self.registry
        )
        self._handover_bytes = counter(
            MetricName.HANDOVER_BYTES, (JOB_LABEL, "stage", "kind"), self.registry
        )
        self._handover_fallbacks = counter(
            MetricName.HANDOVER_FALLBACKS, (JOB_LABEL, "stage", "cause"), self.registry
        )
        self._checkpoints = counter(MetricName.CHECKPOINTS, (JOB_LABEL, "result"), self.registry)
        self._checkpoint_seconds = gauge(MetricName.CHECKPOINT_SECONDS, (JOB_LABEL,), self.registry)
        self._checkpoint_bytes = gauge(
            MetricName.CHECKPOINT_BYTES, (JOB_LABEL, "kind"), self.registry
        )
        self._checkpoint_completed = gauge(
            MetricName.CHECKPOINT_COMPLETED_TIME, (JOB_LABEL,), self.registry
        )
        self._recoveries = counter(MetricName.RECOVERIES, (JOB_LABEL,), self.registry)
        self._recovery_seconds = gauge(MetricName.RECOVERY_SECONDS, (JOB_LABEL,), self.registry)
        self._recovery_local = gauge(MetricName.RECOVERY_LOCAL, (JOB_LABEL,), self.registry)
        self._recoveries_counted = 0
        self.registry.register(UNAUTHENTICATED)

    def set_parallelism(self, stage: str, parallelism: int) -> None:
        self._parallelism.labels(self.job, stage).set(parallelism)

    def rescale_started(self, stage: str) -> None:
        self._rescale_running.labels(self.job, stage).set(1)

    def rescale_finished(self, stage: str, strategy: str, result: str) -> None:
        self._rescale_running.labels(self.job, stage).set(0)
        self._rescales.labels(self.job, stage, strategy, result).inc()

    def handover_finished(
        self, stage: str, preloaded: int, switch: int, fallback: HandoverCause | None
    ) -> None:
        """A rescale with hand-over from checkpoints ended: its bytes, and why it fell back."""
        self._handover_bytes.labels(self.job, stage, "preloaded").inc(preloaded)
        self._handover_bytes.labels(self.job, stage, "switch").inc(switch)
        if fallback is not None:
            self._handover_fallbacks.labels(self.job, stage, fallback).inc()

    def checkpoint_ended(self, outcome: CheckpointOutcomeLike) -> None:
        self._checkpoints.labels(self.job, "completed" if outcome.ok else "failed").inc()
        if outcome.ok:
            self._checkpoint_seconds.labels(self.job).set(outcome.seconds)
            self._checkpoint_bytes.labels(self.job, "incremental").set(outcome.written)
            self._checkpoint_bytes.labels(self.job, "full").set(outcome.full)
            self._checkpoint_completed.labels(self.job).set(outcome.started + outcome.seconds)

    def recovered(self, total: int, last_seconds: float | None, local: bool = False) -> None:
        """The job's recoveries so far (the counter only goes up to `total`), and whether the
        last one was local."""
        self._recoveries.labels(self.job).inc(max(total - self._recoveries_counted, 0))
        self._recoveries_counted = max(total, self._recoveries_counted)
        if last_seconds is not None:
            self._recovery_seconds.labels(self.job).set(last_seconds)
            self._recovery_local.labels(self.job).set(1 if local else 0)

    def set_phase(self, phase: str) -> None:
        for name in PHASES:
            self._phase.labels(self.job, name).set(1 if name == phase else 0)

    def serve(self, host: str, port: int) -> int:
        return serve_registry(self.registry, host, port)


class AutoscalerMetrics:
    """The autoscaling loop's view, served by whichever host runs the loop. The Kubernetes
    operator runs the loops of all its StreamingJobs, so their series carry the job's namespace
    too (empty, hence no label, for a local run)."""

    def __init__(self, job: str, namespace: str = "") -> None:
        self.registry = CollectorRegistry()
        self.owner = [namespace, job]
        owner = (NAMESPACE_LABEL, JOB_LABEL)
        self._current = gauge(MetricName.AUTOSCALER_PARALLELISM, (*owner, "stage"), self.registry)
        self._recommended = gauge(
            MetricName.AUTOSCALER_RECOMMENDED, (*owner, "stage"), self.registry
        )
        self._decisions = counter(
            MetricName.AUTOSCALER_DECISIONS, (*owner, "stage", "action"), self.registry
        )
        self._errors = counter(MetricName.AUTOSCALER_ERRORS, (*owner, "reason"), self.registry)

    def decided(self, stage: str, current: int, recommended: int, action: str) -> None:
        self._current.labels(*self.owner, stage).set(current)
        self._recommended.labels(*self.owner, stage).set(recommended)
        self._decisions.labels(*self.owner, stage, action).inc()

    def error(self, reason: str) -> None:
        self._errors.labels(*self.owner, reason).inc()

    def serve(self, host: str, port: int) -> int:
        return serve_registry(self.registry, host, port)


JOB_PHASES = ("Pending", "Running", "Rescaling", "Degraded", "Failed", "Finished")


class OperatorMetrics:
    """The Kubernetes operator's own view: reconciles and the jobs it manages."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._reconciles = counter(
            MetricName.OPERATOR_RECONCILES, (NAMESPACE_LABEL, JOB_LABEL, "result"), self.registry
        )
        self._jobs = gauge(
            MetricName.OPERATOR_JOBS, (NAMESPACE_LABEL, JOB_LABEL, "phase"), self.registry
        )

    def reconciled(self, namespace: str, job: str, result: str) -> None:
        self._reconciles.labels(namespace, job, result).inc()

    def phase(self, namespace: str, job: str, phase: str) -> None:
        for name in JOB_PHASES:
            self._jobs.labels(namespace, job, name).set(1 if name == phase else 0)

    def forget(self, namespace: str, job: str) -> None:
        """A deleted job's series go away."""
        for name in JOB_PHASES:
            with contextlib.suppress(KeyError):
                self._jobs.remove(namespace, job, name)
