"""The Grafana dashboards (keyshift.operator.dashboards) against what keyshift really exports.

The checked-in JSON in helm/keyshift/dashboards/ is what the code builds; every panel is well
formed; every metric an expression names is one the runtime defines (a static check); and every
PromQL expression of every panel, annotation and variable runs against a real Prometheus server
scraping a real job that autoscales once, and returns data (a dynamic check; the few expressions
that can rightly come back empty are listed in MAY_BE_EMPTY with the reason). The same run's
query_range results draw the overview's main panels; with KEYSHIFT_WRITE_DOCS=1 the picture is
written to docs/dashboard-overview.png for the README.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import start_http_server

from keyshift.operator.dashboards import (
    DASHBOARD_DIR,
    Query,
    dashboard_json,
    dashboards,
    queries,
    stale_dashboards,
)
from keyshift.runtime.metrics import (
    INSTANCE_LABEL,
    JOB_LABEL,
    NAMESPACE_LABEL,
    MetricName,
    OperatorMetrics,
)
from tests.conftest import REPO, cli, keyshift_main, write_job
from tests.prometheus_server import PrometheusError, PrometheusServer
from tests.test_autoscaling_live import Output, slow_job

DOCS_PICTURE = REPO / "docs" / "dashboard-overview.png"
WRITE_DOCS = os.environ.get("KEYSHIFT_WRITE_DOCS") == "1"

# --- static checks --------------------------------------------------------------------------

EXPORTED = {name.value for name in MetricName}
HISTOGRAMS = {MetricName.LATENCY.value}
METRIC = re.compile(r"\bkeyshift_\w+")
HISTOGRAM_SERIES = re.compile(r"^(?P<base>\w+)_(?:bucket|sum|count)$")
VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range"}
OUR_LABELS = {JOB_LABEL, INSTANCE_LABEL, NAMESPACE_LABEL}  # keyshift_* names that are labels

# Metrics no dashboard shows, and why; a new metric must go on a dashboard or in this list.
NOT_ON_A_DASHBOARD = {
    MetricName.IDLE_SECONDS: "idle = 1 - busy - backpressured, which the overview shows",
    MetricName.PARALLELISM: "each instance's copy of keyshift_job_stage_instances",
    MetricName.RPC_UNAUTHENTICATED: "a security signal, queried directly (README: Security)",
}


def unknown_metrics(expr: str) -> list[str]:
    """Names in `expr` that are no metric the runtime exports (a histogram's _bucket, _sum and
    _count series count as its own; counters' names carry their _total already)."""
    unknown = []
    for name in METRIC.findall(expr):
        if name in OUR_LABELS:
            continue
        histogram = HISTOGRAM_SERIES.match(name)
        if name in EXPORTED or (histogram is not None and histogram["base"] in HISTOGRAMS):
            continue
        unknown.append(name)
    return unknown


def variables_of(board: dict[str, Any]) -> set[str]:
    return {v["name"] for v in board["templating"]["list"]}


def substitute(expr: str, values: dict[str, str]) -> str:
    """Grafana's variables replaced by concrete values; an unknown one is a KeyError."""
    return VARIABLE.sub(lambda m: values[m[1] or m[2]], expr)


def all_queries() -> list[Query]:
    return [q for board in dashboards() for q in queries(board)]


def test_checked_in_dashboards_are_current() -> None:
    stale = stale_dashboards(REPO / DASHBOARD_DIR)
    assert not stale, (
        f"{', '.join(str(p.relative_to(REPO)) for p in stale)} missing or stale; run "
        "`keyshift dashboards` in the repository root and commit the result"
    )
    for board in dashboards():
        path = REPO / DASHBOARD_DIR / f"{board['uid']}.json"
        assert json.loads(path.read_text(encoding="utf-8")) == json.loads(dashboard_json(board))


def test_generation_is_deterministic() -> None:
    first = [dashboard_json(board) for board in dashboards()]
    assert first == [dashboard_json(board) for board in dashboards()]


def test_cli_writes_the_files_and_check_finds_them_stale(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)

    def keyshift(*args: str) -> tuple[int, str]:
        return keyshift_main(["dashboards", *args], capsys)

    code, output = keyshift("--check")
    assert code == 1 and "run `keyshift dashboards`" in output
    assert keyshift()[0] == 0
    assert stale_dashboards(tmp_path / DASHBOARD_DIR) == []
    assert keyshift("--check")[0] == 0
    edited = tmp_path / DASHBOARD_DIR / "keyshift-overview.json"
    edited.write_text(edited.read_text(encoding="utf-8").replace("p99", "p98"))
    (tmp_path / DASHBOARD_DIR / "keyshift-gone.json").write_text("{}")
    code, output = keyshift("--check")
    assert code == 1
    assert "keyshift-overview.json" in output and "keyshift-gone.json" in output
    assert keyshift("--out", "elsewhere")[0] == 0
    assert stale_dashboards(tmp_path / "elsewhere") == []


def test_every_panel_is_well_formed() -> None:
    boards = dashboards()
    assert [b["uid"] for b in boards] == [
        "keyshift-overview",
        "keyshift-migration",
        "keyshift-operator",
    ]
    for board in boards:
        assert board["schemaVersion"] >= 39
        defined = variables_of(board)
        assert "datasource" in defined
        titles = [p["title"] for p in board["panels"] if p["type"] != "row"]
        assert len(titles) == len(set(titles)), f"{board['uid']}: panel titles repeat"
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids))
        for panel in board["panels"]:
            grid = panel["gridPos"]
            assert grid["x"] + grid["w"] <= 24, panel["title"]
            if panel["type"] == "row":
                continue
            where = f"{board['uid']} {panel['title']!r}"
            assert panel["type"] in ("timeseries", "stat"), where
            assert panel["datasource"]["uid"] == "${datasource}", where
            assert panel["fieldConfig"]["defaults"]["unit"], where
            assert panel["description"] and panel["targets"], where
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs)), where
        for query in queries(board):
            used = {m[1] or m[2] for m in VARIABLE.finditer(query.expr)}
            assert used <= defined | GRAFANA_BUILTINS, (query.where, used - defined)


