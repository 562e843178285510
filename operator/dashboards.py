"""keyshift's Grafana dashboards, built in code next to the metric names they query.

Three dashboards (Grafana dashboard JSON, schemaVersion 39, in each a `${datasource}` Prometheus
variable and a `$namespace` one every query filters by): the job overview (rates, busy ratio, DS2's
true processing rate against the target rate, parallelism current and recommended, latency,
backpressure, state, backlog and the clients' backlog, with the autoscaler's decisions and the
rescales as annotations), the migration view (what a live rescale moves, on-demand fetches, parked
records, latency during the move) and the operator view (reconciles, jobs by phase, autoscaler
decisions and errors). Every PromQL string is built from `keyshift.runtime.metrics.MetricName` and
its label names, so a dashboard cannot name a metric the runtime does not define.

`keyshift dashboards` (keyshift.operator.cli) writes them to helm/keyshift/dashboards/, which the
Helm chart ships as ConfigMaps for Grafana's dashboard sidecar; `--check` (and
tests/test_dashboards.py) fails when the checked-in JSON is stale. `queries` lists every
expression of a dashboard with where it lives; the test evaluates each against a real Prometheus
scraping a running job.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from keyshift.runtime.metrics import INSTANCE_LABEL, JOB_LABEL, NAMESPACE_LABEL, MetricName

Json = dict[str, Any]

DASHBOARD_DIR = Path("helm/keyshift/dashboards")
SCHEMA_VERSION = 39
TAGS = ["keyshift"]
DATASOURCE: Json = {"type": "prometheus", "uid": "${datasource}"}

# Grafana substitutes these before the query reaches Prometheus.
RATE = "$__rate_interval"
# How far back an annotation or a "per minute" panel counts events.
EVENT_WINDOW = "1m"

# Every query names the namespace. A job's own series have it as the target label Prometheus'
# Kubernetes discovery adds (`namespace`; none in a local run, which the variable's "All", `.*`,
# matches); the series the operator exports per StreamingJob (its autoscalers', its own) come
# from the operator's pod, so they name the job's namespace in their own label.
NAMESPACE = 'namespace=~"$namespace"'
OWNER_NAMESPACE = f'{NAMESPACE_LABEL}=~"$namespace"'
JOB = f'{NAMESPACE}, {JOB_LABEL}="$job"'
AUTOSCALED_JOB = f'{OWNER_NAMESPACE}, {JOB_LABEL}="$job"'
OPERATED_JOBS = f'{OWNER_NAMESPACE}, {JOB_LABEL}=~"$job"'
STAGE = 'stage=~"$stage"'
# A regex (anchored, as PromQL's are): a job of several sources is shown as `clicks|views`.
SOURCE = 'stage=~"$source"'
INSTANCE = INSTANCE_LABEL


# --- PromQL -------------------------------------------------------------------------------


def series(name: MetricName | str, *matchers: str) -> str:
    """A series selector, e.g. keyshift_records_in_total{job="$job"}."""
    return f"{name}{{{', '.join(matchers)}}}" if matchers else str(name)


def bucket(name: MetricName) -> str:
    """A histogram's bucket series name."""
    return f"{name}_bucket"


def rate(name: MetricName | str, *matchers: str) -> str:
    return f"rate({series(name, *matchers)}[{RATE}])"


def by(aggregation: str, labels: str, expr: str) -> str:
    return f"{aggregation} by ({labels}) ({expr})" if labels else f"{aggregation}({expr})"


def latency_quantile(q: float, *matchers: str) -> str:
    """The q-quantile of end-to-end latency over all sinks of the selection."""
    return f"histogram_quantile({q}, sum by (le) ({rate(bucket(MetricName.LATENCY), *matchers)}))"


def latency_quantile_by_sink(q: float, *matchers: str) -> str:
    """The q-quantile of end-to-end latency of each sink of the selection, one series per
    sink (only sinks observe the histogram: the other stages' quantiles are NaN, which the
    comparison drops)."""
    buckets = rate(bucket(MetricName.LATENCY), *matchers)
    return f"histogram_quantile({q}, sum by (le, stage) ({buckets})) >= 0"


def recent(name: MetricName, *matchers: str, window: str = EVENT_WINDOW) -> str:
    """How much a counter grew in the last `window`, counting a series born in it from 0.

    `increase()` and `changes()` need the counter's previous value: a series that appears with
    its first increment (a labelled counter such as the first `scale_up` decision, or the first
    rescale) shows no change to them, so an annotation built on them misses first events.
    """
    now = series(name, *matchers)
    return f"({now} - ({now} offset {window} or {now} * 0))"


