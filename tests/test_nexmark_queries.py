"""The NEXMark query jobs of examples/nexmark/ run through real processes (a nexmark source, the
query's keyed stage, an output log) and answer what DuckDB answers over the same events
(tests/nexmark_reference.py, examples/nexmark/sql/), row for row: to the end, under live
rescales of the keyed stage with every strategy, and through a kill -9 with checkpoints."""

from __future__ import annotations

import json
import os
import random
import signal
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from keyshift.runtime.output_log import OutputLogReader
from keyshift.runtime.protocol import STRATEGIES
from keyshift.runtime.transport import JsonClient
from tests.conftest import BATCHING, running_job, state_settings, wait_for
from tests.nexmark_reference import run_query, source_events, write_events
from tests.test_recovery import Run, coordinator_pids, start_run
from tests.test_rescale import SERVICE, rescale_via, sum_out

pytestmark = [pytest.mark.slow, pytest.mark.live]

REPO = Path(__file__).resolve().parent.parent
TOTAL = 30_000
# 500 events per second of event time: 60 s of events, six 10 s windows for Q7 and Q8, in half
# the records (and run time: the queries run as fast as their processes go) of 1000 a second.
SOURCE = {"seed": 4, "event_rate": 500, "total": TOTAL, "max_disorder_ms": 50}
SOURCES = 2


def example(query: str, out: Path, **source: Any) -> dict[str, Any]:
    """The query's example job, its source finite and its output in `out`."""
    job = yaml.safe_load((REPO / "examples" / "nexmark" / f"{query}.yaml").read_text())
    stages = {stage["name"]: stage for stage in job["graph"]}
    config = stages["events"]["config"]
    config.pop("profile")
    config.update(SOURCE, **source)
    for stage in job["graph"]:
        if stage["kind"] in ("source", "map", "filter"):
            stage["parallelism"] = SOURCES  # chained into the source's processes
    stages["out"]["config"]["path"] = str(out)
    return job | {"batching": dict(BATCHING)}


def latest_values(out: Path) -> list[tuple[Any, Any, int]]:
    """(key, value, event time) of every output, each key's in the order the keyed stage made
    them."""
    table = OutputLogReader(out).read_all()
    return list(
        zip(
            table.column("key").to_pylist(),
            [json.loads(v) for v in table.column("value").to_pylist()],
            table.column("event_time").to_pylist(),
            strict=True,
        )
    )


def sessions_of(out: Path) -> list[tuple[Any, ...]]:
    """Q11's sessions as (bidder, start, end, bids), sorted; each fired once (no lateness: a
    session's result is never updated)."""
    table = OutputLogReader(out).read_all()
    columns = ("key", "window_start", "window_end", "value")
    sessions = list(zip(*(table.column(c).to_pylist() for c in columns), strict=True))
    twice = [s for s, n in Counter(s[:2] for s in sessions).items() if n > 1]
    assert not twice, f"{len(twice)} sessions fired more than once, e.g. {twice[:3]}"
    return sorted(sessions)


def rows_of(query: str, out: Path) -> list[tuple[Any, ...]]:
    """keyshift's answer as the rows of the query's SQL, sorted."""
    if query == "q11":
        return sessions_of(out)
    outputs = latest_values(out)
    if query in ("q0", "q1"):
        return sorted((k, v["bidder"], v["price"], t) for k, v, t in outputs)
    if query == "q2":
        return sorted((k, v) for k, v, _ in outputs)
    if query in ("q3", "q3_ttl"):
        return sorted(tuple(match) for _, matches, _ in outputs for match in matches)
    if query in ("q5", "q7"):
        # One result per window, keyed by the window's start: fired once, never updated.
        twice = [w for w, n in Counter(w for w, _, _ in outputs).items() if n > 1]
        assert not twice, f"{len(twice)} windows fired more than once, e.g. {twice[:3]}"
        if query == "q5":  # [highest count, its auctions]
            return sorted((w, a, top[0]) for w, top, _ in outputs for a in top[1])
        return sorted((w, *bid) for w, top, _ in outputs for bid in top[1])  # [price, bids]
    if query in ("q8", "early_bids"):  # a join: one output per pair, each pair once
        return sorted(tuple(row) for _, row, _ in outputs)
    raise AssertionError(f"no reading of {query}'s output")


def truth(tmp_path: Path, query: str, emitted: list[int] | None = None) -> list[tuple[Any, ...]]:
    """DuckDB's answer over the events the job's sources emitted (`emitted`, by instance), or
    over all of SOURCE's `total`."""
    events = source_events(SOURCE, SOURCES, emitted)
    return run_query(query, write_events(events, tmp_path / "events.parquet"))


