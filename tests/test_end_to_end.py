"""End-to-end correctness through real processes: generator -> keyed instances -> output log.

The expected aggregates are computed here, independently, with a plain dict over the same
deterministic records; exactly-once and per-key order are checked by (source, sequence).
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from keyshift.runtime.generator import KeyGenerator, instance_total
from keyshift.runtime.job import GeneratorSource
from keyshift.runtime.output_log import OutputLogReader
from tests.conftest import cli, count_job, write_job

pytestmark = pytest.mark.live

TIMEOUT = 120


def generated(config: dict[str, Any], parallelism: int) -> list[tuple[int, int, int, float]]:
    """(source, seq, key, value) of every record the job's sources make, from the same seed."""
    spec = GeneratorSource.model_validate(config)
    rows = []
    for source in range(parallelism):
        n = instance_total(spec.total, source, parallelism) or 0
        keys, values = KeyGenerator(spec, source).records(0, n)
        rows += [
            (source, seq, int(k), float(v))
            for seq, (k, v) in enumerate(zip(keys, values, strict=True))
        ]
    return rows


def final_values(out: Path) -> dict[Any, Any]:
    """The last update of every key in the output log (each key lives in one partition)."""
    latest: dict[Any, Any] = {}
    table = OutputLogReader(out).read_all()
    for key, value in zip(
        table.column("key").to_pylist(), table.column("value").to_pylist(), strict=True
    ):
        latest[key] = value
    return latest


def run_to_end(tmp_path: Path, job: dict[str, Any]) -> str:
    path = write_job(tmp_path, job)
    with cli(["run", str(path), "--no-view", "--log-dir", str(tmp_path / "logs")]) as proc:
        output, _ = proc.communicate(timeout=TIMEOUT)
    assert proc.returncode == 0, output
    return output


@pytest.mark.parametrize(
    ("function", "fmt", "sources", "keyed", "sinks"),
    [
        ("count", "parquet", 1, 3, 2),
        ("sum", "jsonl", 2, 2, 1),
        ("mean", "parquet", 1, 1, 1),
        ("max", "jsonl", 2, 3, 1),
    ],
)
def test_aggregates_equal_independent_truth(
    tmp_path: Path, function: str, fmt: str, sources: int, keyed: int, sinks: int
) -> None:
    source = {
        "kind": "generator",
        "keys": 5000,
        "distribution": "zipf",
        "seed": 11,
        "total": 120_000,
    }
    out = tmp_path / "out"
    operator: dict[str, Any] = {"kind": "aggregate", "function": function}
    if function != "count":
        operator["field"] = "value"
    job = count_job(
        source={"parallelism": sources, "config": source},
        keyed={"name": "agg", "parallelism": keyed, "operator": operator},
        sink={"parallelism": sinks, "config": {"kind": "log", "path": str(out), "format": fmt}},
    )
    run_to_end(tmp_path, job)

    truth_values: dict[int, list[float]] = defaultdict(list)
    for _, _, key, value in generated(source, sources):
        truth_values[key].append(value)
    reducers: dict[str, Callable[[list[float]], float]] = {
        "count": len,
        "sum": sum,
        "max": max,
        "mean": lambda v: sum(v) / len(v),
    }
    truth = {key: reducers[function](values) for key, values in truth_values.items()}
    got = final_values(out)
    assert got.keys() == truth.keys()
    for key, expected in truth.items():
        assert got[key] == pytest.approx(expected, rel=1e-12), key
    # Every input record is accounted for once in the updates' record counts.
    table = OutputLogReader(out).read_all()
    assert sum(table.column("n").to_pylist()) == 120_000


def test_exactly_once_and_order_by_source_and_sequence(tmp_path: Path) -> None:
    source = {"kind": "generator", "keys": 300, "distribution": "zipf", "seed": 5, "total": 30_000}
    out = tmp_path / "out"
    job = count_job(
        source={"parallelism": 2, "config": source},
        keyed={
            "name": "track",
            "parallelism": 3,
            "operator": {"kind": "process", "function": "tests.job_fns:track"},
        },
        sink={"parallelism": 2, "config": {"kind": "log", "path": str(out), "format": "jsonl"}},
    )
    run_to_end(tmp_path, job)

    table = OutputLogReader(out).read_all()
    seen: Counter[tuple[int, int]] = Counter()
    last_count: dict[int, int] = {}
    last_seq: dict[tuple[int, int], int] = {}
    for key, value in zip(
        table.column("key").to_pylist(), table.column("value").to_pylist(), strict=True
    ):
        count, source_id, seq = json.loads(value)
        seen[(source_id, seq)] += 1
        # Each key's state advanced by exactly one per record, in the order they were applied...
        assert count == last_count.get(key, 0) + 1, (key, count)
        last_count[key] = count
        # ...and records of one sender were applied in the order it sent them.
        assert seq > last_seq.get((key, source_id), -1), (key, source_id, seq)
        last_seq[(key, source_id)] = seq
    expected = {(s, q) for s, q, _, _ in generated(source, 2)}
    assert set(seen) == expected, "records lost or invented"
    assert max(seen.values()) == 1, "records applied twice"
    truth = Counter(k for _, _, k, _ in generated(source, 2))
    assert last_count == dict(truth)
