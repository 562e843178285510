"""Key -> slot indexes for keyed state: where each key's values sit in the state's columns.

Integer keys use two sorted numpy levels (a large main level and a small recent level merged in
now and then), so a batch's keys are found with a vectorized binary search instead of a Python
dict probe per key, which costs a cache miss each at a million keys. Other keys (strings) use a
dict. Used by `keyshift.runtime.state`.
"""

from __future__ import annotations

from itertools import repeat
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

MIN_RECENT = 65_536


class KeyIndex(Protocol):
    """Keys are a numpy int64 array for IntKeyIndex and a list for ObjectKeyIndex."""

    def __len__(self) -> int: ...

    def lookup(self, keys: Any) -> np.ndarray: ...

    def insert(self, keys: Any, slots: np.ndarray) -> None: ...

    def remove(self, keys: Any) -> None: ...


def _ascending(keys: np.ndarray) -> bool:
    return len(keys) < 2 or bool((keys[1:] >= keys[:-1]).all())


def _find(level_keys: np.ndarray, level_slots: np.ndarray, keys: np.ndarray) -> np.ndarray:
    if len(level_keys) == 0:
        return np.full(len(keys), -1, dtype=np.int64)
    # Keys in ascending order are found 4x faster in a level of millions (each search starts
    # where the one before ended, in memory nearby): a batch's keys come sorted, a moved
    # chunk's do not.
    order = None if _ascending(keys) else np.argsort(keys)
    query = keys if order is None else keys[order]
    pos = np.minimum(np.searchsorted(level_keys, query), len(level_keys) - 1)
    found: np.ndarray = np.where(level_keys[pos] == query, level_slots[pos], -1)
    if order is None:
        return found
    result = np.empty_like(found)
    result[order] = found
    return result


def _merge(
    keys: np.ndarray, slots: np.ndarray, new_keys: np.ndarray, new_slots: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(new_keys)  # keys inserted at once are new, so distinct: any order
    new_keys, new_slots = new_keys[order], new_slots[order]
    pos = np.searchsorted(keys, new_keys)
    return np.insert(keys, pos, new_keys), np.insert(slots, pos, new_slots)


class IntKeyIndex:
    """int64 keys in two sorted levels; inserts go to the small level, merged when it grows.

    A removed key stays in its level with slot -1 (a tombstone) until the next merge, or until
    tombstones are half the entries: deleting from a level of millions copies all of it, which
    a move out paid for every chunk of keys it dropped. A key inserted again goes in before its
    tombstones (`_merge` inserts at the leftmost position), so the leftmost entry of a key in a
    level is its latest, the one `_find` and `remove` look at."""

    def __init__(self) -> None:
        empty = np.empty(0, dtype=np.int64)
        self._main_keys, self._main_slots = empty, empty
        self._recent_keys, self._recent_slots = empty, empty
        self._dead = 0  # tombstones in both levels

    def __len__(self) -> int:
        return len(self._main_keys) + len(self._recent_keys) - self._dead

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        slots = _find(self._main_keys, self._main_slots, keys)
        missing = slots < 0
        if missing.any() and len(self._recent_keys):
            slots[missing] = _find(self._recent_keys, self._recent_slots, keys[missing])
        return slots

    def insert(self, keys: np.ndarray, slots: np.ndarray) -> None:
        self._recent_keys, self._recent_slots = _merge(
            self._recent_keys, self._recent_slots, keys, slots
        )
        if len(self._recent_keys) > max(MIN_RECENT, len(self._main_keys) // 8):
            self._compact()
            self._main_keys, self._main_slots = _merge(
                self._main_keys, self._main_slots, self._recent_keys, self._recent_slots
            )
            self._recent_keys = self._recent_slots = np.empty(0, dtype=np.int64)

    def remove(self, keys: np.ndarray) -> None:
        keys = np.unique(keys)  # sorted, for the search (see `_find`), and each key once
        for level_keys, level_slots in (
            (self._main_keys, self._main_slots),
            (self._recent_keys, self._recent_slots),
        ):
            if len(level_keys) == 0:
                continue
            pos = np.minimum(np.searchsorted(level_keys, keys), len(level_keys) - 1)
            live = pos[(level_keys[pos] == keys) & (level_slots[pos] >= 0)]
            level_slots[live] = -1
            self._dead += len(live)
        if 2 * self._dead > len(self._main_keys) + len(self._recent_keys):
            self._compact()

    def _compact(self) -> None:
        """Drop the tombstones."""
        if not self._dead:
            return
        main, recent = self._main_slots >= 0, self._recent_slots >= 0
        self._main_keys, self._main_slots = self._main_keys[main], self._main_slots[main]
        self._recent_keys, self._recent_slots = (
            self._recent_keys[recent],
            self._recent_slots[recent],
        )
        self._dead = 0


class ObjectKeyIndex:
    """Any hashable keys (strings) in a dict."""

    def __init__(self) -> None:
        self._index: dict[Any, int] = {}

    def __len__(self) -> int:
        return len(self._index)

    def lookup(self, keys: list[Any]) -> np.ndarray:
        # map() with a C-level callable keeps Python frames out of the per-key loop.
        return np.fromiter(map(self._index.get, keys, repeat(-1)), dtype=np.int64, count=len(keys))

    def insert(self, keys: list[Any], slots: np.ndarray) -> None:
        self._index.update(zip(keys, slots.tolist(), strict=True))

    def remove(self, keys: list[Any]) -> None:
        for key in keys:
            del self._index[key]


class SlotKeys:
    """slot -> key: a numpy column for int keys, a list otherwise."""

    def __init__(self, key_type: pa.DataType) -> None:
        self.key_type = key_type
        self.numeric = pa.types.is_integer(key_type)
        self._array = np.zeros(0, dtype=np.int64)
        self._list: list[Any] = []

    def index(self) -> KeyIndex:
        return IntKeyIndex() if self.numeric else ObjectKeyIndex()

    def grow(self, size: int) -> None:
        if self.numeric:
            self._array = np.concatenate([self._array, np.zeros(size - len(self._array), np.int64)])
        else:
            self._list.extend([None] * (size - len(self._list)))

    def set(self, slots: np.ndarray, keys: Any) -> None:
        if self.numeric:
            self._array[slots] = keys
        else:
            for slot, key in zip(slots.tolist(), keys, strict=True):
                self._list[slot] = key

    def take(self, slots: np.ndarray) -> Any:
        if self.numeric:
            return self._array[slots]
        return [self._list[s] for s in slots.tolist()]

    def arrow(self, keys: Any) -> pa.Array:
        return pa.array(keys, type=self.key_type)

    @staticmethod
    def subset(keys: Any, positions: np.ndarray) -> Any:
        if isinstance(keys, np.ndarray):
            return keys[positions]
        return [keys[i] for i in positions.tolist()]
