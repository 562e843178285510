"""MetricsSources for the autoscaling loop: a Prometheus server, or the instances scraped directly.

Both read the same series (records in/out, busy seconds, a source's offered rate, its backlog
and the backlog its clients report),
per stage and instance, and assemble them into the policies' `ScalingInput` over the stages of
the job graph. Which instances count comes from the coordinator's status (`members_of`), so a
retired instance's last samples are never mistaken for capacity. Wired by the local host
(`keyshift.operator.local_scaling`); the Kubernetes operator uses `PrometheusSource`.
"""

from __future__ import annotations

import http.client
import itertools
import math
import threading
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import requests
from prometheus_api_client import PrometheusConnect
from prometheus_api_client.exceptions import PrometheusApiClientException
from prometheus_client.parser import text_string_to_metric_families
from requests import RequestException
from urllib3.util.retry import Retry

from keyshift.operator.autoscaler import Clock, MetricsUnavailable
from keyshift.policies.model import InstanceRates, ScalingInput, StageRates
from keyshift.runtime.job import JobSpec
from keyshift.runtime.metrics import INSTANCE_LABEL, JOB_LABEL, MetricName

COUNTERS = (MetricName.RECORDS_IN, MetricName.RECORDS_OUT, MetricName.BUSY_SECONDS)
GAUGES = (MetricName.SOURCE_TARGET_RATE, MetricName.SOURCE_BACKLOG, MetricName.CLIENT_BACKLOG)

# stage -> {instance label -> metrics address (host:port)}
Members = Mapping[str, Mapping[str, str]]
# (stage name, the stages whose instances send it records) in topological order
Graph = list[tuple[str, tuple[str, ...]]]
# (stage, instance) -> series name -> value (a rate for counters, the last value for gauges)
Series = dict[tuple[str, str], dict[str, float]]


def job_graph(spec: JobSpec) -> Graph:
    """The stages of processes the job runs, each after its inputs: the sources, every keyed
    stage (its inputs: sources or keyed stages) and the sink (the keyed stages feeding it)."""
    return [
        *((step.stage.name, ()) for step in spec.source_steps()),
        *((step.stage.name, step.inputs) for step in spec.keyed_stages()),
        (spec.sink.name, spec.sink_inputs()),
    ]


def shares(graph: Graph, records_in: Mapping[str, float], records_out: Mapping[str, float]
           ) -> dict[str, dict[str, float]]:  # fmt: skip
    """For each stage, the share of each input's output it receives (DS2's edge weights).

    A stage's output counts the records it sent on every route (after each route's filters), and
    per-edge counts are not exported. So an input that feeds only this stage sends it all of its
    output (1.0); what the stage takes in beyond those inputs' output came from the inputs it
    shares with other stages, and each is given that remainder over their output (exact with
    one shared input; split by output between several; an even split while nothing flows)."""
    consumers: dict[str, int] = {}
    for _, inputs in graph:
        for upstream in inputs:
            consumers[upstream] = consumers.get(upstream, 0) + 1
    result: dict[str, dict[str, float]] = {}
    for name, inputs in graph:
        weights = {u: 1.0 for u in inputs if consumers[u] == 1}
        shared = [u for u in inputs if consumers[u] > 1]
        sent = sum(records_out.get(u, 0.0) for u in shared)
        rest = max(records_in.get(name, 0.0) - sum(records_out.get(u, 0.0) for u in weights), 0.0)
        for upstream in shared:
            weights[upstream] = rest / sent if sent > 0 else 1.0 / consumers[upstream]
        result[name] = {u: weights[u] for u in inputs}
    return result