def run_query_job(
    tmp_path: Path,
    job: dict[str, Any],
    during: Callable[[Any, JsonClient], None],
    drain: bool = False,
) -> list[int]:
    """Run `job` with the local host, calling `during` once records flow, until it finishes:
    by itself, or with `drain` once `during` returns (how a source without a total ends).
    Returns the events each source instance emitted."""
    with running_job(tmp_path, job) as local:
        client = JsonClient(local.address, SERVICE)
        try:
            wait_for(lambda: local.status()["phase"] == "running", 120, "the job to run")
            during(local, client)
            if drain:
                local.drain()
            final = wait_for(
                lambda: (s := local.status())["phase"] == "finished" and s, 120, "the job to end"
            )
        finally:
            client.close()
    return [int(i["stats"]["emitted"]) for i in final["stages"][0]["instances"]]


# The strategies a job's rescales take in turn, two runs covering the four: each state kind
# (windows, joins, sessions, timers) meets every strategy, scaling out with some and in with
# the others, in half the runs (and suite time) of one run per strategy. A test with several
# queries gives each the pairs the other way round, so each strategy also meets each direction.
STRATEGY_PAIRS: list[tuple[str, ...]] = [("hot-first", "lazy"), ("batched", "all-at-once")]


def strategy_runs(queries: Sequence[str]) -> list[Any]:
    """Parameters (query, strategies) for each query and each of STRATEGY_PAIRS, every other
    query's pairs reversed; ids such as `q7-hot-first+lazy`."""
    return [
        strategy_run(query, pair[:: -1 if i % 2 else 1])
        for i, query in enumerate(queries)
        for pair in STRATEGY_PAIRS
    ]


def strategy_run(query: str, strategies: tuple[str, ...]) -> Any:
    return pytest.param(query, strategies, id=f"{query}-{'+'.join(strategies)}")


def rescaling_mid_stream(
    steps: list[tuple[str, int]],
    strategies: str | Sequence[str],
    flow: int,
    hot_keys_stay: bool = False,
) -> Callable[[Any, JsonClient], None]:
    """`during` for a job whose source has no total (run it with `drain`): each rescale of
    `steps` (stage, parallelism) once `flow` more records left the sources, then TOTAL events
    at least, so the drained job has windows enough whatever time the rescales took. The
    events never run out before the test is done with them: it is the test that ends them.
    The rescales take `strategies` in turn (one name: all of them). Each rescale moves groups;
    with `hot_keys_stay` a scale-out may move none (the planner leaves a stage whose load is
    one or two keys as it is: moving them balances nothing), while a scale-in always moves
    the retired instances' groups."""
    turns = [strategies] if isinstance(strategies, str) else list(strategies)

    def rescales(local: Any, client: JsonClient) -> None:
        for i, (stage, parallelism) in enumerate(steps):
            strategy = turns[i % len(turns)]
            flowed = sum_out(local)

            def more(f: int = flowed) -> bool:
                return sum_out(local) > f + flow

            wait_for(more, 60, "records to flow")
            result = rescale_via(local, client, parallelism, strategy, stage=stage)
            assert result["groups_moved"] == result["groups_to_move"], result
            scale_out = result["to"] > result["from"]
            assert result["groups_to_move"] > 0 or (hot_keys_stay and scale_out), result

        def emitted() -> int:
            instances = local.status()["stages"][0]["instances"]
            return sum(int(i["stats"].get("emitted", 0)) for i in instances)

        wait_for(lambda: emitted() >= TOTAL, 60, f"{TOTAL} events")

    return rescales


def test_the_strategy_pairs_cover_every_strategy_each_way() -> None:
    runs = [param.values for param in strategy_runs(["a", "b"])]
    assert {s for pair in STRATEGY_PAIRS for s in pair} == set(STRATEGIES)
    out_in = {(pair[0], pair[1]) for _, pair in runs}
    assert {s for s, _ in out_in} == {s for _, s in out_in} == set(STRATEGIES)


# The stateless and simplest keyed queries. The others run to the end and answer what DuckDB
# answers in the tests below (through a kill -9: Q3, Q3 with a TTL, Q7, Q8 and Q11; under live
# rescales: Q7, Q8, Q11 and the early bids), and Q5 (two windowed stages) in test_windows.py.
@pytest.mark.parametrize("query", ["q0", "q1", "q2"])
def test_each_query_job_answers_what_duckdb_answers(tmp_path: Path, query: str) -> None:
    out = tmp_path / "out"
    run_query_job(tmp_path, example(query, out), lambda local, client: None)
    expected = truth(tmp_path, query)
    assert expected, f"{query} has no answer over these events: the test would prove nothing"
    assert rows_of(query, out) == expected


