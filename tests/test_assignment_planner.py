"""Tests of keyshift.runtime.assignment_planner: load-balanced, minimal-movement group plans."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyshift.runtime.assignment_planner import instance_loads, moves, plan
from keyshift.runtime.keyspace import Assignment

G = 4096
TOL = 0.05
EPS = 1e-9


def zipf_loads(count: int, exponent: float, seed: int) -> np.ndarray:
    """Zipf-like group loads (rank r has load 1000 / r**exponent), ranks spread at random."""
    rng = np.random.default_rng(seed)
    return rng.permutation(1000.0 / np.arange(1, count + 1) ** exponent)


def effective(load: np.ndarray) -> np.ndarray:
    """The loads the planner balances: all zeros count every group as 1."""
    return load if load.any() else np.ones(len(load))


def check_valid(new: np.ndarray, old: np.ndarray, parallelism: int) -> None:
    assert new.dtype == np.int32
    assert new.shape == old.shape
    assert new.min() >= 0
    assert new.max() < parallelism


def check_locally_optimal(new: np.ndarray, load: np.ndarray, parallelism: int, tol: float) -> None:
    """Every instance above the limit is stuck: no group of it could go to the least loaded
    instance and lower its load without putting that instance as high (group granularity)."""
    load = effective(load)
    loads = instance_loads(new, load, parallelism)
    limit = load.sum() / parallelism * (1 + tol)
    slack = EPS * max(load.sum(), 1.0)
    for instance in np.flatnonzero(loads > limit + slack):
        mine = load[new == instance]
        gap = loads[instance] - loads.min()
        helpful = (mine > slack) & (mine < gap - slack)
        assert not helpful.any(), (instance, loads[instance], gap, mine[helpful][:5])


def balanced_random_owners(count: int, parallelism: int, seed: int) -> np.ndarray:
    """Group counts that differ by at most one between instances, groups spread at random."""
    rng = np.random.default_rng(seed)
    return rng.permutation(np.arange(count) % parallelism).astype(np.int32)


# --- examples -------------------------------------------------------------------------------


def test_same_parallelism_returns_a_balanced_assignment_unchanged() -> None:
    owners = Assignment.contiguous(G, 4).owners
    assert np.array_equal(plan(owners, 4, np.ones(G)), owners)
    assert np.array_equal(plan(owners, 4, np.zeros(G)), owners)
    load = zipf_loads(G, 1.0, seed=0)
    balanced = plan(np.zeros(G, np.int32), 4, load)
    assert np.array_equal(plan(balanced, 4, load), balanced)
    assert not moves(balanced, plan(balanced, 4, load))


def test_same_parallelism_rebalances_a_skewed_assignment_by_moving_little() -> None:
    load = zipf_loads(G, 1.0, seed=1)
    owners = Assignment.contiguous(G, 4).owners
    new = plan(owners, 4, load)
    loads = instance_loads(new, load, 4)
    assert loads.max() <= load.sum() / 4 * (1 + TOL)
    assert (new != owners).mean() < 0.05


def test_scale_out_1_to_2_uniform_moves_about_half_and_balances() -> None:
    old = np.zeros(G, np.int32)
    new = plan(old, 2, np.ones(G))
    check_valid(new, old, 2)
    counts = np.bincount(new, minlength=2)
    assert counts.max() <= G / 2 * (1 + TOL)
    # Exactly what the tolerance requires: instance 0 keeps floor(limit) groups.
    assert counts[0] == math.floor(G / 2 * (1 + TOL))
    assert 0.45 * G <= (new != old).sum() <= 0.5 * G
    assert list(moves(old, new)) == [(0, 1)]


def test_scale_out_2_to_4_uniform_moves_only_old_to_new_and_the_minimum() -> None:
    old = Assignment.contiguous(G, 2).owners
    new = plan(old, 4, np.ones(G))
    check_valid(new, old, 4)
    limit = G / 4 * (1 + TOL)
    counts = np.bincount(new, minlength=4)
    assert counts.max() <= limit
    pairs = moves(old, new)
    assert all(src < 2 <= dst for src, dst in pairs)
    old_counts = np.bincount(old, minlength=2)
    minimum = int(np.maximum(old_counts - math.floor(limit), 0).sum())
    assert (new != old).sum() == minimum


def test_scale_in_4_to_3_uniform_moves_only_the_retired_instance() -> None:
    old = Assignment.contiguous(G, 4).owners
    new = plan(old, 3, np.ones(G))
    check_valid(new, old, 3)
    moved = new != old
    assert np.array_equal(moved, old == 3)
    assert np.bincount(new, minlength=3).max() <= G / 3 * (1 + TOL)
    assert {src for src, _ in moves(old, new)} == {3}


@pytest.mark.parametrize("seed", range(5))
def test_scale_in_4_to_3_skewed_moves_only_the_retired_instance(seed: int) -> None:
    load = zipf_loads(G, 1.0, seed)
    old = plan(np.zeros(G, np.int32), 4, load)  # a balanced 4-instance start
    new = plan(old, 3, load)
    check_valid(new, old, 3)
    assert np.array_equal(new != old, old == 3)
    assert instance_loads(new, load, 3).max() <= load.sum() / 3 * (1 + TOL)


def test_scale_in_to_one_instance_moves_everything_there() -> None:
    old = Assignment.contiguous(G, 5).owners
    new = plan(old, 1, zipf_loads(G, 1.0, seed=2))
    assert not new.any()


@pytest.mark.parametrize(
    ("old_p", "new_p", "exponent"),
    [(1, 2, 1.0), (2, 4, 1.0), (4, 3, 1.0), (1, 8, 1.2), (3, 16, 0.8), (8, 5, 1.5), (1, 64, 1.0)],
)
@pytest.mark.parametrize("seed", range(3))
def test_skewed_loads_balance_within_tolerance_or_the_heaviest_group(
    old_p: int, new_p: int, exponent: float, seed: int
) -> None:
    load = zipf_loads(G, exponent, seed)
    old = Assignment.contiguous(G, old_p).owners
    new = plan(old, new_p, load)
    check_valid(new, old, new_p)
    loads = instance_loads(new, load, new_p)
    mean = load.sum() / new_p
    assert loads.max() <= max(mean * (1 + TOL), load.max()) * (1 + EPS)
    check_locally_optimal(new, load, new_p, TOL)
    assert np.isclose(loads.sum(), load.sum())


def test_skewed_scale_out_moves_few_groups() -> None:
    load = zipf_loads(G, 1.0, seed=3)
    old = np.zeros(G, np.int32)
    new = plan(old, 2, load)
    moved = new != old
    # Half the load must move; the planner moves it in few (heavy) groups.
    assert 0.45 <= load[moved].sum() / load.sum() <= 0.5
    assert moved.sum() < 0.05 * G


def test_one_group_heavier_than_the_mean_gets_an_instance_alone() -> None:
    load = np.ones(1000)
    load[17] = 600.0  # mean over 4 instances is 399.75
    new = plan(np.zeros(1000, np.int32), 4, load)
    loads = instance_loads(new, load, 4)
    assert loads.max() == 600.0
    assert (new == new[17]).sum() == 1  # alone on its instance
    # The others need only be within the tolerance of the overall mean: the heavy instance is
    # the bottleneck anyway, and balancing them further would move groups for nothing.
    assert np.delete(loads, new[17]).max() <= load.sum() / 4 * (1 + TOL)


def test_a_swap_balances_when_no_single_move_can() -> None:
    # Instance 0 holds two groups of 0.6: moving one anywhere would make that instance 1.5.
    old = np.array([0, 0, 1, 1, 2, 2], np.int32)
    load = np.array([0.6, 0.6, 0.45, 0.45, 0.45, 0.45])
    new = plan(old, 3, load)
    assert np.isclose(instance_loads(new, load, 3).max(), 1.05)
    assert (new != old).sum() == 2
    assert list(moves(old, new)) == [(0, 1), (1, 0)]


def test_all_zero_loads_balance_group_counts() -> None:
    old = np.zeros(G, np.int32)
    new = plan(old, 3, np.zeros(G))
    check_valid(new, old, 3)
    counts = np.bincount(new, minlength=3)
    assert counts.max() <= G / 3 * (1 + TOL)
    assert counts.min() >= G / 3 * (1 - 2 * TOL)
    shrunk = plan(Assignment.contiguous(G, 5).owners, 3, np.zeros(G))
    assert np.bincount(shrunk, minlength=3).max() <= G / 3 * (1 + TOL)


def test_zero_tolerance_balances_uniform_counts_exactly() -> None:
    new = plan(np.zeros(G, np.int32), 3, np.ones(G), tolerance=0.0)
    counts = np.bincount(new, minlength=3)
    assert counts.max() - counts.min() <= 1


def test_as_many_instances_as_groups_gives_each_one_group() -> None:
    new = plan(np.zeros(64, np.int32), 64, np.zeros(64))
    assert sorted(new.tolist()) == list(range(64))
    # With skew, light groups may share an instance while it stays within the tolerance.
    load = zipf_loads(64, 1.0, seed=4)
    skewed = plan(np.zeros(64, np.int32), 64, load)
    loads = instance_loads(skewed, load, 64)
    assert loads.max() == load.max()
    assert (loads[np.bincount(skewed, minlength=64) > 1] <= load.sum() / 64 * (1 + TOL)).all()


def test_inputs_are_not_modified_and_other_dtypes_work() -> None:
    owners = Assignment.contiguous(G, 2).owners.astype(np.int64)
    load = np.arange(G, dtype=np.int64)
    kept_owners, kept_load = owners.copy(), load.copy()
    new = plan(owners, 3, load)  # type: ignore[arg-type]  # ints where the signature says floats
    check_valid(new, owners, 3)
    assert np.array_equal(owners, kept_owners)
    assert np.array_equal(load, kept_load)


# --- moves and instance_loads ---------------------------------------------------------------


def test_moves_groups_pairs_in_order() -> None:
    old = np.array([0, 0, 1, 1, 2, 2, 0], np.int32)
    new = np.array([0, 1, 1, 0, 1, 0, 1], np.int32)
    pairs = moves(old, new)
    assert list(pairs) == [(0, 1), (1, 0), (2, 0), (2, 1)]
    assert pairs[(0, 1)].tolist() == [1, 6]
    assert pairs[(1, 0)].tolist() == [3]
    assert pairs[(2, 0)].tolist() == [5]
    assert pairs[(2, 1)].tolist() == [4]
    assert all(groups.dtype == np.int32 for groups in pairs.values())
    assert moves(old, old) == {}


def test_moves_applied_to_old_give_new() -> None:
    load = zipf_loads(G, 1.0, seed=5)
    old = Assignment.contiguous(G, 3).owners
    new = plan(old, 5, load)
    rebuilt = old.copy()
    for (src, dst), groups in moves(old, new).items():
        assert (old[groups] == src).all()
        rebuilt[groups] = dst
    assert np.array_equal(rebuilt, new)


def test_instance_loads_sums_per_instance() -> None:
    owners = np.array([0, 2, 2, 0, 1], np.int32)
    load = np.array([1.0, 2.0, 3.0, 4.0, 0.5])
    assert instance_loads(owners, load, 4).tolist() == [5.0, 0.5, 5.0, 0.0]
    assert instance_loads(owners, load, 4).dtype == np.float64


# --- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("owners", "parallelism", "load", "match"),
    [
        (np.zeros(8, np.int32), 0, np.ones(8), "new_parallelism"),
        (np.zeros(8, np.int32), -1, np.ones(8), "new_parallelism"),
        (np.zeros(8, np.int32), 9, np.ones(8), "new_parallelism"),
        (np.zeros(8, np.int32), 2.0, np.ones(8), "new_parallelism"),
        (np.zeros(8, np.int32), True, np.ones(8), "new_parallelism"),
        (np.zeros(8, np.int32), 2, np.ones(7), "one entry per key group"),
        (np.zeros(8, np.int32), 2, np.r_[np.ones(7), np.nan], "finite"),
        (np.zeros(8, np.int32), 2, np.r_[np.ones(7), np.inf], "finite"),
        (np.zeros(8, np.int32), 2, np.r_[np.ones(7), -1.0], ">= 0"),
        (np.zeros(8, np.int32), 2, np.ones((2, 4)), "one-dimensional"),
        (np.zeros(8, np.int32), 2, np.array(["a"] * 8), "real numbers"),
        (np.r_[np.zeros(7), -1].astype(np.int32), 2, np.ones(8), ">= 0"),
        (np.zeros(8), 2, np.ones(8), "integers"),
        (np.zeros((2, 4), np.int32), 2, np.ones(8), "one-dimensional"),
        (np.zeros(0, np.int32), 1, np.ones(0), "new_parallelism"),
    ],
)
def test_plan_rejects_bad_input(
    owners: np.ndarray, parallelism: int, load: np.ndarray, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        plan(owners, parallelism, load)


@pytest.mark.parametrize("tolerance", [-0.1, math.nan, math.inf])
def test_plan_rejects_bad_tolerance(tolerance: float) -> None:
    with pytest.raises(ValueError, match="tolerance"):
        plan(np.zeros(8, np.int32), 2, np.ones(8), tolerance=tolerance)


def test_moves_and_instance_loads_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="same length"):
        moves(np.zeros(3, np.int32), np.zeros(4, np.int32))
    with pytest.raises(ValueError, match="outside parallelism"):
        instance_loads(np.array([0, 3], np.int32), np.ones(2), 3)
    with pytest.raises(ValueError, match="parallelism must be >= 1"):
        instance_loads(np.array([0, 0], np.int32), np.ones(2), 0)
    with pytest.raises(ValueError, match="one entry per key group"):
        instance_loads(np.array([0, 0], np.int32), np.ones(3), 1)


# --- properties -----------------------------------------------------------------------------


@st.composite
def rescales(draw: st.DrawFn) -> tuple[np.ndarray, int, np.ndarray, float]:
    count = draw(st.integers(1, 300))
    old_p = draw(st.integers(1, min(count, 12)))
    new_p = draw(st.integers(1, min(count, 16)))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    owners = rng.integers(0, old_p, count).astype(np.int32)
    kind = draw(st.sampled_from(["zeros", "uniform", "zipf", "random", "sparse", "integers"]))
    if kind == "zeros":
        load = np.zeros(count)
    elif kind == "uniform":
        load = np.full(count, 3.5)
    elif kind == "zipf":
        load = zipf_loads(count, draw(st.floats(0.0, 2.0)), seed)
    elif kind == "random":
        load = rng.exponential(10.0, count)
    elif kind == "sparse":
        load = rng.exponential(10.0, count) * (rng.random(count) < 0.2)
    else:
        load = rng.integers(0, 5, count).astype(np.float64)
    tolerance = draw(st.sampled_from([0.0, 0.05, 0.2]))
    return owners, new_p, load, tolerance


@settings(max_examples=400, deadline=None)
@given(rescales())
def test_plan_properties(case: tuple[np.ndarray, int, np.ndarray, float]) -> None:
    old, new_p, load, tolerance = case
    new = plan(old, new_p, load, tolerance=tolerance)
    check_valid(new, old, new_p)
    # Every group of a retired instance moved (to a surviving one).
    retired = old >= new_p
    assert (new[retired] != old[retired]).all()

    balanced = effective(load)
    total = balanced.sum()
    slack = EPS * max(total, 1.0)
    loads = instance_loads(new, balanced, new_p)
    mean = total / new_p
    assert np.isclose(loads.sum(), total)
    # Never worse than the surviving instances were, or than the mean plus the heaviest group
    # that had to move (the LPT bound); never better than possible.
    surviving = instance_loads(np.where(retired, 0, old), np.where(retired, 0, balanced), new_p)
    heaviest_retired = balanced[retired].max() if retired.any() else 0.0
    assert loads.max() <= max(surviving.max(), mean + heaviest_retired) + slack
    assert loads.max() >= max(mean, balanced.max()) - slack
    check_locally_optimal(new, load, new_p, tolerance)
    # Nothing moves when nothing is retired and the assignment is already within tolerance.
    if not retired.any() and surviving.max() <= mean * (1 + tolerance):
        assert np.array_equal(new, old)
    # Deterministic.
    assert np.array_equal(plan(old, new_p, load, tolerance=tolerance), new)


@settings(max_examples=300, deadline=None)
@given(
    count=st.integers(2, 400),
    old_p=st.integers(1, 12),
    extra=st.integers(1, 12),
    seed=st.integers(0, 2**32 - 1),
    zeros=st.booleans(),
    tolerance=st.sampled_from([0.0, 0.05, 0.2]),
)
def test_uniform_scale_out_moves_only_old_to_new_and_the_minimum(
    count: int, old_p: int, extra: int, seed: int, zeros: bool, tolerance: float
) -> None:
    old_p = min(old_p, count - 1)
    new_p = min(old_p + extra, count)
    old = balanced_random_owners(count, old_p, seed)
    load = np.zeros(count) if zeros else np.full(count, 2.0)
    new = plan(old, new_p, load, tolerance=tolerance)
    check_valid(new, old, new_p)
    # No group moves between two surviving old instances, and none out of a new one.
    for src, dst in moves(old, new):
        assert src < old_p <= dst
    # The fewest moves that reach balance: every instance within the limit, or (when the limit
    # is below ceil(count / new_p)) counts of floor and floor + 1 with old instances keeping as
    # many of the floor + 1 slots as they can.
    old_counts = np.bincount(old, minlength=old_p)
    limit = math.floor(float(count) / new_p * (1 + tolerance))
    if new_p * limit >= count:
        minimum = int(np.maximum(old_counts - limit, 0).sum())
    else:
        floor, big = count // new_p, count % new_p
        kept = old_p * floor + min(big, int((old_counts > floor).sum()))
        minimum = count - kept
    assert (new != old).sum() == minimum
    counts = np.bincount(new, minlength=new_p)
    assert counts.max() <= max(limit, math.ceil(count / new_p))


# --- size -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("old_p", "new_p"), [(1, 2), (16, 1000), (64, 1), (1, 65536)])
def test_large_keyspaces_finish(old_p: int, new_p: int) -> None:
    count = 65536
    load = zipf_loads(count, 1.0, seed=6) if new_p < count else np.zeros(count)
    old = Assignment.contiguous(count, old_p).owners
    new = plan(old, new_p, load)
    check_valid(new, old, new_p)
    check_locally_optimal(new, load, new_p, TOL)
