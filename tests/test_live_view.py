"""The live view's rates and latency from coordinator status snapshots."""

from __future__ import annotations

from typing import Any

from keyshift.operator.live_view import RateTracker, final_report, plain_line
from keyshift.runtime.metrics import LATENCY_BUCKETS


def instance(index: int, records: int, buckets: list[int] | None = None) -> dict[str, Any]:
    stats = {"records_in": records, "records_out": records, "busy": 0.0}
    return {
        "index": index,
        "address": f"127.0.0.1:{7000 + index}",
        "pid": 100 + index,
        "stats": {**stats, "latency_buckets": buckets or []},
    }


def status(sink_buckets: list[list[int]], records: int) -> dict[str, Any]:
    sinks = [instance(i, records, b) for i, b in enumerate(sink_buckets)]
    return {
        "stages": [
            {
                "name": "source",
                "role": "source",
                "parallelism": 1,
                "instances": [instance(0, records)],
            },
            {"name": "sink", "role": "sink", "parallelism": len(sinks), "instances": sinks},
        ]
    }


def test_latency_counts_only_the_instances_that_reported_a_histogram() -> None:
    full = [0] * (len(LATENCY_BUCKETS) + 1)
    full[3] = 10  # all in (0.005, 0.01]
    tracker = RateTracker()
    # The second sink instance has just registered: no histogram in its stats yet.
    tracker.add(status([full, []], 10), now=0.0)
    assert tracker.latency() == (None, None)  # one snapshot: no window yet
    p50, _ = tracker.latency(overall=True)
    assert p50 is not None and 0.005 < p50 <= 0.01
    tracker.add(status([full, full], 20), now=1.0)
    assert tracker.latency(overall=True)[1] is not None


def test_every_sinks_latency_counts_and_the_report_names_each_sink() -> None:
    slow, fast = [0] * (len(LATENCY_BUCKETS) + 1), [0] * (len(LATENCY_BUCKETS) + 1)
    slow[-2], fast[1] = 10, 10
    two = status([fast], 10)
    two["stages"].append({**two["stages"][1], "name": "copy", "instances": [instance(0, 10, slow)]})
    for stage, ends in zip(two["stages"][1:], (7, 9), strict=True):
        stage["instances"][0]["stats"]["output_offset"] = ends
    tracker = RateTracker()
    tracker.add(two, now=0.0)
    p50, p99 = tracker.latency(overall=True)
    assert p50 is not None and p99 is not None and p99 > 10 * p50  # both sinks' histograms
    report = final_report({**two, "job": "j", "phase": "finished"}, tracker, 1.0)
    assert "sink: records in its output log, per instance: [7]" in report
    assert "copy: records in its output log, per instance: [9]" in report


def test_a_retired_instance_neither_makes_rates_negative_nor_leaves_the_totals() -> None:
    tracker = RateTracker()
    keyed = [instance(0, 1000), instance(1, 800), instance(2, 600)]
    tracker.add(
        {"stages": [{"name": "k", "role": "keyed", "parallelism": 3, "instances": keyed}]}, now=0.0
    )
    # Instance 2 retired; the others went on. Then a new process takes index 2 again.
    kept = [instance(0, 1500), instance(1, 1200)]
    tracker.add(
        {"stages": [{"name": "k", "role": "keyed", "parallelism": 2, "instances": kept}]}, now=1.0
    )
    (view,) = tracker.stages()
    assert view.rate_in == 900.0
    assert view.total_in == 1500 + 1200 + 600
    reborn = [instance(0, 1600), instance(1, 1300), {**instance(2, 50), "pid": 999}]
    tracker.add(
        {"stages": [{"name": "k", "role": "keyed", "parallelism": 3, "instances": reborn}]}, now=2.0
    )
    assert tracker.total("k", "records_in") == 1600 + 1300 + 600 + 50


def test_the_rows_an_ingest_sources_clients_are_behind_show_on_its_line() -> None:
    tracker = RateTracker()
    for now, behind in ((0.0, 0), (1.0, 42_000)):
        source = {**instance(0, 100), "stats": {"records_in": 100, "client_backlog": behind}}
        stages = [{"name": "source", "role": "source", "parallelism": 1, "instances": [source]}]
        tracker.add({"stages": stages, "uptime": now, "phase": "running"}, now)
    (view,) = tracker.stages()
    assert view.behind == 42_000
    line = plain_line({"uptime": 1.0, "phase": "running"}, tracker)
    assert "source x1 in 0/s busy 0% q 0 behind 42,000" in line


def test_the_rescale_running_and_those_queued_after_it_show_on_the_line() -> None:
    def rescale(id_: int, stage: str, to: int, phase: str) -> dict[str, Any]:
        return {"id": id_, "stage": stage, "from": 2, "to": to, "strategy": "hot-first",
                "phase": phase}  # fmt: skip

    snapshot = {
        "uptime": 3.0,
        "phase": "running",
        "rescale": rescale(4, "users", 3, "moving"),
        "queued": [rescale(5, "out", 1, "queued"), rescale(6, "regions", 4, "queued")],
    }
    line = plain_line(snapshot, RateTracker())
    assert "rescale 4 users 2->3 (hot-first): moving; queued: out->1, regions->4" in line
