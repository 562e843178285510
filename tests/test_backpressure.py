"""A deliberately slow sink backpressures the pipeline: memory stays bounded, the source slows."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pyarrow as pa
import pytest

from keyshift.runtime.output_log import OutputLogReader, commit_reader
from tests.conftest import count_job, running_job, wait_for

pytestmark = pytest.mark.live

TARGET_RATE = 200_000


def test_slow_sink_backpressures_with_bounded_memory(tmp_path: Path) -> None:
    job = count_job(
        source={
            "config": {
                "kind": "generator",
                "keys": 50_000,
                "distribution": "uniform",
                "profile": {"rate": TARGET_RATE},
            }
        },
        keyed={"name": "counts", "parallelism": 2},
        sink={"config": {"kind": "function", "function": "tests.job_fns:slow_sink"}},
        batching={"max_records": 4096},
    )
    with running_job(tmp_path, job) as local:
        procs = [psutil.Process(c.pid) for c in local.instances.values()]

        def source_stats() -> dict[str, float]:
            instances = local.status()["stages"][0]["instances"]
            return dict(instances[0]["stats"]) if instances else {}

        wait_for(lambda: source_stats().get("records_out", 0) > 0, 30, "the source to start")
        start_stats, start = source_stats(), time.monotonic()
        rss_samples: list[list[int]] = []
        queue_samples: list[int] = []
        while time.monotonic() - start < 8.0:
            rss_samples.append([p.memory_info().rss for p in procs])
            status = local.status()
            queue_samples += [
                i["stats"].get("queue", 0) for s in status["stages"] for i in s["instances"]
            ]
            time.sleep(0.25)
        end_stats, end = source_stats(), time.monotonic()

    achieved = (end_stats["records_out"] - start_stats["records_out"]) / (end - start)
    assert achieved < 0.5 * TARGET_RATE, f"source kept {achieved:.0f}/s despite the slow sink"
    assert end_stats["backpressured"] - start_stats["backpressured"] > 0.5 * (end - start)
    # Inboxes hold at most credits x senders batches.
    assert max(queue_samples) <= 4 * 2
    half = len(rss_samples) // 2
    for i, proc_name in enumerate(local.instances):
        first = max(s[i] for s in rss_samples[:half])
        second = max(s[i] for s in rss_samples[half:])
        assert second < 400 * 2**20, f"{proc_name} uses {second / 2**20:.0f} MB"
        assert second - first < 40 * 2**20, f"{proc_name} grew {(second - first) / 2**20:.0f} MB"


def test_a_lagging_log_reader_backpressures_the_job_and_nothing_is_dropped(
    tmp_path: Path,
) -> None:
    """The sink names a reader: it keeps at most max_unread_records unread, the job waits for
    the reader, and the reader's commits let it go on and delete what was read."""
    out = tmp_path / "out"
    total = 40_000
    job = count_job(
        source={"config": {"kind": "generator", "keys": 500, "seed": 1, "total": total}},
        sink={
            "config": {
                "kind": "log",
                "path": str(out),
                "format": "jsonl",
                "segment_records": 1000,
                "readers": ["r"],
                "max_unread_records": 5000,
            }
        },
    )
    with running_job(tmp_path, job) as local:

        def sink_stats() -> dict[str, float]:
            instances = local.status()["stages"][2]["instances"]
            return dict(instances[0]["stats"]) if instances else {}

        def stalled() -> bool:
            stats = sink_stats()
            return stats.get("output_offset", 0) >= 5000 and stats.get("backpressured", 0) > 1.0

        wait_for(stalled, 60, "the sink to wait for its reader")
        assert sink_stats()["output_offset"] < 5000 + 2 * 1000 + 2048  # at most one batch over
        read = 0
        tables = []
        while local.status()["phase"] != "finished":
            end = OutputLogReader(out).end_offset(0)
            if end > read:  # read what is there, then commit it, as a Spark sink query does
                tables.append(OutputLogReader(out).read(0, read, end))
                commit_reader(out, "r", {0: end})
                read = end
            wait_for(  # mypy cannot type a lambda's default argument, which binds read's value
                lambda r=read: (  # type: ignore[misc]
                    OutputLogReader(out).end_offset(0) > r or local.status()["phase"] == "finished"
                ),
                60,
                "more output",
            )
    log = OutputLogReader(out)
    tables.append(log.read(0, read))
    assert log.start_offset(0) > 0  # segments every reader had read were deleted
    output = pa.concat_tables(tables)
    assert output.column("offset").to_pylist() == list(range(log.end_offset(0)))
    latest: dict[int, int] = {}
    for key, version in zip(output["key"].to_pylist(), output["version"].to_pylist(), strict=True):
        latest[key] = max(latest.get(key, 0), version)
    assert sum(latest.values()) == total  # every record counted once, none dropped