# --- panels -------------------------------------------------------------------------------


def target(expr: str, legend: str, ref: str = "A") -> Json:
    return {
        "datasource": DATASOURCE,
        "editorMode": "code",
        "expr": expr,
        "legendFormat": legend,
        "range": True,
        "refId": ref,
    }


def _targets(queries: Sequence[tuple[str, str]]) -> list[Json]:
    return [target(expr, legend, chr(ord("A") + i)) for i, (expr, legend) in enumerate(queries)]


def timeseries(
    title: str,
    description: str,
    queries: Sequence[tuple[str, str]],
    unit: str,
    *,
    width: int = 12,
    height: int = 8,
    axis_label: str = "",
    decimals: int | None = None,
    minimum: float | None = 0,
    maximum: float | None = None,
    step: bool = False,
    overrides: Sequence[Json] = (),
) -> Json:
    """A time series panel; `queries` are (PromQL, legend) pairs."""
    defaults: Json = {
        "unit": unit,
        "color": {"mode": "palette-classic"},
        "custom": {
            "axisLabel": axis_label,
            "drawStyle": "line",
            "fillOpacity": 10,
            "lineInterpolation": "stepAfter" if step else "smooth",
            "lineWidth": 2,
            "showPoints": "never",
            "spanNulls": False,
        },
    }
    if decimals is not None:
        defaults["decimals"] = decimals
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {"h": height, "w": width, "x": 0, "y": 0},
        "fieldConfig": {"defaults": defaults, "overrides": list(overrides)},
        "options": {
            "legend": {
                "calcs": [],
                "displayMode": "list",
                "placement": "bottom",
                "showLegend": True,
            },
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": _targets(queries),
    }


def stat(
    title: str,
    description: str,
    queries: Sequence[tuple[str, str]],
    unit: str,
    *,
    width: int = 4,
    height: int = 4,
    decimals: int | None = None,
    text_mode: str = "auto",
    no_value: str | None = None,
) -> Json:
    """A single-value panel showing each query's last value."""
    defaults: Json = {
        "unit": unit,
        "color": {"mode": "thresholds"},
        "thresholds": {"mode": "absolute", "steps": [{"color": "green", "value": None}]},
    }
    if decimals is not None:
        defaults["decimals"] = decimals
    if no_value is not None:
        defaults["noValue"] = no_value
    return {
        "type": "stat",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {"h": height, "w": width, "x": 0, "y": 0},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {
            "colorMode": "value",
            "graphMode": "area",
            "justifyMode": "auto",
            "orientation": "auto",
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "textMode": text_mode,
        },
        "targets": _targets(queries),
    }


def right_axis(ref: str, unit: str) -> Json:
    """A field override: the series of query `ref` on a right-hand axis with its own unit."""
    return {
        "matcher": {"id": "byFrameRefID", "options": ref},
        "properties": [
            {"id": "unit", "value": unit},
            {"id": "custom.axisPlacement", "value": "right"},
        ],
    }


