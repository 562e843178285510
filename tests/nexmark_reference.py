"""The reference engine for NEXMark: the events a `kind: nexmark` source makes, written to
Parquet, and each query of examples/nexmark/sql/ run over them by DuckDB. The NEXMark tests
(tests/test_nexmark.py, tests/test_nexmark_queries.py) compare keyshift's answers with these.

DuckDB sees three views over one table of events: `person`, `auction` and `bid`, each with all
the columns of `keyshift.runtime.nexmark.FIELDS` plus `event_time` (epoch µs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from keyshift.runtime import nexmark
from keyshift.runtime.generator import instance_total
from keyshift.runtime.job import NexmarkSource

SQL = Path(__file__).resolve().parent.parent / "examples" / "nexmark" / "sql"
QUERIES = (*(f"q{n}" for n in range(9)), "q11")


def source_events(
    config: dict[str, Any], parallelism: int, emitted: list[int] | None = None
) -> pa.Table:
    """Every event a nexmark source of `parallelism` instances makes, as the instances number
    them: each instance's share of the `total`, or its first `emitted[i]` events (a source
    without a total that was drained)."""
    source = NexmarkSource.model_validate({"kind": "nexmark", **config})
    if emitted is None:
        if source.total is None:
            raise ValueError("the reference engine needs a source with a total or its counts")
        emitted = [instance_total(source.total, i, parallelism) or 0 for i in range(parallelism)]
    if len(emitted) != parallelism:
        raise ValueError(f"{len(emitted)} counts for a source of {parallelism} instances")
    numbers = [nexmark.event_numbers(i, parallelism, 0, n) for i, n in enumerate(emitted)]
    return pa.Table.from_batches([nexmark.events(source.model(), np.concatenate(numbers))])


def write_events(table: pa.Table, path: Path) -> Path:
    pq.write_table(table, path)
    return path


def run_query(query: str, parquet: Path) -> list[tuple[Any, ...]]:
    """Query `query` (q0 .. q8, q11) over the events in `parquet`: its rows, sorted."""
    sql = (SQL / f"{query}.sql").read_text()
    with duckdb.connect() as db:
        db.execute(f"CREATE VIEW events AS SELECT * FROM read_parquet('{parquet}')")
        for kind in nexmark.KINDS:
            db.execute(f"CREATE VIEW {kind} AS SELECT * FROM events WHERE kind = '{kind}'")
        rows = db.execute(sql).fetchall()
    return sorted(rows)
