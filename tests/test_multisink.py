"""Jobs with several sinks, with real processes: each sink is its own stage, with its own output
log, partitions and parallelism, rescaled live and recovered on its own, and each sink's output
equals a truth computed from the generator's seed.

The job: clicks -> users (tests.job_fns:track: a key's count after each record, with its
source and sequence number), read every way: by the sink `every` (all its updates), by a
filter into the sink `odds` (odd keys only: a fan-out to two sinks), and by a map into the
keyed stage `regions` (tests.job_fns:nest, counting per region), which has its own sink
`by-region` (two keyed stages, each to its own sink).
"""

from __future__ import annotations

import json
import os
import random
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from keyshift.runtime.generator import KeyGenerator, instance_total
from keyshift.runtime.job import GeneratorSource
from keyshift.runtime.output_log import OutputLogReader
from keyshift.runtime.transport import JsonClient
from tests.conftest import BATCHING, running_job, wait_for
from tests.job_fns import REGIONS
from tests.test_recovery import recover_through
from tests.test_rescale import SERVICE, applied_once, rescale_via, sum_out, truth
from tests.test_sink_rescale import check_partitions

pytestmark = pytest.mark.live

SOURCE = {"kind": "generator", "keys": 2000, "distribution": "zipf", "seed": 41,
          "profile": {"rate": 2000}}  # fmt: skip
SINKS = ("every", "odds", "by-region")


def log(out: Path, name: str) -> dict[str, Any]:
    return {"kind": "log", "path": str(out / name), "format": "jsonl"}


def three_sinks(
    out: Path, source: dict[str, Any] = SOURCE, widths: dict[str, int] | None = None
) -> dict[str, Any]:
    """The job, each keyed stage and sink at its width in `widths` (default: 1, odds 2)."""
    width = {"users": 2, "regions": 1, "every": 1, "odds": 2, "by-region": 1} | (widths or {})
    track = {"kind": "process", "function": "tests.job_fns:track"}
    nest = {"kind": "process", "function": "tests.job_fns:nest"}
    return {
        "name": "sinks",
        "graph": [
            {"name": "clicks", "kind": "source", "parallelism": 2, "config": source},
            {"name": "users", "kind": "keyed", "input": "clicks", "key_by": "key",
             "parallelism": width["users"], "operator": track},
            {"name": "every", "kind": "sink", "input": "users", "partitions": 4,
             "parallelism": width["every"], "config": log(out, "every")},
            {"name": "odd", "kind": "filter", "input": "users",
             "function": "tests.job_fns:odd_key"},
            {"name": "odds", "kind": "sink", "input": "odd", "parallelism": width["odds"],
             "partitions": 4, "config": log(out, "odds")},
            {"name": "to-region", "kind": "map", "input": "users",
             "function": "tests.job_fns:to_region", "fields": {"key": "int", "value": "str"}},
            {"name": "regions", "kind": "keyed", "input": "to-region", "key_by": "key",
             "parallelism": width["regions"], "operator": nest},
            {"name": "by-region", "kind": "sink", "input": "regions", "partitions": 2,
             "parallelism": width["by-region"], "config": log(out, "by-region")},
        ],
        "batching": {**BATCHING, "max_records": 1024},
    }  # fmt: skip


def check_sinks(out: Path, emitted: list[int]) -> None:
    """Each sink's log is its own truth: `every` has every record's update once, in order
    per key and sender; `odds` the same of the odd keys only; `by-region` every user update
    counted once per region, 1..n, each (source, seq) once."""
    counts, records = truth(SOURCE, emitted)
    seen_counts, seen = applied_once(out / "every")
    assert seen == records, f"every: {len(records - seen)} records lost"
    assert seen_counts == counts
    check_partitions(out / "every")
    odd_counts, odd_seen = applied_once(out / "odds")
    assert odd_counts == Counter({k: n for k, n in counts.items() if k % 2})
    spec = GeneratorSource.model_validate(SOURCE)
    odd_records = set()
    for s, n in enumerate(emitted):
        keys, _ = KeyGenerator(spec, s).records(0, n)
        odd_records |= {(s, q) for q, key in enumerate(keys.tolist()) if key % 2}
    assert odd_seen == odd_records, f"odds: {len(odd_records - odd_seen)} records lost"
    check_partitions(out / "odds")
    table = OutputLogReader(out / "by-region").read_all()
    per_region: dict[int, list[int]] = {}
    arrived: Counter[tuple[int, int]] = Counter()
    for region, value in zip(table.column("key").to_pylist(), table.column("value").to_pylist(),
                             strict=True):  # fmt: skip
        at_region, (stage, user, (_, source, seq)) = json.loads(value)
        assert stage == "users" and region == user % REGIONS, (region, user)
        per_region.setdefault(region, []).append(at_region)
        arrived[(source, seq)] += 1
    assert not arrived or max(arrived.values()) == 1, "by-region: a record arrived twice"
    assert set(arrived) == records, f"by-region: {len(records - set(arrived))} records lost"
    regions: Counter[int] = Counter()
    for key, n in counts.items():
        regions[key % REGIONS] += n
    assert {r: sorted(c) for r, c in per_region.items()} == {
        r: list(range(1, n + 1)) for r, n in regions.items()
    }


def test_every_sink_and_keyed_stage_rescales_live_and_each_sink_equals_its_truth(
    tmp_path: Path,
) -> None:
    """Each keyed stage and sink, in a random order, scaled in to a random width under load
    (a scale-in starts no process: the test stays seconds, where each new instance takes
    seconds to start on a busy machine; test_sink_rescale.py scales a sink out and in)."""
    out = tmp_path / "out"
    rng = random.Random(23)
    widths = {"users": 3, "regions": 2, "every": 3, "odds": 2, "by-region": 2}
    with running_job(tmp_path, three_sinks(out, widths=widths)) as local:
        client = JsonClient(local.address, SERVICE)
        wait_for(lambda: local.status()["phase"] == "running", 120, "the job to run")
        for stage in rng.sample(sorted(widths), len(widths)):
            flowed = sum_out(local)
            wait_for(lambda f=flowed: sum_out(local) > f + 1500, 60, "records to flow")  # type: ignore[misc]
            width = rng.randrange(1, widths[stage])
            result = rescale_via(local, client, width, "hot-first", stage=stage)
            assert (result["stage"], result["to"]) == (stage, width)
            assert result["groups_moved"] == result["groups_to_move"] > 0, result
            widths[stage] = width
            desired = {s["name"]: s["desired"] for s in local.status()["stages"]}
            assert desired == {"clicks": 2, **widths}
        local.drain()
        final = wait_for(
            lambda: (s := local.status())["phase"] == "finished" and s, 120, "the job to drain"
        )
        client.close()
    emitted = [i["stats"]["emitted"] for i in final["stages"][0]["instances"]]
    check_sinks(out, emitted)


TOTAL = 24_000  # 12 s at 2k records/s: checkpoints, the crash and the recovery come before


def test_a_killed_instance_of_the_second_sink_recovers_every_sink_exactly_once(
    tmp_path: Path,
) -> None:
    """With checkpoints: an instance of `odds` (the second sink) is killed once checkpoints
    completed; the job goes back to its latest checkpoint, each sink truncating its own
    partitions to its own offsets there, and every sink's output is still its truth."""
    out = tmp_path / "out"
    job = three_sinks(out, {**SOURCE, "total": TOTAL})
    recover_through(tmp_path, job, lambda run: os.kill(run.pid_of("odds", 1), signal.SIGKILL))
    check_sinks(out, [instance_total(TOTAL, s, 2) or 0 for s in range(2)])