def test_every_metric_name_in_every_query_is_exported() -> None:
    problems = [
        f"{q.dashboard} {q.where}: {name}"
        for q in all_queries()
        for name in unknown_metrics(q.expr)
    ]
    assert not problems, "metrics the runtime does not export:\n" + "\n".join(problems)
    used = {name for q in all_queries() for name in METRIC.findall(q.expr)}
    missing = {name for name in EXPORTED if name not in used and not any(
        h.startswith(name) for h in used)} - set(NOT_ON_A_DASHBOARD)  # fmt: skip
    assert not missing, f"on no dashboard: {sorted(missing)}; add them or to NOT_ON_A_DASHBOARD"


def test_every_query_filters_by_namespace() -> None:
    """Each query names `$namespace`, by the target label or (for the series the operator
    exports per StreamingJob) keyshift's own, and the variable offers "All"."""
    for board in dashboards():
        for query in queries(board):
            if query.where == "variable namespace":
                continue
            assert re.search(r'namespace=~"\$namespace"', query.expr), (
                query.dashboard,
                query.where,
            )
        (namespace,) = [v for v in board["templating"]["list"] if v["name"] == "namespace"]
        assert namespace["includeAll"] and namespace["allValue"] == ".*"


def test_the_static_check_catches_what_it_should() -> None:
    assert unknown_metrics(f'rate({MetricName.RECORDS_IN}{{{JOB_LABEL}="j"}}[1m])') == []
    assert unknown_metrics("keyshift_end_to_end_latency_seconds_bucket{le='1'}") == []
    assert unknown_metrics("keyshift_records_total + keyshift_state_keys_bucket") == [
        "keyshift_records_total",
        "keyshift_state_keys_bucket",
    ]
    assert unknown_metrics("keyshift_records_in") == ["keyshift_records_in"]


# --- the dynamic check: a real job, a real Prometheus --------------------------------------

JOB = "auto"  # slow_job's name
KEYED = "track"  # slow_job's keyed stage
# 2.5k records/s, a step to 9k/s after 8 s: one keyed instance (~6k/s) is overloaded and DS2
# scales it out to two; the lazy strategy moves state mostly by on-demand fetches, so records
# park waiting for their keys' state and every migration kind shows up.
PROFILE = {"kind": "points", "points": [[0, 2500], [8, 9000]]}
AUTOSCALER = {
    "interval": 1,
    "metrics_window": 4,
    "warmup": 4,
    "strategy": "lazy",
    "bounds": {"min_parallelism": 1, "max_parallelism": 3},
}
AFTER_RESCALE = 12.0  # seconds the scaled-out job runs on before the docs' picture is drawn
OPERATOR_NAMESPACE = "default"