def members_of(status: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """The live instances per stage in a coordinator status: retiring ones do not count."""
    return {
        stage["name"]: {
            str(i["index"]): i["metrics"]
            for i in stage["instances"]
            if not i["retiring"] and not i["finished"] and i["metrics"]
        }
        for stage in status["stages"]
    }


def assemble(
    graph: Graph, members: Members, series: Series, now: float, window: float
) -> ScalingInput:
    """A ScalingInput from per-instance series; raises MetricsUnavailable for a missing one."""
    stages = []
    for name, inputs in graph:
        instances = []
        offered = backlog = client_backlog = 0.0
        for label in sorted(members.get(name, {}), key=_numeric):
            values = series.get((name, label))
            if values is None or any(c not in values for c in COUNTERS):
                raise MetricsUnavailable(f"no samples yet for {name}/{label}")
            busy = values[MetricName.BUSY_SECONDS]
            instances.append(
                InstanceRates(values[MetricName.RECORDS_IN], values[MetricName.RECORDS_OUT], busy)
            )
            offered += values.get(MetricName.SOURCE_TARGET_RATE, 0.0)
            backlog += values.get(MetricName.SOURCE_BACKLOG, 0.0)
            client_backlog += values.get(MetricName.CLIENT_BACKLOG, 0.0)
        if not instances:
            raise MetricsUnavailable(f"stage {name} has no live instances")
        source = not inputs
        stages.append(
            StageRates(
                name=name,
                parallelism=len(instances),
                instances=tuple(instances),
                # A generator's profile says what arrives; without one, what it emits is all.
                offered=offered if source and (offered > 0 or math.isnan(offered)) else None,
                backlog=backlog if source else 0.0,
                client_backlog=client_backlog if source else 0.0,
            )
        )
    weights = shares(
        graph, {s.name: s.records_in for s in stages}, {s.name: s.records_out for s in stages}
    )
    stages = [replace(s, upstream=weights[s.name]) for s in stages]
    return ScalingInput(now=now, window=window, stages=tuple(stages))


def _numeric(label: str) -> tuple[int, str]:
    return (int(label), label) if label.isdigit() else (1 << 30, label)


class PrometheusSource:
    """Rates from a Prometheus server that scrapes the job, selected by the `keyshift_job` and
    `keyshift_instance` labels the instances give their series (and `namespace`, the target
    label Prometheus' Kubernetes discovery adds, when the job runs in one)."""

    def __init__(
        self,
        url: str,
        job: str,
        graph: Graph,
        members: Callable[[], Members],
        timeout: int = 5,
        namespace: str = "",
        ca_bundle: str | None = None,
    ) -> None:
        """An https `url`'s certificate is verified: against `ca_bundle` (a PEM file) if given,
        else the system's CAs or the file named by REQUESTS_CA_BUNDLE."""
        self.url = url
        self.job = job
        self.namespace = namespace
        self.graph = graph
        self.members = members
        self.timeout = timeout
        # One quick retry at most: a tick that waits out a long back-off only delays the next.
        retry = Retry(total=1, backoff_factor=0.1, status_forcelist=(502, 503, 504))
        session = requests.Session()
        session.verify = ca_bundle or True
        self._client = PrometheusConnect(url=url, retry=retry, timeout=timeout, session=session)

    def collect(self, window: float, now: float) -> ScalingInput:
        matchers = [f'{JOB_LABEL}="{self.job}"']
        if self.namespace:
            matchers.append(f'namespace="{self.namespace}"')
        selector = "{" + ", ".join(matchers) + "}"
        span = f"[{max(round(window), 2)}s]"
        per = f"stage, {INSTANCE_LABEL}"
        series: Series = {}
        for name in COUNTERS:
            self._query(f"sum by ({per}) (rate({name}{selector}{span}))", name, now, series)
        for name in GAUGES:
            self._query(f"sum by ({per}) ({name}{selector})", name, now, series)
        return assemble(self.graph, self.members(), series, now, window)

    def _query(self, query: str, name: str, now: float, series: Series) -> None:
        try:
            result = self._client.custom_query(
                query, params={"time": now, "timeout": f"{self.timeout}s"}
            )
        except (RequestException, PrometheusApiClientException, ValueError) as exc:
            raise MetricsUnavailable(f"Prometheus at {self.url} failed: {exc}") from None
        if not result and name in COUNTERS:
            raise MetricsUnavailable(f"Prometheus has no {name} for job {self.job} yet")
        for item in result:
            labels = item["metric"]
            key = (labels.get("stage", ""), labels.get(INSTANCE_LABEL, ""))
            series.setdefault(key, {})[name] = float(item["value"][1])


class ScrapeSource:
    """The embedded default: scrapes every live instance's /metrics each `interval` seconds on
    a thread of its own, keeps `keep` seconds of samples, and computes rates from them as
    Prometheus' rate() would (counter resets included)."""

    def __init__(
        self,
        graph: Graph,
        members: Callable[[], Members],
        clock: Clock,
        interval: float = 1.0,
        keep: float = 120.0,
        timeout: float = 2.0,
    ) -> None:
        self.graph = graph
        self.members = members
        self.clock = clock
        self.interval = interval
        self.keep = keep
        self.timeout = timeout
        self._history: dict[tuple[str, str], deque[tuple[float, dict[str, float]]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> ScrapeSource:
        self._thread = threading.Thread(target=self._run, name="scrape", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timeout + 1.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.scrape_once()
            self._stop.wait(self.interval)

    def scrape_once(self) -> None:
        members = self.members()
        live = {(stage, label) for stage, group in members.items() for label in group}
        for stage, group in members.items():
            for label, address in group.items():
                values = _scrape(address, self.timeout)
                if values is None:
                    continue  # an instance that just left or is not serving yet
                now = self.clock.now()
                with self._lock:
                    history = self._history.setdefault((stage, label), deque())
                    history.append((now, values))
                    while history and history[0][0] < now - self.keep:
                        history.popleft()
        with self._lock:
            for key in set(self._history) - live:
                del self._history[key]

    def collect(self, window: float, now: float) -> ScalingInput:
        series: Series = {}
        with self._lock:
            for key, history in self._history.items():
                samples = [(t, v) for t, v in history if now - window <= t <= now]
                if len(samples) < 2:
                    continue
                values: dict[str, float] = {name: _rate(samples, name) for name in COUNTERS}
                values.update(
                    {name: samples[-1][1][name] for name in GAUGES if name in samples[-1][1]}
                )
                series[key] = values
        return assemble(self.graph, self.members(), series, now, window)


def _rate(samples: list[tuple[float, dict[str, float]]], name: str) -> float:
    increase = 0.0
    for (_, before), (_, after) in itertools.pairwise(samples):
        a, b = before.get(name, 0.0), after.get(name, 0.0)
        increase += b - a if b >= a else b  # a restart begins counting from zero
    return increase / (samples[-1][0] - samples[0][0])


def _scrape(address: str, timeout: float) -> dict[str, float] | None:
    """An instance's counters and gauges, or None when what answers at `address` is not (or not
    yet, or no longer) its metrics endpoint: a retired instance's port may already be another
    process's gRPC port, whose bytes are no HTTP reply, and one such answer must not end the
    scraping thread."""
    wanted = {*COUNTERS, *GAUGES}
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as reply:
            text = reply.read().decode()
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted:
                    values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError):
        return None
    return values


def metrics_source(
    job: JobSpec,
    prometheus_url: str | None,
    status: Callable[[], Mapping[str, Any]],
    clock: Clock,
    namespace: str = "",
) -> tuple[PrometheusSource | ScrapeSource, ScrapeSource | None]:
    """The source a job's settings ask for: Prometheus when they name one (its series selected
    by the job's name and, on Kubernetes, its `namespace`), else scraping the live instances
    found in the coordinator's `status` (started here; the caller closes it)."""

    def members() -> Members:
        return members_of(status())

    graph = job_graph(job)
    if prometheus_url:
        return PrometheusSource(prometheus_url, job.name, graph, members, namespace=namespace), None
    scrape = ScrapeSource(graph, members, clock).start()
    return scrape, scrape
