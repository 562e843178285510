"""Jobs of several sources, with real processes: two generator sources of different seeds and
parallelisms unioned into one keyed stage (tests.job_fns:track emits each record's (count,
source, seq)), rescaled live under load, and recovered after a `kill -9` of a keyed instance
and of an instance of the second source with checkpoints on. The sink's output must equal the
truth recomputed from each source's seed: every (source id, seq) applied exactly once, in
order per key and sender, and the counts per key those of the records made. And NEXMark Q8
with each side of its window join from its own source (examples/nexmark/q8_sources.yaml, the
sources of different parallelisms, so the join's watermark is the minimum over three source
instances), rescaled live: its answer is DuckDB's. Two sources of different schemas (a
generator, an ingest endpoint) each feeding a keyed stage of its own, both into one sink. A
source that has ended holds no window back (as in a job of one source). The PySpark writer
(its two-phase batch writer, run on the driver as a task would) writes into the ingest source
it is pointed at, one of two.

A source instance's id is job-wide (`JobSpec.source_id`): the first source's are its indexes,
the second's start at MAX_PARALLELISM, so no two instances of different sources share one.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import yaml

from keyshift.runtime.generator import KeyGenerator, instance_total
from keyshift.runtime.ingest_client import IngestClient
from keyshift.runtime.job import MAX_PARALLELISM, GeneratorSource
from keyshift.runtime.output_log import OutputLogError, OutputLogReader
from keyshift.runtime.transport import JsonClient
from tests.conftest import BATCHING, ingest_address, latest_by_version, running_job, wait_for
from tests.nexmark_reference import run_query, source_events, write_events
from tests.test_nexmark_queries import REPO, rows_of
from tests.test_recovery import Run, recover_through
from tests.test_rescale import SERVICE, applied_once, rescale_via

pytestmark = pytest.mark.live

FIRST = {"kind": "generator", "keys": 1500, "distribution": "zipf", "seed": 41,
         "profile": {"rate": 2000}}  # fmt: skip
SECOND = {"kind": "generator", "keys": 1500, "distribution": "uniform", "seed": 42,
          "profile": {"rate": 1000}}  # fmt: skip


def two_sources(out: Path, first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """clicks (2 instances) and views (1) of one schema, unioned into `track` -> out."""
    return {
        "name": "two",
        "graph": [
            {"name": "clicks", "kind": "source", "parallelism": 2, "config": first},
            {"name": "views", "kind": "source", "parallelism": 1, "config": second},
            {
                "name": "track",
                "kind": "keyed",
                "inputs": ["clicks", "views"],
                "key_by": "key",
                "parallelism": 2,
                "operator": {"kind": "process", "function": "tests.job_fns:track"},
            },
            {
                "name": "out",
                "kind": "sink",
                "input": "track",
                "parallelism": 2,
                "config": {"kind": "log", "path": str(out), "format": "jsonl"},
            },
        ],
        "batching": {**BATCHING, "max_records": 1024},
    }


def check_truth(out: Path, made: dict[int, tuple[dict[str, Any], int]]) -> None:
    """The output applied each record once, in order per key and sender, and equals what the
    sources made: `made` is, by source id, the source's config and how many it emitted."""
    counts, seen = applied_once(out)
    want: Counter[int] = Counter()
    records = set()
    for source_id, (config, n) in made.items():
        keys, _ = KeyGenerator(GeneratorSource.model_validate(config), source_id).records(0, n)
        want.update(keys.tolist())
        records |= {(source_id, seq) for seq in range(n)}
    assert seen == records, f"{len(records - seen)} lost, {len(seen - records)} unknown"
    assert counts == want


def emitted_by_source_id(status: dict[str, Any]) -> dict[str, dict[int, int]]:
    """Each source stage's instances' emitted counts, by index."""
    return {
        stage["name"]: {i["index"]: int(i["stats"]["emitted"]) for i in stage["instances"]}
        for stage in status["stages"]
        if stage["name"] in ("clicks", "views")
    }


