"""NEXMark Q4 and Q6 (examples/nexmark/q4.yaml, q6.yaml: auctions closed by event-time timers in
one keyed stage, closing prices averaged in a second) run through real processes and answer
what DuckDB answers over the same events (examples/nexmark/sql/q4.sql, q6.sql), row for row:
to the end, under live rescales of each keyed stage with every strategy, Q6 through a kill -9
of a keyed instance with checkpoints."""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path
from typing import Any

import pytest

from examples.nexmark import closing
from examples.nexmark.closing_pipeline import closing_query
from keyshift.runtime.job import load_job
from keyshift.runtime.output_log import OutputLogReader
from keyshift.runtime.timers import TimerService
from tests.conftest import wait_for
from tests.test_nexmark_queries import (
    REPO,
    example,
    latest_values,
    rescaling_mid_stream,
    run_query_job,
    strategy_runs,
    truth,
)
from tests.test_recovery import Run, start_run

QUERIES = ("q4", "q6")


def rows_of(query: str, out: Path) -> list[tuple[Any, ...]]:
    """keyshift's answer as the rows of the query's SQL, sorted. Q4: a category's running
    mean changes with every auction closed in it, so its last output is its answer; Q6: each
    closed auction's output is a row of its own."""
    if query == "q4":
        table = OutputLogReader(out).read_all()
        keys, means = table.column("key").to_pylist(), table.column("value").to_pylist()
        return sorted(dict(zip(keys, means, strict=True)).items())
    return sorted((seller, *row) for seller, rows, _ in latest_values(out) for row in rows)


def approx_rows(rows: list[tuple[Any, ...]]) -> Any:
    """The means are floats summed in another order than DuckDB's."""
    return [pytest.approx(row, rel=1e-12) for row in rows]


def test_the_python_twins_build_the_job_files() -> None:
    for query in QUERIES:
        expected = load_job(REPO / "examples" / "nexmark" / f"{query}.yaml")
        assert closing_query(query).build() == expected  # type: ignore[arg-type]


def bid(auction: int, price: int, at: int) -> dict[str, Any]:
    return {"kind": "bid", "auction": auction, "price": price, "event_time": at}


def test_an_auction_closes_with_its_highest_bid_at_or_above_the_reserve_while_open() -> None:
    timers = TimerService(event_time=True)
    opened = {"kind": "auction", "auction": 7, "reserve": 100, "expires": 50, "category": 3,
              "seller": 9, "event_time": 10}  # fmt: skip
    state: Any = None
    for record in [
        bid(7, 500, 5),  # before its auction came, and before it opened: does not count
        bid(7, 150, 12),  # before its auction came (disorder), while it is open: counts
        opened,
        bid(7, 90, 20),  # under the reserve
        bid(7, 120, 50),  # at `expires`: counts, but lower
        bid(7, 900, 51),  # after `expires`
    ]:
        state, output = closing.winning_bid(state, record, timers)
        assert output is None
    assert timers.event_time_timers() == (51,)  # the early bids' timers are gone
    assert closing.close_auction(state, 7, 51, "event", timers) == (None, [7, 3, 9, 150, 50])


def test_an_auction_without_a_qualifying_bid_closes_with_nothing_and_forgets_it() -> None:
    timers = TimerService(event_time=True)
    opened = {"kind": "auction", "auction": 7, "reserve": 100, "expires": 50, "category": 3,
              "seller": 9, "event_time": 10}  # fmt: skip
    state, _ = closing.winning_bid(None, opened, timers)
    state, _ = closing.winning_bid(state, bid(7, 99, 20), timers)
    assert closing.close_auction(state, 7, 51, "event", timers) == (None, None)


def test_bids_whose_auction_never_came_are_forgotten_once_the_watermark_passes_them() -> None:
    timers = TimerService(event_time=True)
    state: Any
    state, _ = closing.winning_bid(None, bid(7, 150, 12), timers)
    state, _ = closing.winning_bid(state, bid(7, 160, 30), timers)
    state, output = closing.close_auction(state, 7, 13, "event", timers)
    assert output is None and state is not None and state["early"] == [[160, 30]]
    assert closing.close_auction(state, 7, 31, "event", timers) == (None, None)


