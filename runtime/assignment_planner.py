"""The assignment planner: which instance of a keyed stage owns each key group after a rescale.

The coordinator calls `plan` when a keyed stage rescales (through `keyshift.runtime.rescale`);
`moves` turns the old and new owners into the (from, to) -> groups hand-overs the migration
protocol sends, and `instance_loads` sums measured group loads per instance.

Instances follow a Kubernetes StatefulSet: a scale-in retires the highest indexes
(`new_parallelism..old_parallelism-1`: every owner >= `new_parallelism` is retired), a scale-out
adds `old_parallelism..new_parallelism-1` (instances that own nothing yet).
The plan balances measured load (records/s per key group) over the new instances while moving as
few groups, and as little load, as it can:

1. Groups of retired instances must move: heaviest first, each to the currently least-loaded
   surviving instance (LPT; ties go to the instance with fewer groups, then the lowest index).
2. Then, while the most-loaded instance is above `mean * (1 + tolerance)`, one group moves from
   it to the least-loaded instance: the group whose load best closes the gap between them (the
   move must strictly lower the larger of the two loads). When no single group can, the best
   strictly improving swap of two groups with one of the lightest instances is tried; when none
   exists either, that instance stays as it is (its load is bound by group granularity, e.g. it
   holds one group heavier than the mean) and balancing goes on among the others.

Every move or swap of step 2 strictly lowers the sum of squared instance loads, so the plan
terminates (a cap on the steps guards against floating-point rounding as well). Loads of all
zeros (nothing measured yet) count every group as load 1, so the plan balances group counts.
Pure functions, no I/O.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["instance_loads", "moves", "plan"]

Owners = npt.NDArray[np.int32]
Loads = npt.NDArray[np.float64]


def plan(
    owners: npt.NDArray[np.integer[Any]],
    new_parallelism: int,
    group_load: npt.NDArray[np.floating[Any]],
    *,
    tolerance: float = 0.05,
) -> Owners:
    """The new owner (int32, in `[0, new_parallelism)`) of every key group.

    `owners[g]` is the current owner of group `g`; `group_load[g]` its measured load (>= 0).
    Raises ValueError on a parallelism outside `[1, len(owners)]`, arrays of different lengths,
    negative owners, or loads that are negative or not finite.
    """
    current = _check_owners(owners, "owners")
    count = len(current)
    load = _check_loads(group_load, count)
    if isinstance(new_parallelism, bool) or not isinstance(new_parallelism, int | np.integer):
        raise ValueError(f"new_parallelism must be an int, got {new_parallelism!r}")
    parallelism = int(new_parallelism)
    if not 1 <= parallelism <= count:
        raise ValueError(
            f"new_parallelism must be in [1, {count}] (the number of key groups), got {parallelism}"
        )
    if not (np.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"tolerance must be finite and >= 0, got {tolerance!r}")
    if not load.any():
        load = np.ones(count, dtype=np.float64)

    new = current.astype(np.int32)
    surviving = new < parallelism
    counted = np.bincount(new[surviving], weights=load[surviving], minlength=parallelism)
    loads = counted.astype(np.float64)  # bincount with weights is float64; typed as int
    sizes = np.bincount(new[surviving], minlength=parallelism)
    _place_retired(new, load, loads, sizes, parallelism)
    _rebalance(new, load, loads, parallelism, tolerance)
    return new


def moves(
    old: npt.NDArray[np.integer[Any]], new: npt.NDArray[np.integer[Any]]
) -> dict[tuple[int, int], Owners]:
    """(from_instance, to_instance) -> the groups (int32, ascending) that move between them.

    Pairs appear in ascending order; groups whose owner does not change appear nowhere.
    """
    before = _check_owners(old, "old")
    after = _check_owners(new, "new")
    if len(before) != len(after):
        raise ValueError(
            f"old and new must have the same length, got {len(before)} and {len(after)}"
        )
    moved = np.flatnonzero(before != after)
    if not len(moved):
        return {}
    src, dst = before[moved], after[moved]
    order = np.lexsort((moved, dst, src))
    moved, src, dst = moved[order], src[order], dst[order]
    starts = np.flatnonzero(np.r_[True, (src[1:] != src[:-1]) | (dst[1:] != dst[:-1])])
    ends = np.r_[starts[1:], len(moved)]
    return {
        (int(src[s]), int(dst[s])): moved[s:e].astype(np.int32)
        for s, e in zip(starts, ends, strict=True)
    }


def instance_loads(
    owners: npt.NDArray[np.integer[Any]],
    group_load: npt.NDArray[np.floating[Any]],
    parallelism: int,
) -> Loads:
    """The summed load (float64, length `parallelism`) of each instance's groups."""
    current = _check_owners(owners, "owners")
    load = _check_loads(group_load, len(current))
    if parallelism < 1:
        raise ValueError(f"parallelism must be >= 1, got {parallelism}")
    if len(current) and int(current.max()) >= parallelism:
        raise ValueError(
            f"owners name instance {int(current.max())}, outside parallelism {parallelism}"
        )
    return np.bincount(current, weights=load, minlength=parallelism).astype(np.float64)


