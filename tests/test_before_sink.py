"""A filter and a map between a keyed stage and its sink, chained into the keyed instances,
with real processes: clicks -> track (process) -> odd (filter) -> wrap (map) -> out. One
`track` instance is killed with checkpoints on; at the end the sink's output holds every
update of the odd keys exactly once, in order per key and sender, wrapped by the map, and
the counts equal the truth computed from the sources' seed (the even keys filtered out)."""

from __future__ import annotations

import os
import random
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.test_end_to_end import generated
from tests.test_recovery import Run, recover_through
from tests.test_rescale import applied_once

pytestmark = [pytest.mark.live, pytest.mark.slow]

# 5 s at 3k records/s: the kill comes after two checkpoints, well before the sources end.
SOURCE = {"kind": "generator", "keys": 500, "distribution": "zipf", "seed": 23,
          "profile": {"rate": 3000}, "total": 15_000}  # fmt: skip


def filtered_job(out: Path) -> dict[str, Any]:
    return {
        "name": "odd",
        "graph": [
            {"name": "clicks", "kind": "source", "parallelism": 2, "config": SOURCE},
            {"name": "track", "kind": "keyed", "input": "clicks", "key_by": "key",
             "parallelism": 2,
             "operator": {"kind": "process", "function": "tests.job_fns:track"}},
            {"name": "odd", "kind": "filter", "input": "track",
             "function": "tests.job_fns:odd_key"},
            {"name": "wrap", "kind": "map", "input": "odd", "function": "tests.job_fns:wrapped"},
            {"name": "out", "kind": "sink", "input": "wrap", "parallelism": 2,
             "config": {"kind": "log", "path": str(out), "format": "jsonl"}},
        ],
        "batching": {"max_records": 1024},
    }  # fmt: skip


def test_a_filter_and_a_map_before_the_sink_recover_exactly_once(tmp_path: Path) -> None:
    def crash(run: Run) -> None:
        os.kill(run.pid_of("track", random.randint(0, 1)), signal.SIGKILL)

    out = tmp_path / "out"
    recover_through(tmp_path, filtered_job(out), crash)
    counts, seen = applied_once(out, lambda value: value["tracked"])
    odd = [(source, seq, key) for source, seq, key, _ in generated(SOURCE, 2) if key % 2]
    assert seen == {(source, seq) for source, seq, _ in odd}
    assert counts == Counter(key for _, _, key in odd)
