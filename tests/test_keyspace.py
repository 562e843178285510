"""Tests of keyshift.runtime.keyspace: stable hashes, key groups, and assignments of groups."""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyshift.runtime.keyspace import Assignment, hash_key, hash_keys, key_groups

MASK = (1 << 64) - 1


def splitmix64_finalizer(key: int) -> int:
    """An independent pure-Python splitmix64 step (Steele et al.) on the key's 64-bit pattern."""
    z = ((key & MASK) + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def blake2b_64(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


# Hard-coded once: a change to any of these moves every key to another group, which breaks
# state written by an older version and routing between mixed versions.
KNOWN = {
    0: 16294208416658607535,  # 0xE220A8397B1DCDAF: splitmix64's first output for seed 0
    -1: 16490336266968443936,
    12: 10682531704454680323,
    2**63 - 1: 3055647633038352039,
    -(2**63): 5196802822362493915,
    "12": 16370802936685099627,
    "user-1": 9863422088627006618,
    "": 13020603013274838756,
    "ключ": 2362285139686184012,
}


@pytest.mark.parametrize(("key", "expected"), list(KNOWN.items()))
def test_known_hash_values(key: int | str, expected: int) -> None:
    assert hash_key(key) == expected
    reference = blake2b_64(key) if isinstance(key, str) else splitmix64_finalizer(key)
    assert reference == expected


def test_known_group_values() -> None:
    keys = [0, -1, 12, 2**63 - 1]
    groups = key_groups(pa.array(keys, type=pa.int64()), 4096)
    assert groups.dtype == np.int32
    assert groups.tolist() == [KNOWN[k] % 4096 for k in keys]
    string_groups = key_groups(pa.array(["12", "user-1", ""]), 4096)
    assert string_groups.tolist() == [KNOWN[k] % 4096 for k in ["12", "user-1", ""]]


def test_int_and_string_of_same_digits_hash_differently() -> None:
    assert hash_key(12) != hash_key("12")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=60))
def test_hash_keys_matches_hash_key_for_ints(keys: list[int]) -> None:
    expected = [hash_key(k) for k in keys]
    assert expected == [splitmix64_finalizer(k) for k in keys]
    from_arrow = hash_keys(pa.array(keys, type=pa.int64()))
    from_numpy = hash_keys(np.array(keys, dtype=np.int64))
    assert from_arrow.dtype == np.uint64 and from_numpy.dtype == np.uint64
    assert from_arrow.tolist() == expected
    assert from_numpy.tolist() == expected


@settings(max_examples=50, deadline=None)
@given(st.lists(st.text(max_size=12), max_size=60))
def test_hash_keys_matches_hash_key_for_strings(keys: list[str]) -> None:
    expected = [hash_key(k) for k in keys]
    assert expected == [blake2b_64(k) for k in keys]
    hashes = hash_keys(pa.array(keys, type=pa.string()))
    assert hashes.dtype == np.uint64
    assert hashes.tolist() == expected


def test_hash_keys_accepts_narrower_ints_and_chunked_arrays() -> None:
    keys = [5, -7, 1000, 5]
    expected = [hash_key(k) for k in keys]
    assert hash_keys(pa.array(keys, type=pa.int32())).tolist() == expected
    assert hash_keys(np.array(keys, dtype=np.int32)).tolist() == expected
    assert hash_keys(pa.chunked_array([[5, -7], [1000, 5]], type=pa.int64())).tolist() == expected
    words = ["a", "b", "a", "c"]
    chunked = pa.chunked_array([["a", "b"], ["a", "c"]], type=pa.string())
    assert hash_keys(chunked).tolist() == [hash_key(w) for w in words]


def test_empty_inputs() -> None:
    assert hash_keys(pa.array([], type=pa.int64())).tolist() == []
    assert hash_keys(pa.array([], type=pa.string())).tolist() == []
    assert key_groups(np.array([], dtype=np.int64), 16).tolist() == []


@pytest.mark.parametrize("max_key_groups", [1, 2, 7, 128, 4096, 1 << 16])
def test_groups_in_range(max_key_groups: int) -> None:
    rng = np.random.default_rng(1)
    ints = rng.integers(-(2**63), 2**63 - 1, size=5000, dtype=np.int64)
    groups = key_groups(ints, max_key_groups)
    assert groups.dtype == np.int32
    assert groups.min() >= 0 and groups.max() < max_key_groups
    expected = [hash_key(int(k)) % max_key_groups for k in ints[:200]]
    assert groups[:200].tolist() == expected
    strings = key_groups(pa.array([f"user-{i}" for i in range(2000)]), max_key_groups)
    assert strings.min() >= 0 and strings.max() < max_key_groups