def _check_owners(owners: npt.NDArray[np.integer[Any]], name: str) -> npt.NDArray[np.int64]:
    array = np.asarray(owners)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    if not (np.issubdtype(array.dtype, np.integer) or (array.size == 0)):
        raise ValueError(f"{name} must hold integers, got dtype {array.dtype}")
    if array.size and int(array.min()) < 0:
        raise ValueError(f"{name} must be >= 0, got {int(array.min())}")
    return array.astype(np.int64)


def _check_loads(group_load: npt.NDArray[np.floating[Any]], count: int) -> Loads:
    array = np.asarray(group_load)
    if array.ndim != 1:
        raise ValueError(f"group_load must be one-dimensional, got shape {array.shape}")
    if len(array) != count:
        raise ValueError(
            f"group_load must have one entry per key group: {len(array)} != {count} owners"
        )
    if array.size and not (
        np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)
    ):
        raise ValueError(f"group_load must be real numbers, got dtype {array.dtype}")
    load = array.astype(np.float64)
    if not np.isfinite(load).all():
        raise ValueError("group_load must be finite (no NaN or infinity)")
    if load.size and float(load.min()) < 0:
        raise ValueError(f"group_load must be >= 0, got {float(load.min())}")
    return load


def _place_retired(
    owners: Owners, load: Loads, loads: Loads, sizes: npt.NDArray[np.intp], parallelism: int
) -> None:
    """Step 1 (in place): groups of retired instances, heaviest first, to the least loaded."""
    retired = np.flatnonzero(owners >= parallelism)
    if not len(retired):
        return
    retired = retired[np.argsort(-load[retired], kind="stable")]
    heap = [(float(loads[i]), int(sizes[i]), i) for i in range(parallelism)]
    heapq.heapify(heap)
    for group in retired.tolist():
        total, size, instance = heap[0]
        owners[group] = instance
        heapq.heapreplace(heap, (total + float(load[group]), size + 1, instance))
    for total, size, instance in heap:
        loads[instance], sizes[instance] = total, size


Held = list[tuple[list[float], list[int]]]  # per instance: its group loads (ascending), groups
_SWAP_PARTNERS = 8  # how many of the lightest instances a stuck donor tries to swap with


def _rebalance(
    owners: Owners, load: Loads, loads: Loads, parallelism: int, tolerance: float
) -> None:
    """Step 2 (in place): moves from the most to the least loaded instance while they help.

    An instance above the limit that no move or swap can lower (e.g. it holds one group heavier
    than the mean) is frozen, and balancing goes on among the others.
    """
    limit = float(loads.sum()) / parallelism * (1 + tolerance)
    if float(loads.max()) <= limit:
        return
    smallest = float(load[load > 0].min())
    order = np.lexsort((load, owners))
    bounds = np.searchsorted(owners[order], np.arange(parallelism + 1)).tolist()
    sorted_loads, sorted_groups = load[order].tolist(), order.tolist()
    held: Held = [
        (sorted_loads[bounds[i] : bounds[i + 1]], sorted_groups[bounds[i] : bounds[i + 1]])
        for i in range(parallelism)
    ]
    # Lazy heaps of (load, instance): an entry is current while it matches `level` (entries of
    # the same instance with an equal load are interchangeable). Ties go to the lowest index.
    level: list[float] = loads.tolist()
    highs = [(-value, i) for i, value in enumerate(level)]
    lows = [(value, i) for i, value in enumerate(level)]
    heapq.heapify(highs)
    heapq.heapify(lows)

    def changed(*instances: int) -> None:
        for i in instances:
            value = level[i]
            heapq.heappush(highs, (-value, i))
            heapq.heappush(lows, (value, i))

    for _ in range(4 * len(owners) + 64):  # a safety cap; every step strictly improves
        while highs and -highs[0][0] != level[highs[0][1]]:
            heapq.heappop(highs)
        if not highs or -highs[0][0] <= limit:
            return
        high, donor = -highs[0][0], highs[0][1]
        while lows[0][0] != level[lows[0][1]]:
            heapq.heappop(lows)
        index = _best_move(held[donor][0], high - lows[0][0])
        if index is not None:
            receiver = lows[0][1]
            _transfer(held, owners, level, donor, receiver, index)
            changed(donor, receiver)
            continue
        other = _try_swap(held, owners, level, donor, smallest)
        if other is not None:
            changed(donor, other)
            continue
        while highs and highs[0][1] == donor:  # freeze: it never changes again
            heapq.heappop(highs)