def test_q6_takes_closings_in_closing_order_whatever_order_they_came_in() -> None:
    timers = TimerService(event_time=True)
    state: Any = None
    # Auction 2 closed first, auction 1 at the same time; they came from two instances.
    for auction, price, expires in [(3, 30, 20), (1, 10, 10), (2, 20, 10)]:
        closed = {"auction": auction, "price": price, "expires": expires,
                  "event_time": expires + 1}  # fmt: skip
        state, output = closing.last_closed(state, closed, timers)
        assert output is None
    assert timers.event_time_timers() == (12, 22)
    state, rows = closing.average_last(state, 5, 12, "event", timers)
    assert rows == [[1, 10.0], [2, 15.0]]
    state, rows = closing.average_last(state, 5, 22, "event", timers)
    assert rows == [[3, 20.0]] and state["waiting"] == []


def test_q6_averages_the_last_ten_closings_only() -> None:
    timers = TimerService(event_time=True)
    state: Any = None
    for n in range(12):
        closed = {"auction": n, "price": n, "expires": 0, "event_time": 1}
        state, _ = closing.last_closed(state, closed, timers)
    _, rows = closing.average_last(state, 5, 2, "event", timers)
    assert rows is not None and rows[-1] == [11, sum(range(2, 12)) / 10]


@pytest.mark.live
@pytest.mark.parametrize("query", QUERIES)
def test_the_query_answers_what_duckdb_answers(tmp_path: Path, query: str) -> None:
    out = tmp_path / "out"
    run_query_job(tmp_path, example(query, out), lambda local, client: None)
    expected = truth(tmp_path, query)
    assert expected, f"{query} has no answer over these events: the test would prove nothing"
    assert rows_of(query, out) == approx_rows(expected)


@pytest.mark.live
@pytest.mark.slow
@pytest.mark.parametrize(("query", "strategies"), strategy_runs(QUERIES))
def test_the_query_under_live_rescales_of_both_keyed_stages_answers_what_duckdb_answers(
    tmp_path: Path, query: str, strategies: tuple[str, ...]
) -> None:
    """Auctions with their bids and closing timers move while bids flow (each closes once, by
    one strategy of the pair), then the second stage moves (by the other): Q4's running means
    per category, Q6's sellers with the
    closings they wait to take in closing order (none may come after the watermark passed it,
    or it would be taken out of order)."""
    out = tmp_path / "out"
    job = example(query, out, total=None, profile={"rate": 10000})
    during = rescaling_mid_stream([("close", 3), (query, 3)], strategies, flow=2000)
    emitted = run_query_job(tmp_path, job, during, drain=True)
    assert rows_of(query, out) == approx_rows(truth(tmp_path, query, emitted))


@pytest.mark.live
@pytest.mark.slow
def test_q6_through_kill_minus_9_answers_what_duckdb_answers(tmp_path: Path) -> None:
    """Checkpoints every 0.5 s; an instance of the auction-closing stage is killed: the job
    restarts from its latest checkpoint and no auction closes twice or never."""
    out = tmp_path / "out"
    job = example("q6", out, profile={"rate": 10000})
    context, port = start_run(tmp_path, job)
    with context as proc:
        run = Run(proc, f"127.0.0.1:{port}")
        try:
            wait_for(lambda: run.completed() >= 2, 120, "two checkpoints")
            os.kill(run.pid_of("close", random.randint(0, 1)), signal.SIGKILL)
            code = proc.wait(timeout=180)
        finally:
            run.client.close()
        assert code == 0, run.output.text()
    assert "recovered from checkpoint" in run.output.text()
    assert rows_of("q6", out) == approx_rows(truth(tmp_path, "q6"))
