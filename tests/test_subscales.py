"""The subscale planner (keyshift.runtime.subscales), pure: how a rescale's move is divided into
subscales and which of them run side by side. The live runs are in tests/test_rescale.py, the
driver's recovery with concurrent subscales in tests/test_rescale_recovery.py."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyshift.runtime.assignment_planner import moves, plan
from keyshift.runtime.rescale import RescaleError, options_for
from keyshift.runtime.subscales import Subscale, divide, startable

GROUPS = 256


def owners_of(parallelism: int) -> np.ndarray:
    return (np.arange(GROUPS) * parallelism // GROUPS).astype(np.int32)


def check_division(old: np.ndarray, new: np.ndarray, subscales: list[Subscale]) -> None:
    """Every moving group in exactly one subscale, under the pair it moves between."""
    seen = np.concatenate([s.groups for s in subscales]) if subscales else np.array([], int)
    assert sorted(seen.tolist()) == np.flatnonzero(old != new).tolist()
    for subscale in subscales:
        for (src, dst), groups in subscale.pairs.items():
            assert (old[groups] == src).all() and (new[groups] == dst).all()


def test_a_scale_out_1_to_3_gives_one_subscale_per_new_owner() -> None:
    old, load = owners_of(1), np.ones(GROUPS)
    new = plan(old, 3, load)
    subscales = divide(old, new, load, None, per_pair=True)
    assert sorted(p for s in subscales for p in s.pairs) == [(0, 1), (0, 2)]
    check_division(old, new, subscales)
    # Both leave instance 0: one at a time, the other once the first is done.
    assert startable(subscales, [], concurrent=True) == [0]
    assert startable(subscales[1:], [subscales[0]], concurrent=True) == []
    assert startable(subscales[1:], [], concurrent=True) == [0]


def test_a_scale_out_2_to_4_runs_its_disjoint_pairs_side_by_side() -> None:
    old, load = owners_of(2), np.ones(GROUPS)
    new = plan(old, 4, load)
    subscales = divide(old, new, load, None, per_pair=True)
    assert sorted(p for s in subscales for p in s.pairs) == [(0, 2), (1, 3)]
    assert startable(subscales, [], concurrent=True) == [0, 1]
    # Without concurrent subscales, one at a time.
    assert startable(subscales, [], concurrent=False) == [0]
    assert startable(subscales[1:], subscales[:1], concurrent=False) == []


def test_batches_cap_each_subscale_and_keep_a_pairs_hottest_first() -> None:
    old = owners_of(1)
    load = np.random.default_rng(3).pareto(1.2, GROUPS)
    new = plan(old, 2, load)
    subscales = divide(old, new, load, 10, per_pair=True)
    check_division(old, new, subscales)
    assert all(len(s.groups) <= 10 and len(s.pairs) == 1 for s in subscales)
    loads = [s.load for s in subscales]
    assert loads == sorted(loads, reverse=True)
    order = np.concatenate([s.groups for s in subscales])
    assert (np.diff(load[order]) <= 0).all()  # one pair: its groups hottest first throughout


def test_without_per_pair_a_subscale_is_a_global_step() -> None:
    old, load = owners_of(2), np.arange(GROUPS, dtype=np.float64)
    new = plan(old, 4, load)
    (whole,) = divide(old, new, load, None, per_pair=False)
    assert set(whole.pairs) == set(moves(old, new)) and len(whole.pairs) > 1
    steps = divide(old, new, load, 16, per_pair=False)
    check_division(old, new, steps)
    assert [len(s.groups) for s in steps[:-1]] == [16] * (len(steps) - 1)
    assert steps[0].load == max(s.load for s in steps)


def test_nothing_moves_no_subscale_and_bad_batches_refused() -> None:
    old, load = owners_of(2), np.ones(GROUPS)
    assert divide(old, old.copy(), load, None, per_pair=True) == []
    assert divide(old, old.copy(), load, 4, per_pair=False) == []
    assert startable([], [], concurrent=True) == []
    with pytest.raises(ValueError, match="batch_groups must be >= 1"):
        divide(old, plan(old, 3, load), load, 0, per_pair=True)


@settings(max_examples=30, deadline=None)
@given(
    old_p=st.integers(1, 6),
    new_p=st.integers(1, 6),
    batch=st.one_of(st.none(), st.integers(1, 40)),
    seed=st.integers(0, 10_000),
)
def test_division_and_schedule_properties(
    old_p: int, new_p: int, batch: int | None, seed: int
) -> None:
    """Disjoint groups; one pair each; running together, disjoint sources and destinations;
    a schedule that starts everything."""
    old = owners_of(old_p)
    load = np.random.default_rng(seed).zipf(1.5, GROUPS).astype(np.float64)
    new = plan(old, new_p, load)
    subscales = divide(old, new, load, batch, per_pair=True)
    check_division(old, new, subscales)
    assert all(len(s.pairs) == 1 for s in subscales)
    if batch is not None:
        assert all(len(s.groups) <= batch for s in subscales)
    waiting, rounds = list(subscales), 0
    running: list[Subscale] = []
    while waiting:
        chosen = startable(waiting, running, concurrent=True)
        running += [waiting[i] for i in chosen]
        waiting = [s for i, s in enumerate(waiting) if i not in chosen]
        sources = [src for s in running for src in s.sources]
        destinations = [dst for s in running for dst in s.destinations]
        assert len(sources) == len(set(sources)) and len(destinations) == len(set(destinations))
        assert running, "nothing could start"
        running.pop(0)  # the oldest completes
        rounds += 1
    assert rounds <= len(subscales)


def test_the_subscales_option_is_0_or_1_and_only_for_hot_first_and_batched() -> None:
    assert "subscales" not in options_for("hot-first", {})  # on unless given
    assert options_for("batched", {"subscales": 0})["subscales"] == 0.0
    for value in (2, -1, 0.5, "1", True, None):
        with pytest.raises(
            RescaleError, match=re.escape("option 'subscales' must be 1 (concurrent sub")
        ):
            options_for("hot-first", {"subscales": value})
    for strategy in ("all-at-once", "lazy"):
        with pytest.raises(RescaleError, match=f"'subscales' does not apply to {strategy}"):
            options_for(strategy, {"subscales": 1})