def _best_move(donor_loads: list[float], gap: float) -> int | None:
    """Index of the donor's group x in (0, gap) closest to gap / 2 (smaller on ties), or None."""
    half = gap / 2
    split = bisect_right(donor_loads, half)
    below = split - 1 if split > 0 and donor_loads[split - 1] > 0 else None
    above = split if split < len(donor_loads) and donor_loads[split] < gap else None
    if below is None or above is None:
        return below if above is None else above
    # The pair's new max is high - x for x <= half, low + x above: the nearer half, the lower.
    return below if half - donor_loads[below] <= donor_loads[above] - half else above


def _transfer(
    held: Held,
    owners: Owners,
    level: list[float],
    donor: int,
    receiver: int,
    index: int,
) -> None:
    """Move the donor's group at `index` (in its load-sorted list) to the receiver."""
    donor_loads, donor_groups = held[donor]
    value, group = donor_loads.pop(index), donor_groups.pop(index)
    level[donor] -= value
    receiver_loads, receiver_groups = held[receiver]
    at = bisect_right(receiver_loads, value)
    receiver_loads.insert(at, value)
    receiver_groups.insert(at, group)
    level[receiver] += value
    owners[group] = receiver


def _try_swap(
    held: Held, owners: Owners, level: list[float], donor: int, smallest: float
) -> int | None:
    """Swap a donor group x for a lighter group y of a light instance where x - y helps.

    A swap with instance `other` helps when 0 < x - y < level[donor] - level[other]; the best
    puts x - y nearest half that gap. Tries the few lightest instances, lightest first; returns
    the instance swapped with, or None. `smallest` is the smallest positive group load.
    """
    xs = np.asarray(held[donor][0], dtype=np.float64)
    # The donor is stuck: each of its positive groups is >= its gap to the lightest instance.
    # A swap can help only if it holds two positive groups (then every instance is loaded at
    # least half as much as it, so none is empty) and one of them is heavier than some group.
    if len(xs) < 2 or xs[-2] <= 0 or xs[-1] <= smallest:
        return None
    high = level[donor]
    loads = np.asarray(level, dtype=np.float64)
    partners = np.flatnonzero(loads < high)
    if len(partners) > _SWAP_PARTNERS:
        partners = partners[np.argpartition(loads[partners], _SWAP_PARTNERS)[:_SWAP_PARTNERS]]
    for other in partners[np.argsort(loads[partners], kind="stable")].tolist():
        gap = high - level[other]
        ys = np.asarray(held[other][0], dtype=np.float64)
        if not len(ys):
            continue
        best: tuple[float, int, int] | None = None
        near = np.searchsorted(ys, xs - gap / 2)  # for each x, the y nearest x - gap / 2
        for candidate in (near - 1, near):
            valid = (candidate >= 0) & (candidate < len(ys))
            i_x, i_y = np.flatnonzero(valid), candidate[valid]
            delta = xs[i_x] - ys[i_y]
            ok = (delta > 0) & (delta < gap)
            if not ok.any():
                continue
            i_x, i_y, delta = i_x[ok], i_y[ok], delta[ok]
            worse = np.maximum(high - delta, high - gap + delta)  # the pair's new max
            pick = int(np.argmin(worse))
            if best is None or float(worse[pick]) < best[0]:
                best = (float(worse[pick]), int(i_x[pick]), int(i_y[pick]))
        if best is None:
            continue
        _, x_index, y_index = best
        y_group = held[other][1][y_index]
        _transfer(held, owners, level, donor, other, x_index)
        # x's insertion may have shifted y within the other's list: find y again by group.
        _transfer(held, owners, level, other, donor, held[other][1].index(y_group))
        return int(other)
    return None
