"""The integer key index (runtime/key_index.py) against a dict, through any sequence of inserts
and removes: removed keys leave tombstones, merged away or compacted later, and a key inserted
again must be found at its new slot, never at a tombstone or an older slot."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyshift.runtime import key_index
from keyshift.runtime.key_index import IntKeyIndex

KEYS = 40
operations = st.lists(
    st.tuples(st.booleans(), st.lists(st.integers(0, KEYS - 1), min_size=1, max_size=10)),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(operations)
def test_lookups_and_length_follow_a_dict_through_inserts_and_removes(
    ops: list[tuple[bool, list[int]]],
) -> None:
    # A small recent level: merges (and the compaction before each) happen within a few inserts.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(key_index, "MIN_RECENT", 8)
        index, next_slot = IntKeyIndex(), 0
        truth: dict[int, int] = {}
        for insert, keys in ops:
            if insert:
                new = sorted({k for k in keys if k not in truth})
                slots = np.arange(next_slot, next_slot + len(new), dtype=np.int64)
                next_slot += len(new)
                if new:
                    index.insert(np.asarray(new, dtype=np.int64), slots)
                truth.update(zip(new, slots.tolist(), strict=True))
            else:
                index.remove(np.asarray(keys, dtype=np.int64))
                for key in keys:
                    truth.pop(key, None)
            every = np.arange(KEYS, dtype=np.int64)
            assert index.lookup(every).tolist() == [truth.get(k, -1) for k in range(KEYS)]
            assert len(index) == len(truth)


def test_removing_keys_of_a_large_index_does_not_copy_it() -> None:
    """A move out drops a chunk's keys at a time: the level keeps its arrays (tombstones)
    until half its entries are gone."""
    index = IntKeyIndex()
    keys = np.arange(200_000, dtype=np.int64)
    index.insert(keys, keys.copy())
    index.insert(np.asarray([10**9], dtype=np.int64), np.asarray([7], dtype=np.int64))
    main = index._main_keys
    index.remove(keys[:1000])
    assert index._main_keys is main and len(index) == 200_001 - 1000
    index.remove(keys[1000:120_000])
    assert index._main_keys is not main  # compacted: no tombstone left
    assert len(index._main_keys) + len(index._recent_keys) == len(index) == 80_001