VALUES = {
    "job": JOB,
    "source": "source",
    # The variable's "All" (a local run has no namespace: its series match only that).
    "namespace": ".*",
    "datasource": "n/a",
    "__rate_interval": "30s",
}
STAGE_VALUES = (KEYED, ".*")  # one stage, and the variable's "All"

# Expressions that may rightly return nothing in this run (dashboard uid, where): why.
MAY_BE_EMPTY = {
    ("keyshift-overview", "panel 'Invalid records' A"): (
        "keyshift_invalid_records_total{reason} has a series only once a record breaks the "
        "schema; every generated record fits"
    ),
    ("keyshift-migration", "panel 'Rescales failed' A"): (
        'keyshift_rescales_total{result="failed"} exists only after a failed rescale (an '
        "instance dying mid-move); the panel shows 0 then"
    ),
    ("keyshift-migration", "panel 'Last recovery local' A"): (
        "keyshift_recovery_local_instances exists only once the job recovered from a crash; "
        "the run here has none"
    ),
    ("keyshift-migration", "panel 'Last recovery time' A"): (
        "keyshift_recovery_duration_seconds exists only once the job recovered from a crash; "
        "the run here has none"
    ),
    ("keyshift-migration", "panel 'Checkpoints failed' A"): (
        'keyshift_checkpoints_total{result="failed"} exists only after a failed checkpoint; '
        "the panel shows 0 then"
    ),
    ("keyshift-migration", "panel 'Storage failures' A"): (
        "keyshift_storage_failures_total{use} has a series only once storage failed; the run "
        "here has healthy storage (tests/test_storage_outage.py checks it with failing storage)"
    ),
    ("keyshift-migration", "panel 'Hand-over from checkpoints' A"): (
        "keyshift_rescale_handover_bytes_total exists only once a checkpointed job rescaled "
        "with a strategy that hands over from checkpoints; the run here rescales with lazy "
        "(tests/test_handover.py checks the hand-over's numbers)"
    ),
    ("keyshift-migration", "panel 'Hand-over from checkpoints' B"): (
        "keyshift_rescale_handover_fallbacks_total{cause} has a series only once a hand-over "
        "fell back to a direct transfer; the run here hands nothing over"
    ),
    ("keyshift-operator", "panel 'Autoscaler errors by reason' A"): (
        "keyshift_autoscaler_errors_total{reason} counts ticks without metrics and failed "
        "rescales; a run may have neither"
    ),
}


@contextmanager
def operator_metrics() -> Iterator[str]:
    """An OperatorMetrics registry (no local run has an operator) with one reconcile and one
    phase, served on a free port; its address."""
    metrics = OperatorMetrics()
    metrics.reconciled(OPERATOR_NAMESPACE, JOB, "applied")
    metrics.phase(OPERATOR_NAMESPACE, JOB, "Running")
    server, thread = start_http_server(0, addr="127.0.0.1", registry=metrics.registry)
    try:
        yield f"127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def add_target(prometheus: PrometheusServer, address: str) -> None:
    """Add `address` to the targets `keyshift run` keeps (it rewrites the file only when its
    instances change, which they no longer do after the rescale)."""
    groups = json.loads(prometheus.targets_file.read_text())
    if not any(address in group["targets"] for group in groups):
        prometheus.write_targets([*groups, {"targets": [address], "labels": {}}])