def _chi_square_bound(cells: int) -> float:
    # Mean cells - 1, sd sqrt(2 (cells - 1)): six standard deviations above the mean.
    return (cells - 1) + 6 * math.sqrt(2 * (cells - 1))


@pytest.mark.parametrize(("max_key_groups", "n"), [(64, 64_000), (4096, 409_600), (1000, 50_000)])
def test_sequential_int_keys_spread_uniformly(max_key_groups: int, n: int) -> None:
    groups = key_groups(np.arange(n, dtype=np.int64), max_key_groups)
    counts = np.bincount(groups, minlength=max_key_groups)
    expected = n / max_key_groups
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < _chi_square_bound(max_key_groups), chi2
    assert counts.min() > 0
    # A hash that merely spreads the counts could still map neighbours together.
    assert np.mean(groups[1:] == groups[:-1]) < 5 / max_key_groups + 0.01


def test_sequential_string_keys_spread_uniformly() -> None:
    max_key_groups, n = 256, 51_200
    groups = key_groups(pa.array([f"user-{i}" for i in range(n)]), max_key_groups)
    counts = np.bincount(groups, minlength=max_key_groups)
    expected = n / max_key_groups
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < _chi_square_bound(max_key_groups), chi2


@pytest.mark.parametrize(
    ("max_key_groups", "parallelism"), [(4096, 1), (4096, 3), (4096, 7), (10, 4), (5, 5), (100, 64)]
)
def test_contiguous_is_balanced_and_contiguous(max_key_groups: int, parallelism: int) -> None:
    a = Assignment.contiguous(max_key_groups, parallelism, epoch=3)
    assert a.epoch == 3
    assert a.owners.dtype == np.int32
    assert len(a.owners) == max_key_groups
    assert a.parallelism == parallelism
    counts = np.bincount(a.owners, minlength=parallelism)
    assert len(counts) == parallelism
    assert set(counts.tolist()) <= {
        max_key_groups // parallelism,
        -(-max_key_groups // parallelism),
    }
    assert counts.sum() == max_key_groups
    assert (np.diff(a.owners) >= 0).all()  # non-decreasing: ranges
    assert a.owners[0] == 0 and a.owners[-1] == parallelism - 1
    covered: list[int] = []
    for instance in range(parallelism):
        groups = a.groups_of(instance)
        assert groups.dtype == np.int32
        assert len(groups) == counts[instance]
        if len(groups):
            assert groups.tolist() == list(range(groups[0], groups[-1] + 1))
        covered.extend(groups.tolist())
    assert sorted(covered) == list(range(max_key_groups))


def test_contiguous_default_epoch() -> None:
    assert Assignment.contiguous(8, 2).epoch == 1


def test_groups_of() -> None:
    a = Assignment(epoch=5, owners=np.array([2, 0, 2, 1, 0, 2], dtype=np.int32))
    assert a.parallelism == 3
    assert a.groups_of(0).tolist() == [1, 4]
    assert a.groups_of(1).tolist() == [3]
    assert a.groups_of(2).tolist() == [0, 2, 5]
    assert a.groups_of(3).tolist() == []
    assert a.groups_of(2).dtype == np.int32


def test_empty_assignment_has_no_parallelism() -> None:
    assert Assignment(epoch=0, owners=np.array([], dtype=np.int32)).parallelism == 0


def test_json_roundtrip() -> None:
    rng = np.random.default_rng(7)
    a = Assignment(epoch=12, owners=rng.integers(0, 9, size=4096).astype(np.int32))
    data = a.to_json()
    assert data == {"epoch": 12, "owners": a.owners.tolist()}
    text = json.dumps(data)  # plain JSON types only
    b = Assignment.from_json(json.loads(text))
    assert b.epoch == 12
    assert b.owners.dtype == np.int32
    assert np.array_equal(b.owners, a.owners)
    assert b.parallelism == a.parallelism
    for instance in range(a.parallelism):
        assert np.array_equal(b.groups_of(instance), a.groups_of(instance))


def test_routing_with_assignment_sends_each_key_to_one_owner() -> None:
    a = Assignment.contiguous(128, 4)
    keys = np.arange(-500, 500, dtype=np.int64)
    owners = a.owners[key_groups(keys, 128)]
    for key, owner in zip(keys.tolist(), owners.tolist(), strict=True):
        group = hash_key(key) % 128
        assert group in a.groups_of(owner).tolist()