def test_a_keyed_stage_fed_by_two_sources_rescales_live_exactly_once(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with running_job(tmp_path, two_sources(out, FIRST, SECOND)) as local:
        client = JsonClient(local.address, SERVICE)
        wait_for(lambda: local.status()["phase"] == "running", 120, "the job to run")

        def flowed() -> int:
            stages = {s["name"]: s for s in local.status()["stages"]}
            return sum(i["stats"].get("records_in", 0) for i in stages["track"]["instances"])

        for parallelism, strategy in [(3, "hot-first"), (1, "batched")]:
            before = flowed()
            wait_for(lambda b=before: flowed() > b + 2000, 30, "records to flow")  # type: ignore[misc]
            result = rescale_via(local, client, parallelism, strategy)
            assert result["groups_moved"] == result["groups_to_move"] > 0, result
        local.drain()
        final = wait_for(
            lambda: (s := local.status())["phase"] == "finished" and s, 60, "the job to drain"
        )
        client.close()
    emitted = emitted_by_source_id(final)
    assert min(emitted["views"].values()) > 0 and min(emitted["clicks"].values()) > 0
    made = {i: (FIRST, n) for i, n in emitted["clicks"].items()}
    made |= {MAX_PARALLELISM + i: (SECOND, n) for i, n in emitted["views"].items()}
    check_truth(out, made)


@pytest.mark.parametrize("victim", ["track", "views"])
def test_a_kill_of_a_keyed_instance_or_of_the_second_source_recovers_exactly_once(
    tmp_path: Path, victim: str
) -> None:
    """Checkpoints every 0.5 s; after two, `kill -9` one instance: the job restarts from its
    latest checkpoint, every source instance from its own position there."""
    first, second = {**FIRST, "total": 10_000}, {**SECOND, "total": 5_000}
    out = tmp_path / "out"

    def crash(run: Run) -> None:
        done = run.completed()
        wait_for(lambda: run.completed() > done + random.randint(0, 1), 120, "a checkpoint")
        index = random.randint(0, 1) if victim == "track" else 0
        os.kill(run.pid_of(victim, index), signal.SIGKILL)

    recover_through(tmp_path, two_sources(out, first, second), crash)
    made = {i: (first, instance_total(10_000, i, 2) or 0) for i in range(2)}
    made[MAX_PARALLELISM] = (second, 5_000)
    check_truth(out, made)


def test_a_join_of_two_sources_answers_what_duckdb_answers_through_a_rescale(
    tmp_path: Path,
) -> None:
    """30 s of event time (three 10 s windows) from `people` (2 instances) and `sellers` (1),
    each making the same finite NEXMark stream; the join rescaled 2 -> 3 while it runs."""
    events = {"seed": 4, "event_rate": 1000, "total": 30_000, "max_disorder_ms": 50,
              "profile": {"rate": 6000}}  # fmt: skip
    out = tmp_path / "out"
    job = yaml.safe_load((REPO / "examples" / "nexmark" / "q8_sources.yaml").read_text())
    stages = {stage["name"]: stage for stage in job["graph"]}
    for name, parallelism in [("people", 2), ("persons", 2), ("sellers", 1), ("auctions", 1)]:
        stages[name]["parallelism"] = parallelism
        if "config" in stages[name]:
            stages[name]["config"] = {"kind": "nexmark", **events}
    stages["out"]["config"]["path"] = str(out)
    job["batching"] = dict(BATCHING)
    with running_job(tmp_path, job) as local:
        client = JsonClient(local.address, SERVICE)
        wait_for(lambda: local.status()["phase"] == "running", 120, "the job to run")
        result = rescale_via(local, client, 3, "hot-first", stage="q8")
        assert result["groups_moved"] == result["groups_to_move"] > 0, result
        wait_for(lambda: local.status()["phase"] == "finished", 60, "the sources to end")
        client.close()
    every = source_events(events, 1)
    expected = run_query("q8", write_events(every, tmp_path / "events.parquet"))
    assert expected, "Q8 has no answer over these events: the test would prove nothing"
    assert rows_of("q8", out) == expected


def test_the_spark_writer_writes_into_the_ingest_source_it_is_pointed_at(tmp_path: Path) -> None:
    pytest.importorskip("pyspark")
    from keyshift.spark.ingest_writer import KeyshiftBatchWriter

    rows = {"user": "str", "clicks": "int"}

    def ingest(name: str) -> dict[str, Any]:
        return {"name": name, "kind": "source", "fields": rows, "config": {"kind": "ingest"}}

    out = tmp_path / "out"
    job = {
        "name": "two-ingest",
        "graph": [
            ingest("web"),
            ingest("app"),
            {"name": "per-user", "kind": "keyed", "inputs": ["web", "app"], "key_by": "user",
             "operator": {"kind": "aggregate", "function": "sum", "field": "clicks"}},
            {"name": "out", "kind": "sink", "input": "per-user",
             "config": {"kind": "log", "path": str(out), "format": "jsonl"}},
        ],
        "batching": dict(BATCHING),
    }  # fmt: skip
    with running_job(tmp_path, job) as local:
        web = wait_for(lambda: ingest_address(local, "web"), 30, "web's ingest endpoint")
        app = wait_for(lambda: ingest_address(local, "app"), 30, "app's ingest endpoint")
        assert web != app
        writer = KeyshiftBatchWriter({"endpoint": app})
        batch = pa.record_batch({"user": ["ann", "bob"] * 50, "clicks": [1, 2] * 50})
        writer.commit([writer.write(iter([batch]))])
        other = KeyshiftBatchWriter({"endpoint": web})
        other.commit([other.write(iter([pa.record_batch({"user": ["ann"], "clicks": [10]})]))])

        def took() -> dict[str, int]:
            stages = {s["name"]: s for s in local.status()["stages"]}
            stats = {n: stages[n]["instances"][0]["stats"] for n in ("web", "app")}
            return {n: int(s.get("emitted", 0)) for n, s in stats.items()}

        wait_for(lambda: took() == {"web": 1, "app": 100}, 30, "each source to take its rows")
        local.drain()
        wait_for(lambda: local.status()["phase"] == "finished", 30, "the job to drain")
    latest = latest_by_version(out)
    assert {u: v for u, (_, v) in latest.items()} == {"ann": 60.0, "bob": 100.0}


def test_sources_of_different_schemas_feed_keyed_stages_of_their_own_into_one_sink(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    clicks = {**FIRST, "total": 4000}
    job = {
        "name": "two-shapes",
        "graph": [
            {"name": "clicks", "kind": "source", "parallelism": 2, "config": clicks},
            {"name": "views", "kind": "source", "fields": {"user": "int", "page": "str"},
             "config": {"kind": "ingest"}},
            {"name": "per-click", "kind": "keyed", "input": "clicks", "key_by": "key",
             "operator": {"kind": "process", "function": "tests.job_fns:track"}},
            {"name": "per-user", "kind": "keyed", "input": "views", "key_by": "user",
             "parallelism": 2,
             "operator": {"kind": "process", "function": "tests.job_fns:track"}},
            {"name": "out", "kind": "sink", "inputs": ["per-click", "per-user"],
             "parallelism": 2, "config": {"kind": "log", "path": str(out), "format": "jsonl"}},
        ],
        "batching": dict(BATCHING),
    }  # fmt: skip
    users = [i % 97 for i in range(3000)]
    with running_job(tmp_path, job) as local:
        endpoint = wait_for(lambda: ingest_address(local, "views"), 30, "views' endpoint")
        with IngestClient(endpoint) as client:
            for start in range(0, len(users), 1000):
                part = users[start : start + 1000]
                reply = client.push(pa.table({"user": part, "page": ["home"] * len(part)}))
                assert (reply.accepted, reply.rejected) == (len(part), 0)

        def done() -> bool:
            stages = {s["name"]: s for s in local.status()["stages"]}
            made = [int(i["stats"].get("emitted", 0)) for i in stages["clicks"]["instances"]]
            return sum(made) == 4000

        wait_for(done, 30, "the generator to make its total")
        local.drain()
        wait_for(lambda: local.status()["phase"] == "finished", 30, "the job to drain")
    # Each keyed stage applied each of its source's records once, in order per key; the keys
    # of the two stages are told apart by their records' source ids.
    applied: dict[tuple[bool, int], list[tuple[int, int, int]]] = {}
    table = OutputLogReader(out).read_all()
    for key, value in zip(table.column("key").to_pylist(), table.column("value").to_pylist(),
                          strict=True):  # fmt: skip
        count, sender, seq = json.loads(value)
        applied.setdefault((sender >= MAX_PARALLELISM, key), []).append((count, sender, seq))
    for where, outputs in applied.items():
        outputs.sort()
        assert [c for c, _, _ in outputs] == list(range(1, len(outputs) + 1)), where
        for sender in {s for _, s, _ in outputs}:
            seqs = [q for _, s, q in outputs if s == sender]
            assert seqs == sorted(seqs), (where, sender)
    want: dict[tuple[bool, int], set[tuple[int, int]]] = {}
    spec = GeneratorSource.model_validate(clicks)
    for source_id in range(2):
        keys, _ = KeyGenerator(spec, source_id).records(0, instance_total(4000, source_id, 2) or 0)
        for seq, key in enumerate(keys.tolist()):
            want.setdefault((False, key), set()).add((source_id, seq))
    for seq, user in enumerate(users):
        want.setdefault((True, user), set()).add((MAX_PARALLELISM, seq))
    got = {where: {(sender, seq) for _, sender, seq in o} for where, o in applied.items()}
    assert got == want


def test_a_source_that_has_ended_holds_no_window_back(tmp_path: Path) -> None:
    """`short` makes 300 records and ends; `long` goes on: windows after short's last record
    still fire on long's watermark alone."""
    out = tmp_path / "out"
    timed = {"max_out_of_orderness_ms": 0}
    short = {**FIRST, "total": 300, "profile": {"rate": 1000}}
    job = {
        "name": "ended",
        "graph": [
            {"name": "short", "kind": "source", "config": short, "event_time": timed},
            {"name": "long", "kind": "source", "config": SECOND, "event_time": timed},
            {"name": "per-key", "kind": "keyed", "inputs": ["short", "long"], "key_by": "key",
             "operator": {"kind": "window", "window": {"kind": "tumbling", "size_ms": 200},
                          "function": "count"}},
            {"name": "out", "kind": "sink", "input": "per-key",
             "config": {"kind": "log", "path": str(out), "format": "jsonl"}},
        ],
        "batching": dict(BATCHING),
    }  # fmt: skip
    with running_job(tmp_path, job) as local:

        def short_ended() -> bool:
            stages = {s["name"]: s for s in local.status()["stages"]}
            instances = stages["short"]["instances"]
            return bool(instances) and all(i["finished"] for i in instances)

        wait_for(short_ended, 30, "the short source to end")
        ended_us = time.time_ns() // 1000

        def fired_after() -> bool:
            try:
                table = OutputLogReader(out).read_all()
            except OutputLogError:  # nothing written yet
                return False
            if "window_start" not in table.column_names:  # no window has fired yet
                return False
            return any(start > ended_us for start in table.column("window_start").to_pylist())

        wait_for(fired_after, 30, "a window after the short source ended to fire")
        local.drain()
        wait_for(lambda: local.status()["phase"] == "finished", 30, "the job to drain")