def query_range(
    prometheus: PrometheusServer, promql: str, start: float, end: float, step: float
) -> list[dict[str, Any]]:
    params = {"query": promql, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
    url = f"{prometheus.url}/api/v1/query_range?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.load(response)
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace")
        raise PrometheusError(f"query_range {promql!r} failed: {error.code} {detail}") from None
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def evaluate(prometheus: PrometheusServer) -> tuple[list[str], dict[tuple[str, str, str], int]]:
    """Every query with every stage value: (errors, number of series per query)."""
    errors: list[str] = []
    counts: dict[tuple[str, str, str], int] = {}
    for query in all_queries():
        for stage in STAGE_VALUES:
            promql = substitute(query.promql, {**VALUES, "stage": stage})
            try:
                counts[query.dashboard, query.where, stage] = len(prometheus.query(promql))
            except PrometheusError as error:
                errors.append(f"{query.dashboard} {query.where}: {error}")
    return errors, counts


def empty_ones(counts: dict[tuple[str, str, str], int]) -> list[str]:
    return [
        f"{uid} {where} (stage={stage})"
        for (uid, where, stage), n in counts.items()
        if n == 0 and (uid, where) not in MAY_BE_EMPTY
    ]


@pytest.mark.live
def test_every_query_runs_against_a_real_prometheus_scraping_a_running_job(
    tmp_path: Path, prometheus: PrometheusServer
) -> None:
    listed = {(q.dashboard, q.where) for q in all_queries()}
    assert set(MAY_BE_EMPTY) <= listed, f"stale MAY_BE_EMPTY: {set(MAY_BE_EMPTY) - listed}"
    job = slow_job(tmp_path / "out", PROFILE, AUTOSCALER)
    job["checkpoints"] = {"interval": 1, "storage": str(tmp_path / "checkpoints")}
    args = ["run", str(write_job(tmp_path, job)), "--no-view", "--log-dir", str(tmp_path / "logs"),
            "--prometheus-targets", str(prometheus.targets_file)]  # fmt: skip
    with operator_metrics() as operator_address, cli(args) as run:
        output = Output(run)
        started = time.time()

        def wait(promql: str, seconds: float) -> None:
            try:
                prometheus.wait_for_series(promql, seconds)
            except PrometheusError as error:
                pytest.fail(f"{error}\n`keyshift run` said:\n{output.text()}")

        # Coordinator, instances and autoscaler are scraped; then DS2 scales the stage out.
        # Starting the instances alone has taken 30 s beside another job on a busy machine.
        ours = f'{JOB_LABEL}="{JOB}"'
        wait(f"{MetricName.RECORDS_IN}{{{ours}}}", 90)
        wait(f"{MetricName.AUTOSCALER_DECISIONS}{{{ours}}}", 20)
        wait(f'{MetricName.RESCALES}{{{ours}, result="done"}}', 45)
        wait(f'{MetricName.CHECKPOINTS}{{{ours}, result="completed"}}', 30)
        rescaled = time.time()
        add_target(prometheus, operator_address)
        wait(f"{MetricName.OPERATOR_JOBS}{{{ours}}}", 15)
        if WRITE_DOCS:  # the README's picture shows the job scaled out for a while
            time.sleep(max(0.0, rescaled + AFTER_RESCALE - time.time()))
        # Otherwise the queries are polled until none is empty, as long as before at most.
        deadline = time.monotonic() + 15 + AFTER_RESCALE
        while True:
            errors, counts = evaluate(prometheus)
            if errors or not empty_ones(counts) or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert run.poll() is None, f"the job ended early:\n{output.text()}"
        ended = time.time()
        picture = tmp_path / "dashboard-overview.png"
        render_overview(prometheus, started, ended, picture)
    assert not errors, "queries Prometheus refused:\n" + "\n".join(errors)
    empty = empty_ones(counts)
    assert not empty, "queries that found nothing:\n" + "\n".join(empty)
    assert picture.stat().st_size > 10_000
    if WRITE_DOCS:
        DOCS_PICTURE.parent.mkdir(exist_ok=True)
        shutil.copyfile(picture, DOCS_PICTURE)


# --- the picture: the overview's main panels from the same run -----------------------------

# The panels and the $stage each shows: every stage, but parallelism only for the keyed stage
# (the source and sink stay at 1, and their lines would hide the keyed stage's).
PICTURE_PANELS = {
    "Input rate vs target rate": ".*",
    "Throughput by stage": ".*",
    "Busy ratio by stage": ".*",
    "Parallelism: current vs recommended": KEYED,
    "End-to-end latency": ".*",
}
# Grafana's $__rate_interval for a 1 s scrape interval at full resolution (4 x scrape).
PICTURE_RATE = "4s"
# Grafana's named colours the annotations use, as its dark theme draws them.
NAMED_COLORS = {"orange": "#ff9830", "purple": "#ca95e5"}
COLORS = ["#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9", "#705da0"]
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def legend_text(template: str, labels: dict[str, str], values: dict[str, str]) -> str:
    """A legend or annotation title as Grafana shows it: {{label}} and $variable filled in."""
    return substitute(LEGEND_LABEL.sub(lambda m: labels.get(m[1], ""), template), values)


def _format(unit: str, value: float) -> str:
    if unit == "recps":
        return f"{value / 1000:g}k" if abs(value) >= 1000 else f"{value:g}"
    if unit == "percentunit":
        return f"{value * 100:.0f}%"
    if unit == "s":
        return f"{value * 1000:.0f} ms" if abs(value) < 1 else f"{value:g} s"
    return f"{value:g}"


def render_overview(prometheus: PrometheusServer, start: float, end: float, path: Path) -> None:
    """Draw the overview's main panels from query_range results, annotations as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    board = dashboards()[0]
    values = {**VALUES, "__rate_interval": PICTURE_RATE}
    panels = {p["title"]: p for p in board["panels"]}
    events: list[tuple[float, str, str]] = []
    for note in board["annotations"]["list"]:
        if "expr" not in note:
            continue
        for series in query_range(prometheus, substitute(note["expr"], values), start, end, 1):
            first = float(series["values"][0][0])
            title = legend_text(note["titleFormat"], series["metric"], values)
            hue = NAMED_COLORS.get(note["iconColor"], note["iconColor"])
            events.append((first - start, title, hue))

    text, grid, background = "#ccccdc", "#2c3235", "#181b1f"
    figure = plt.figure(figsize=(14, 10.5), facecolor="#111217")
    layout = figure.add_gridspec(3, 2, hspace=0.45, wspace=0.15)
    cells = [layout[0, 0], layout[0, 1], layout[1, 0], layout[1, 1], layout[2, :]]
    for (title, stage), cell in zip(PICTURE_PANELS.items(), cells, strict=True):
        panel = panels[title]
        unit = panel["fieldConfig"]["defaults"]["unit"]
        axes = figure.add_subplot(cell, facecolor=background)
        color = iter(COLORS * 3)
        for width, t in zip((3.2, 2.2, 1.4, 1.4), panel["targets"], strict=False):
            promql = substitute(t["expr"], {**values, "stage": stage})
            for series in query_range(prometheus, promql, start, end, 1):
                xs = [float(x) - start for x, _ in series["values"]]
                ys = [float(y) for _, y in series["values"]]
                legend = legend_text(t["legendFormat"], series["metric"], values)
                style = "steps-post" if unit == "none" else "default"
                axes.plot(xs, ys, label=legend, color=next(color), linewidth=width, drawstyle=style)
        wide = cell is cells[-1]  # the annotations' titles go in its legend, where there is room
        for at, label, hue in sorted(events):
            axes.axvline(
                at, color=hue, linestyle="--", linewidth=1.2, label=label if wide else None
            )
        axes.set_title(title, color=text, loc="left", fontsize=11)
        axes.set_xlim(0, end - start)
        axes.set_xlabel("seconds since the job started", color=text, fontsize=8)
        axes.yaxis.set_major_formatter(FuncFormatter(lambda v, _p, u=unit: _format(u, v)))
        if unit == "none":
            axes.yaxis.set_major_locator(MaxNLocator(integer=True))
        axes.set_ylim(bottom=0)
        axes.tick_params(colors=text, labelsize=8)
        axes.grid(color=grid, linewidth=0.6)
        for spine in axes.spines.values():
            spine.set_color(grid)
        shown = axes.legend(fontsize=7, facecolor=background, edgecolor=grid, labelcolor=text,
                             loc="best", ncol=2)  # fmt: skip
        shown.get_frame().set_alpha(0.8)
    figure.suptitle(
        f"keyshift / Job overview: job {JOB!r}, 5k then 18k records/s, DS2 scales {KEYED!r} out "
        "(lazy state moves); dashed lines are the dashboard's annotations",
        color=text,
        fontsize=12,
        x=0.01,
        ha="left",
    )
    figure.savefig(path, dpi=100, facecolor=figure.get_facecolor(), bbox_inches="tight")
    plt.close(figure)