@pytest.mark.parametrize(
    ("query", "strategies"),
    [
        *strategy_runs(["q7", "q8", "q11"]),
        strategy_run("early_bids", ("hot-first",)),
        strategy_run("early_bids", ("lazy",)),
    ],
)
def test_the_windowed_queries_under_live_rescales_answer_what_duckdb_answers(
    tmp_path: Path, query: str, strategies: tuple[str, ...]
) -> None:
    """Q7 (an event-time window per 10 s with a reduce, keyed by window: each window fired
    once, `rows_of` checks), Q8 (a window join of people and auctions, keyed by person: each
    pair sent once) and Q11 (session windows per bidder, a thousand keys; each session fired
    once) go 2 -> 3 -> 1 while events flow, the early-bids interval join (keyed by auction)
    2 -> 1 (its join state is Q8's kind, which meets the other two strategies); they flow
    until the rescales are done, then the job is drained."""
    out = tmp_path / "out"
    job = example(query, out, total=None, profile={"rate": 4000})
    # Q8: people and auctions pass the source's filters, 4 of every 50 events; else the bids.
    flow = 400 if query == "q8" else 4000
    # Q7's load is the open window's key: 2 -> 3 may leave it where it is; 3 -> 1 moves it.
    stage = "early-bids" if query == "early_bids" else query
    steps = [(stage, 1)] if query == "early_bids" else [(stage, 3), (stage, 1)]
    during = rescaling_mid_stream(steps, strategies, flow=flow, hot_keys_stay=query == "q7")
    emitted = run_query_job(tmp_path, job, during, drain=True)
    assert rows_of(query, out) == truth(tmp_path, query, emitted)


@pytest.mark.parametrize(
    ("query", "victim"),
    # The coordinator's loss once, on Q8: its restart is the same whatever the query.
    [("q3", "keyed"), ("q3_ttl", "keyed"), ("q7", "keyed"), ("q11", "keyed"), ("q8", "keyed"),
     ("q8", "coordinator")],
)  # fmt: skip
def test_a_query_through_kill_minus_9_answers_what_duckdb_answers(
    tmp_path: Path, query: str, victim: str
) -> None:
    """Q3 (an incremental join, in memory; with a state TTL, its state expiring by event-time
    timers), Q7 (a window with a reduce), Q11 (session windows) and Q8 (a window join; the
    last three on RocksDB, whose checkpoints are native), checkpoints every 0.5 s: a keyed
    instance, or the coordinator, is killed; the job restarts from its latest checkpoint and
    the output equals DuckDB's, no match twice and no window or session fired twice."""
    out = tmp_path / "out"
    job = example(query, out, profile={"rate": 5000})
    stage = "q3" if query == "q3_ttl" else query  # q3_ttl's keyed stage is q3 too
    if query in ("q7", "q8", "q11"):
        keyed = next(s for s in job["graph"] if s["name"] == stage)
        keyed["state"] = state_settings("rocksdb", tmp_path)
    context, port = start_run(tmp_path, job)
    with context as proc:
        run = Run(proc, f"127.0.0.1:{port}")
        try:
            wait_for(lambda: run.completed() >= 2, 120, "two checkpoints")
            if victim == "keyed":
                os.kill(run.pid_of(stage, random.randint(0, 1)), signal.SIGKILL)
            else:
                (coordinator,) = coordinator_pids(run)
                os.kill(coordinator, signal.SIGKILL)
            code = proc.wait(timeout=180)
        finally:
            run.client.close()
        assert code == 0, run.output.text()
    assert "recovered from checkpoint" in run.output.text()
    assert rows_of(query, out) == truth(tmp_path, query)


def test_a_window_function_that_raises_fails_the_job_and_says_why(tmp_path: Path) -> None:
    """As a process function that raises does: its instance stops with the error in its log,
    and the job (no checkpoints) fails naming the instance; nothing goes on as if the window's
    records had been taken."""
    job = example("q7", tmp_path / "out", profile={"rate": 2000})
    q7 = next(stage for stage in job["graph"] if stage["name"] == "q7")
    q7["operator"]["reduce"] = "tests.job_fns:refuse_big_bids"
    with running_job(tmp_path, job) as local:
        status = wait_for(
            lambda: (s := local.status())["phase"] == "failed" and s, 60, "the job to fail"
        )
    assert any("q7/" in error for error in status["errors"]), status["errors"]
    logs = "".join(log.read_text() for log in (tmp_path / "logs").glob("q7-*.log"))
    assert "RefusedBid: bid" in logs