def layout(sections: Sequence[tuple[str, Sequence[Json]]]) -> list[Json]:
    """Rows of panels, each panel placed left to right by its width; ids in order."""
    panels: list[Json] = []
    y = 0
    for title, members in sections:
        panels.append(
            {
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        y += 1
        x, line_height = 0, 0
        for panel in members:
            grid = panel["gridPos"]
            if x + grid["w"] > 24:
                x, y, line_height = 0, y + line_height, 0
            grid["x"], grid["y"] = x, y
            x += grid["w"]
            line_height = max(line_height, grid["h"])
            panels.append(panel)
        y += line_height
    for number, panel in enumerate(panels, start=1):
        panel["id"] = number
    return panels


# --- variables and annotations ------------------------------------------------------------


def datasource_variable() -> Json:
    return {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "includeAll": False,
        "multi": False,
        "options": [],
        "refresh": 1,
        "regex": "",
    }


def query_variable(
    name: str, label: str, definition: str, *, multi: bool = False, include_all: bool = False
) -> Json:
    """A variable filled by `label_values(...)` from Prometheus."""
    variable: Json = {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "definition": definition,
        "query": definition,
        "current": {},
        "hide": 0,
        "includeAll": include_all,
        "multi": multi,
        "options": [],
        "refresh": 2,
        "regex": "",
        "sort": 1,
    }
    if include_all:
        variable["allValue"] = ".*"
    return variable


def textbox_variable(name: str, label: str, default: str) -> Json:
    return {
        "name": name,
        "label": label,
        "type": "textbox",
        "query": default,
        "current": {"selected": False, "text": default, "value": default},
        "hide": 0,
        "options": [{"selected": True, "text": default, "value": default}],
    }


def label_values(name: MetricName, label: str, *matchers: str) -> str:
    return f"label_values({series(name, *matchers)}, {label})"


def job_variables(*, source: bool = True) -> list[Json]:
    """datasource, namespace, job and stage (every stage, or some); `source`: the source
    stage's name, which no metric tells apart from the others (a job file's default is
    `source`)."""
    variables = [
        datasource_variable(),
        query_variable(
            "namespace",
            "Namespace",
            label_values(MetricName.RECORDS_IN, "namespace"),
            multi=True,
            include_all=True,
        ),
        query_variable("job", "Job", label_values(MetricName.RECORDS_IN, JOB_LABEL, NAMESPACE)),
        query_variable(
            "stage",
            "Stage",
            label_values(MetricName.RECORDS_IN, "stage", JOB),
            multi=True,
            include_all=True,
        ),
    ]
    if source:
        variables.append(textbox_variable("source", "Source stages (a|b)", "source"))
    return variables


def annotation(name: str, expr: str, color: str, title: str, tags: str) -> Json:
    """A Prometheus-query annotation: a marker wherever `expr` has a value."""
    return {
        "name": name,
        "datasource": DATASOURCE,
        "enable": True,
        "expr": expr,
        "iconColor": color,
        "step": EVENT_WINDOW,
        "tagKeys": tags,
        "titleFormat": title,
        "textFormat": "",
        "useValueForTime": False,
    }


def builtin_annotation() -> Json:
    return {
        "builtIn": 1,
        "datasource": {"type": "grafana", "uid": "-- Grafana --"},
        "enable": True,
        "hide": True,
        "iconColor": "rgba(0, 211, 255, 1)",
        "name": "Annotations & Alerts",
        "type": "dashboard",
    }


def job_annotations() -> list[Json]:
    """The autoscaler's rescale decisions and the rescales that finished."""
    decisions = recent(MetricName.AUTOSCALER_DECISIONS, AUTOSCALED_JOB, 'action!="hold"')
    rescales = recent(MetricName.RESCALES, JOB)
    return [
        builtin_annotation(),
        annotation(
            "Rescale decisions",
            f"sum by (stage, action) ({decisions}) > 0",
            "orange",
            "autoscaler: {{action}} {{stage}}",
            "stage,action",
        ),
        annotation(
            "Rescales",
            f"sum by (stage, strategy, result) ({rescales}) > 0",
            "purple",
            "rescale of {{stage}} {{result}} ({{strategy}})",
            "stage,strategy,result",
        ),
    ]


def dashboard(
    uid: str,
    title: str,
    description: str,
    variables: list[Json],
    panels: list[Json],
    annotations: list[Json] | None = None,
) -> Json:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": TAGS,
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "fiscalYearStartMonth": 0,
        "id": None,
        "liveNow": False,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "weekStart": "",
        "links": [
            {
                "asDropdown": False,
                "icon": "external link",
                "includeVars": True,
                "keepTime": True,
                "tags": TAGS,
                "targetBlank": False,
                "title": "keyshift",
                "type": "dashboards",
            }
        ],
        "templating": {"list": variables},
        "annotations": {"list": annotations or [builtin_annotation()]},
        "panels": panels,
    }


# --- the dashboards -----------------------------------------------------------------------

M = MetricName


def overview_dashboard() -> Json:
    """The job overview: is it keeping up, at what parallelism, at what latency."""
    source_out = by("sum", "", rate(M.RECORDS_OUT, JOB, SOURCE))
    target_rate = by("sum", "", series(M.SOURCE_TARGET_RATE, JOB, SOURCE))
    busy_rate = f"({rate(M.BUSY_SECONDS, JOB, STAGE)} > 0)"
    true_rate = f"{rate(M.RECORDS_IN, JOB, STAGE)} / {busy_rate}"
    summary = [
        stat(
            "Input rate",
            "Records per second the sources emit.",
            [(source_out, "input")],
            "recps",
        ),
        stat(
            "Target rate",
            "Records per second the sources' load profiles ask for (the offered load).",
            [(target_rate, "target")],
            "recps",
        ),
        stat(
            "Latency p99",
            "99th percentile of end-to-end latency (ingest to sink) over the rate interval.",
            [(latency_quantile(0.99, JOB), "p99")],
            "s",
        ),
        stat(
            "Source backlog",
            "Records that arrived (or fell due) but the sources have not taken in yet.",
            [(by("sum", "", series(M.SOURCE_BACKLOG, JOB, SOURCE)), "backlog")],
            "short",
        ),
        stat(
            "Instances",
            "Instances of each stage, as the coordinator assigns them.",
            [(by("max", "stage", series(M.JOB_PARALLELISM, JOB, STAGE)), "{{stage}}")],
            "none",
            decimals=0,
        ),
        stat(
            "Job phase",
            "The job's phase, as the coordinator reports it.",
            [(f"{series(M.JOB_PHASE, JOB)} == 1", "{{phase}}")],
            "none",
            text_mode="name",
        ),
    ]
    throughput = [
        timeseries(
            "Input rate vs target rate",
            "What the sources emit against what their load profiles offer; a gap means the "
            "job does not keep up (backlog grows).",
            [(source_out, "input (records out of $source)"), (target_rate, "target rate")],
            "recps",
        ),
        timeseries(
            "Throughput by stage",
            "Records in per second, per stage.",
            [(by("sum", "stage", rate(M.RECORDS_IN, JOB, STAGE)), "{{stage}}")],
            "recps",
        ),
        timeseries(
            "Busy ratio by stage",
            "Fraction of time instances spend processing records (DS2's useful time): the "
            "stage's busy seconds per second over its instances (mean), and the busiest one.",
            [
                (by("avg", "stage", rate(M.BUSY_SECONDS, JOB, STAGE)), "{{stage}} mean"),
                (by("max", "stage", rate(M.BUSY_SECONDS, JOB, STAGE)), "{{stage}} busiest"),
            ],
            "percentunit",
            maximum=1,
        ),
        timeseries(
            "True processing rate per instance vs target rate",
            "DS2's true processing rate: records in per second of busy time, per instance (what "
            "one instance could do at 100% busy); against the sources' target rate. A stage "
            "needs about target / (true rate x target utilization) instances.",
            [
                (
                    by("sum", f"stage, {INSTANCE}", true_rate),
                    f"{{{{stage}}}}/{{{{{INSTANCE}}}}} true rate",
                ),
                (target_rate, "target rate"),
            ],
            "recps",
        ),
    ]
    scaling = [
        timeseries(
            "Parallelism: current vs recommended",
            "Instances per stage as the coordinator assigns them, as the autoscaler last saw "
            "them, and what its policy recommends (before the guards).",
            [
                (by("max", "stage", series(M.JOB_PARALLELISM, JOB, STAGE)), "{{stage}} current"),
                (
                    by("max", "stage", series(M.AUTOSCALER_PARALLELISM, AUTOSCALED_JOB, STAGE)),
                    "{{stage}} seen by the autoscaler",
                ),
                (
                    by("max", "stage", series(M.AUTOSCALER_RECOMMENDED, AUTOSCALED_JOB, STAGE)),
                    "{{stage}} recommended",
                ),
            ],
            "none",
            decimals=0,
            step=True,
        ),
        timeseries(
            "End-to-end latency",
            "Ingest-to-sink latency of records, p50 and p99 over the rate interval, over all "
            "sinks, and p99 per sink (a job may have several).",
            [
                (latency_quantile(0.5, JOB), "p50"),
                (latency_quantile(0.99, JOB), "p99"),
                (latency_quantile_by_sink(0.99, JOB), "{{stage}} p99"),
            ],
            "s",
        ),
        timeseries(
            "Backpressure by stage",
            "Fraction of time instances wait for downstream credit (mean per stage).",
            [(by("avg", "stage", rate(M.BACKPRESSURED_SECONDS, JOB, STAGE)), "{{stage}}")],
            "percentunit",
            maximum=1,
        ),
        timeseries(
            "Input queue depth",
            "Batches waiting in the instances' input queues (the deepest one per stage).",
            [(by("max", "stage", series(M.QUEUE_DEPTH, JOB, STAGE)), "{{stage}}")],
            "short",
        ),
        timeseries(
            "Watermark lag",
            "How far each stage's event-time watermark trails the wall clock (the furthest "
            "behind instance per stage), and the watermark itself (right axis); only stages of "
            "a job whose source has event_time settings have one.",
            [
                (by("max", "stage", series(M.WATERMARK_LAG, JOB, STAGE)), "{{stage}} lag"),
                # Grafana reads a date in milliseconds.
                (
                    f"1000 * {by('min', 'stage', series(M.WATERMARK, JOB, STAGE))}",
                    "{{stage}} watermark",
                ),
            ],
            "s",
            overrides=[right_axis("B", "dateTimeAsIso")],
        ),
    ]
    state = [
        timeseries(
            "State size",
            "Keys and estimated bytes of keyed state, per stage.",
            [
                (by("sum", "stage", series(M.STATE_KEYS, JOB, STAGE)), "{{stage}} keys"),
                (by("sum", "stage", series(M.STATE_BYTES, JOB, STAGE)), "{{stage}} bytes"),
            ],
            "short",
            overrides=[right_axis("B", "bytes")],
        ),
        timeseries(
            "Source backlog by instance",
            "Records that arrived (or fell due) but a source instance has not taken in yet.",
            [
                (
                    by("sum", INSTANCE, series(M.SOURCE_BACKLOG, JOB, SOURCE)),
                    f"$source/{{{{{INSTANCE}}}}}",
                )
            ],
            "short",
        ),
        timeseries(
            "Clients' backlog",
            "Records the ingest sources' clients report due but not pushed yet (outside the "
            "job; DS2 adds them over client_catch_up to the target rate), and how long ago the "
            "oldest of them fell due.",
            [
                (by("sum", "", series(M.CLIENT_BACKLOG, JOB, SOURCE)), "records"),
                (by("max", "", series(M.CLIENT_BACKLOG_AGE, JOB, SOURCE)), "oldest (age)"),
            ],
            "short",
            overrides=[right_axis("B", "s")],
        ),
        timeseries(
            "Invalid records",
            "Records rejected because they do not fit the job's schema, by reason.",
            [
                (
                    by("sum", "stage, reason", rate(M.INVALID_RECORDS, JOB, STAGE)),
                    "{{stage}}: {{reason}}",
                )
            ],
            "recps",
        ),
        timeseries(
            "Late records",
            "Rows of event-time windows (one per record and window) that came after the "
            "watermark passed their window's end plus the allowed lateness: not applied, "
            "written to the job's late-records log if it names one.",
            [(by("sum", "stage", rate(M.LATE_RECORDS, JOB, STAGE)), "{{stage}}")],
            "recps",
        ),
    ]
    return dashboard(
        "keyshift-overview",
        "keyshift / Job overview",
        "Is the job keeping up, at what parallelism and latency; the autoscaler's decisions and "
        "the rescales are annotations.",
        job_variables(),
        layout(
            [
                ("Summary", summary),
                ("Throughput", throughput),
                ("Scaling and latency", scaling),
                ("State and input", state),
            ]
        ),
        job_annotations(),
    )


def migration_dashboard() -> Json:
    """What live rescales move and what they cost while they run."""
    moved = by("sum", "kind", series(M.MIGRATION_KEY_GROUPS, JOB, STAGE))
    panels = [
        stat(
            "Rescale in progress",
            "1 while a rescale of a selected stage runs.",
            [(by("max", "", series(M.RESCALE_RUNNING, JOB, STAGE)), "running")],
            "none",
            decimals=0,
        ),
        stat(
            "Rescales done",
            "Rescales that finished, by strategy.",
            [
                (
                    by("sum", "strategy", series(M.RESCALES, JOB, STAGE, 'result="done"')),
                    "{{strategy}}",
                )
            ],
            "none",
            decimals=0,
        ),
        stat(
            "Rescales failed",
            "Rescales that failed (an instance died mid-move); none is shown as 0.",
            [(by("sum", "", series(M.RESCALES, JOB, STAGE, 'result="failed"')), "failed")],
            "none",
            decimals=0,
            no_value="0",
        ),
        stat(
            "Records parked now",
            "Records waiting at their new owner for their key's state, summed over instances.",
            [(by("sum", "", series(M.PARKED_NOW, JOB, STAGE)), "parked")],
            "short",
        ),
    ]
    moves = [
        timeseries(
            "Key groups moved",
            "Key groups moved in and out (and pushed in the background), cumulative per live "
            "instance: each rescale is a step.",
            [(moved, "{{kind}}")],
            "short",
            step=True,
        ),
        timeseries(
            "Keys moved",
            "Keys whose state moved in and out (in bulk, and fetched on demand), cumulative per "
            "live instance.",
            [(by("sum", "kind", series(M.MIGRATION_KEYS, JOB, STAGE)), "{{kind}}")],
            "short",
            step=True,
        ),
        timeseries(
            "Bytes moved",
            "Bytes of state moved in and out, cumulative (left), and the move's throughput "
            "(right).",
            [
                (by("sum", "kind", series(M.MIGRATION_BYTES, JOB, STAGE)), "{{kind}}"),
                (by("sum", "kind", rate(M.MIGRATION_BYTES, JOB, STAGE)), "{{kind}} per second"),
            ],
            "bytes",
            overrides=[right_axis("B", "Bps")],
        ),
        timeseries(
            "Transfer speed per end",
            "Bytes moved per second of transfer at each end (out: the old owners, in: the new "
            "owners): while a move runs, how close it comes to the channel's bandwidth.",
            [
                (
                    f"{by('sum', 'kind', rate(M.MIGRATION_BYTES, JOB, STAGE))} / "
                    f"{by('sum', 'kind', rate(M.MIGRATION_SECONDS, JOB, STAGE))}",
                    "{{kind}}",
                )
            ],
            "Bps",
        ),
        timeseries(
            "Hand-over from checkpoints",
            "Rescales of a checkpointed job: bytes the new owners preloaded from the latest "
            "checkpoint before the switch, and bytes the switch itself moved (cumulative); "
            "rescales that fell back to a direct transfer, by cause.",
            [
                (by("sum", "kind", series(M.HANDOVER_BYTES, JOB, STAGE)), "{{kind}}"),
                (
                    by("sum", "cause", series(M.HANDOVER_FALLBACKS, JOB, STAGE)),
                    "fell back: {{cause}}",
                ),
            ],
            "bytes",
            overrides=[right_axis("B", "short")],
        ),
        timeseries(
            "On-demand fetches",
            "State fetched on demand when a record for a key not yet moved arrives: fetch "
            "requests sent by new owners and served by old owners; cumulative.",
            [(by("sum", "kind", series(M.MIGRATION_FETCHES, JOB, STAGE)), "{{kind}}")],
            "short",
            step=True,
        ),
        timeseries(
            "Parked and forwarded records",
            "Records parked now per instance (waiting for their key's state), and records "
            "parked and forwarded to a new owner so far (cumulative).",
            [
                (
                    by("sum", INSTANCE, series(M.PARKED_NOW, JOB, STAGE)),
                    f"parked now {{{{{INSTANCE}}}}}",
                ),
                (by("sum", "kind", series(M.MIGRATION_RECORDS, JOB, STAGE)), "{{kind}}"),
            ],
            "short",
        ),
        timeseries(
            "Rescales by strategy and result",
            "Rescales running (1 while one runs) and finished ones by strategy and result, "
            "cumulative.",
            [
                (by("max", "stage", series(M.RESCALE_RUNNING, JOB, STAGE)), "{{stage}} running"),
                (
                    by("sum", "stage, strategy, result", series(M.RESCALES, JOB, STAGE)),
                    "{{stage}} {{strategy}} {{result}}",
                ),
            ],
            "none",
            decimals=0,
            step=True,
        ),
    ]
    cost = [
        timeseries(
            "Latency during the move",
            "End-to-end latency p99 and p50; compare with the rescale annotations.",
            [
                (latency_quantile(0.99, JOB), "p99"),
                (latency_quantile(0.5, JOB), "p50"),
            ],
            "s",
        ),
        timeseries(
            "Throughput during the move",
            "Records in per second of the selected stages, while state moves.",
            [(by("sum", "stage", rate(M.RECORDS_IN, JOB, STAGE)), "{{stage}}")],
            "recps",
        ),
    ]
    checkpoints = [
        stat(
            "Last checkpoint age",
            "Seconds since the last checkpoint completed; it grows while checkpoints fail.",
            [(f"time() - max({series(M.CHECKPOINT_COMPLETED_TIME, JOB)})", "age")],
            "s",
        ),
        stat(
            "Checkpoints completed",
            "Checkpoints completed since the coordinator started.",
            [(by("sum", "", series(M.CHECKPOINTS, JOB, 'result="completed"')), "completed")],
            "none",
            decimals=0,
        ),
        stat(
            "Checkpoints failed",
            "Checkpoints that failed (storage errors, timeouts); none is shown as 0.",
            [(by("sum", "", series(M.CHECKPOINTS, JOB, 'result="failed"')), "failed")],
            "none",
            decimals=0,
            no_value="0",
        ),
        timeseries(
            "Checkpoint duration",
            "Seconds from a checkpoint's start to its metadata, for the last completed one.",
            [(by("max", "", series(M.CHECKPOINT_SECONDS, JOB)), "duration")],
            "s",
            width=6,
        ),
        timeseries(
            "Checkpoint size",
            "Bytes the last completed checkpoint wrote (incremental) and bytes of all the "
            "state files it names (full: what a recovery reads).",
            [(by("max", "kind", series(M.CHECKPOINT_BYTES, JOB)), "{{kind}}")],
            "bytes",
        ),
        timeseries(
            "Storage failures",
            "Failures of storage per second by use: checkpoint writes of keyed instances, rows "
            "an ingest endpoint refused, writes a sink's output log could not make (a full "
            "disk stalls the sink).",
            [(by("sum", "use", rate(M.STORAGE_FAILURES, JOB)), "{{use}}")],
            "ops",
        ),
        stat(
            "Recoveries",
            "Restarts of the job from its latest checkpoint after a lost process, over the "
            "job's life.",
            [(by("max", "", series(M.RECOVERIES, JOB)), "recoveries")],
            "none",
            decimals=0,
            no_value="0",
        ),
        stat(
            "Last recovery time",
            "Seconds from a lost process noticed to the job running again, for the last recovery.",
            [(by("max", "", series(M.RECOVERY_SECONDS, JOB)), "seconds")],
            "s",
        ),
        stat(
            "Last recovery local",
            "1: the last recovery started the lost instance alone and rewound the others in "
            "place; 0: it restarted every process.",
            [(by("max", "", series(M.RECOVERY_LOCAL, JOB)), "local")],
            "none",
            decimals=0,
        ),
    ]
    return dashboard(
        "keyshift-migration",
        "keyshift / Migration",
        "What live rescales move (key groups, keys, bytes, on-demand fetches, parked records) "
        "and what they cost in latency; checkpoints of the keyed state.",
        job_variables(source=False),
        layout(
            [
                ("Rescales", panels),
                ("State moved", moves),
                ("Cost of the move", cost),
                ("Checkpoints", checkpoints),
            ]
        ),
        job_annotations(),
    )


def operator_dashboard() -> Json:
    """The Kubernetes operator: reconciles, the jobs it manages, the autoscalers it runs."""
    reconciles_recent = recent(M.OPERATOR_RECONCILES, OPERATED_JOBS)
    decisions = recent(M.AUTOSCALER_DECISIONS, OPERATED_JOBS)
    errors = recent(M.AUTOSCALER_ERRORS, OPERATED_JOBS)
    job_stage = f"{JOB_LABEL}, stage"
    jobs = [
        stat(
            "Jobs managed",
            "StreamingJobs the operator manages.",
            [(by("sum", "", series(M.OPERATOR_JOBS, OPERATED_JOBS)), "jobs")],
            "none",
            decimals=0,
        ),
        stat(
            "Jobs degraded or failed",
            "StreamingJobs in phase Degraded or Failed.",
            [
                (
                    by(
                        "sum",
                        "",
                        series(M.OPERATOR_JOBS, OPERATED_JOBS, 'phase=~"Degraded|Failed"'),
                    ),
                    "jobs",
                )
            ],
            "none",
            decimals=0,
        ),
        stat(
            "Job phases",
            "Each StreamingJob's phase.",
            [
                (
                    f"{series(M.OPERATOR_JOBS, OPERATED_JOBS)} == 1",
                    f"{{{{{NAMESPACE_LABEL}}}}}/{{{{{JOB_LABEL}}}}}: {{{{phase}}}}",
                )
            ],
            "none",
            width=16,
            text_mode="name",
        ),
    ]
    reconciles = [
        timeseries(
            "Reconciles by result",
            f"StreamingJob reconciles per {EVENT_WINDOW}: applied, invalid (the spec was "
            "refused), error.",
            [(by("sum", "result", reconciles_recent), "{{result}}")],
            "short",
        ),
        timeseries(
            "Jobs by phase",
            "StreamingJobs per phase.",
            [(by("sum", "phase", series(M.OPERATOR_JOBS, OPERATED_JOBS)), "{{phase}}")],
            "none",
            decimals=0,
            step=True,
        ),
    ]
    autoscalers = [
        timeseries(
            "Autoscaler decisions by action",
            f"Decisions per {EVENT_WINDOW}, by job, stage and action (scale_up, scale_down, hold).",
            [
                (
                    by("sum", f"{job_stage}, action", decisions),
                    f"{{{{{JOB_LABEL}}}}} {{{{stage}}}}: {{{{action}}}}",
                )
            ],
            "short",
        ),
        timeseries(
            "Autoscaler errors by reason",
            f"Ticks without a decision (metrics) and failed rescales (rescale) per "
            f"{EVENT_WINDOW}, by job.",
            [(by("sum", f"{JOB_LABEL}, reason", errors), f"{{{{{JOB_LABEL}}}}}: {{{{reason}}}}")],
            "short",
        ),
        timeseries(
            "Autoscaler: current vs recommended parallelism",
            "Each stage's parallelism when the autoscaler last looked, and its policy's "
            "recommendation.",
            [
                (
                    by("max", job_stage, series(M.AUTOSCALER_PARALLELISM, OPERATED_JOBS)),
                    f"{{{{{JOB_LABEL}}}}} {{{{stage}}}} current",
                ),
                (
                    by("max", job_stage, series(M.AUTOSCALER_RECOMMENDED, OPERATED_JOBS)),
                    f"{{{{{JOB_LABEL}}}}} {{{{stage}}}} recommended",
                ),
            ],
            "none",
            decimals=0,
            step=True,
            width=24,
        ),
    ]
    variables = [
        datasource_variable(),
        query_variable(
            "namespace",
            "Namespace",
            label_values(M.OPERATOR_JOBS, NAMESPACE_LABEL),
            multi=True,
            include_all=True,
        ),
        query_variable(
            "job",
            "Job",
            label_values(M.OPERATOR_JOBS, JOB_LABEL, OWNER_NAMESPACE),
            multi=True,
            include_all=True,
        ),
    ]
    return dashboard(
        "keyshift-operator",
        "keyshift / Operator",
        "The Kubernetes operator: reconciles by result, StreamingJobs by phase, and its "
        "autoscalers' decisions and errors.",
        variables,
        layout([("Jobs", jobs), ("Reconciles", reconciles), ("Autoscalers", autoscalers)]),
    )


def dashboards() -> list[Json]:
    """Every dashboard, in a fixed order."""
    return [overview_dashboard(), migration_dashboard(), operator_dashboard()]


def dashboard_json(board: Json) -> str:
    """The file's text: sorted keys, indent 2, a final newline (stable across runs)."""
    return json.dumps(board, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def dashboard_files(directory: Path) -> dict[Path, str]:
    return {directory / f"{board['uid']}.json": dashboard_json(board) for board in dashboards()}


def write_dashboards(directory: Path = DASHBOARD_DIR) -> list[Path]:
    """Write every dashboard to `directory`/<uid>.json (created if missing); the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for path, text in dashboard_files(directory).items():
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def stale_dashboards(directory: Path = DASHBOARD_DIR) -> list[Path]:
    """Dashboard files in `directory` that are missing or differ from the code, and JSON files
    there that no dashboard writes (a renamed or removed one)."""
    files = dashboard_files(directory)
    stale = [
        path
        for path, text in files.items()
        if not path.is_file() or path.read_text(encoding="utf-8") != text
    ]
    extra = sorted(set(directory.glob("*.json")) - set(files)) if directory.is_dir() else []
    return stale + extra


# --- every expression, for the tests ------------------------------------------------------


@dataclass(frozen=True)
class Query:
    """One PromQL expression of a dashboard and where it lives."""

    dashboard: str  # the dashboard's uid
    where: str  # "panel <title> <refId>", "annotation <name>" or "variable <name>"
    expr: str  # as written in the dashboard, with Grafana's variables
    promql: str  # what Prometheus evaluates (label_values(...) as a series query)


LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")


def _variable_promql(definition: str) -> str:
    """`label_values(selector, label)` as the PromQL query that lists the same values."""
    match = LABEL_VALUES.match(definition)
    if match is None:
        raise ValueError(f"not a label_values(...) query: {definition!r}")
    return f"count by ({match['label']}) ({match['selector']})"


def _panels(panels: Sequence[Json]) -> Iterator[Json]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def queries(board: Json) -> list[Query]:
    """Every expression of a dashboard: panel targets, annotations, query variables."""
    uid = board["uid"]
    found = [
        Query(uid, f"panel {panel['title']!r} {t['refId']}", t["expr"], t["expr"])
        for panel in _panels(board["panels"])
        for t in panel.get("targets", [])
    ]
    found += [
        Query(uid, f"annotation {a['name']!r}", a["expr"], a["expr"])
        for a in board["annotations"]["list"]
        if "expr" in a
    ]
    found += [
        Query(uid, f"variable {v['name']}", v["definition"], _variable_promql(v["definition"]))
        for v in board["templating"]["list"]
        if v["type"] == "query"
    ]
    return found
