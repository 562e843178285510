"""Subscales (DRRS): a rescale's move divided into parts that run and complete on their own.

`divide` cuts the groups that move into subscales. With `per_pair` (concurrent subscales, the
default of `hot-first` and `batched`) each subscale moves groups between one old owner and one
new owner only: all the pair's groups, or `batch_groups` of them at a time; without, a subscale
is one step of the older global protocol (every moving group at once, or `batch_groups` of
them across all pairs). Every moving group is in exactly one subscale, hottest subscales first.

`startable` schedules them: which waiting subscales may start now, given the instances that
running ones hold. An instance takes part in at most one subscale as an old owner and one as a
new owner at a time (its migration has one move out and one move in), so subscales that run
together have disjoint sources and disjoint destinations; without `concurrent`, one runs at a
time. Pure functions, no I/O; `keyshift.runtime.rescale` drives what they plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from keyshift.runtime.assignment_planner import moves

__all__ = ["Subscale", "divide", "startable"]


@dataclass(frozen=True)
class Subscale:
    """Groups moving in one epoch: (old owner, new owner) -> groups, hottest first."""

    pairs: dict[tuple[int, int], npt.NDArray[np.int64]]
    load: float

    @property
    def sources(self) -> set[int]:
        return {src for src, _ in self.pairs}

    @property
    def destinations(self) -> set[int]:
        return {dst for _, dst in self.pairs}

    @property
    def groups(self) -> npt.NDArray[np.int64]:
        return np.concatenate(list(self.pairs.values()))


def divide(
    old: npt.NDArray[np.integer[Any]],
    new: npt.NDArray[np.integer[Any]],
    group_load: npt.NDArray[np.floating[Any]],
    batch_groups: int | None,
    per_pair: bool,
) -> list[Subscale]:
    """The subscales moving every group whose owner differs between `old` and `new`, hottest
    first (by summed `group_load`); `batch_groups` (None: no limit) caps each one's groups."""
    if batch_groups is not None and batch_groups < 1:
        raise ValueError(f"batch_groups must be >= 1, got {batch_groups}")
    load = np.asarray(group_load, dtype=np.float64)
    if per_pair:
        chunks = [
            {pair: part}
            for pair, groups in moves(old, new).items()
            for part in _batches(_hottest(groups, load), batch_groups)
        ]
    else:
        moving = _hottest(np.flatnonzero(np.asarray(old) != np.asarray(new)), load)
        chunks = [
            {pair: np.sort(groups) for pair, groups in _by_pair(part, old, new).items()}
            for part in _batches(moving, batch_groups)
        ]
    subscales = [
        Subscale(
            {pair: np.asarray(g, dtype=np.int64) for pair, g in chunk.items()},
            float(load[np.concatenate(list(chunk.values()))].sum()),
        )
        for chunk in chunks
    ]
    # Stable: a pair's batches keep their order (each is no hotter than the one before).
    order = sorted(range(len(subscales)), key=lambda i: -subscales[i].load)
    return [subscales[i] for i in order]


def _hottest(groups: npt.NDArray[np.integer[Any]], load: npt.NDArray[np.float64]) -> Any:
    return groups[np.argsort(-load[groups], kind="stable")]


def _batches(groups: npt.NDArray[np.integer[Any]], size: int | None) -> list[Any]:
    if size is None or not len(groups):
        return [groups] if len(groups) else []
    return [groups[i : i + size] for i in range(0, len(groups), size)]


def _by_pair(
    groups: npt.NDArray[np.integer[Any]],
    old: npt.NDArray[np.integer[Any]],
    new: npt.NDArray[np.integer[Any]],
) -> dict[tuple[int, int], Any]:
    pairs: dict[tuple[int, int], list[int]] = {}
    for group in groups.tolist():
        pairs.setdefault((int(old[group]), int(new[group])), []).append(group)
    return {pair: np.asarray(g, dtype=np.int64) for pair, g in sorted(pairs.items())}


def startable(waiting: list[Subscale], running: list[Subscale], concurrent: bool) -> list[int]:
    """The indexes (into `waiting`, in its order) of the subscales that may start now beside
    `running`: the first waiting one whose instances are free, then the next, and so on."""
    if not concurrent:
        return [0] if waiting and not running else []
    busy_out = set().union(*(s.sources for s in running))
    busy_in = set().union(*(s.destinations for s in running))
    chosen = []
    for i, subscale in enumerate(waiting):
        if subscale.sources & busy_out or subscale.destinations & busy_in:
            continue
        chosen.append(i)
        busy_out |= subscale.sources
        busy_in |= subscale.destinations
    return chosen
