"""The keyspace: key -> 64-bit hash -> key group -> owner instance, versioned by epoch.

The number of key groups (`max_key_groups`) is fixed for a job's life; rescaling moves whole
groups. Senders route with `key_groups` and an `Assignment`; the coordinator owns assignments.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a bijective, well-spread 64-bit mix."""
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _hash_str(value: str) -> int:
    return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "little")


def hash_keys(keys: pa.Array | np.ndarray) -> np.ndarray:
    """64-bit hashes (uint64) of int64 or string keys; stable across processes and runs."""
    if isinstance(keys, pa.ChunkedArray):
        keys = keys.combine_chunks()
    if isinstance(keys, pa.Array) and pa.types.is_string(keys.type):
        encoded = keys.dictionary_encode()
        uniques = np.fromiter(
            (_hash_str(s) for s in encoded.dictionary.to_pylist()),
            dtype=np.uint64,
            count=len(encoded.dictionary),
        )
        return uniques[encoded.indices.to_numpy(zero_copy_only=False)]  # type: ignore[no-any-return]
    ints = keys.to_numpy(zero_copy_only=False) if isinstance(keys, pa.Array) else keys
    return _mix64(ints.astype(np.int64, copy=False).view(np.uint64))


def hash_key(key: int | str) -> int:
    if isinstance(key, str):
        return _hash_str(key)
    return int(_mix64(np.array([key], dtype=np.int64).view(np.uint64))[0])


def key_groups(keys: pa.Array | np.ndarray, max_key_groups: int) -> np.ndarray:
    """The key group (int32 in [0, max_key_groups)) of every key."""
    return (hash_keys(keys) % np.uint64(max_key_groups)).astype(np.int32)


@dataclass(frozen=True)
class Assignment:
    """Which instance of a keyed stage owns each key group, at an epoch."""

    epoch: int
    owners: np.ndarray  # int32, one entry per key group

    @property
    def parallelism(self) -> int:
        return int(self.owners.max()) + 1 if len(self.owners) else 0

    def groups_of(self, instance: int) -> np.ndarray:
        return np.flatnonzero(self.owners == instance).astype(np.int32)

    def to_json(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "owners": self.owners.tolist()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Assignment:
        return cls(epoch=int(data["epoch"]), owners=np.asarray(data["owners"], dtype=np.int32))

    @classmethod
    def contiguous(cls, max_key_groups: int, parallelism: int, epoch: int = 1) -> Assignment:
        """Near-equal contiguous ranges: the starting point before any load is measured."""
        groups = np.arange(max_key_groups, dtype=np.int64)
        return cls(epoch=epoch, owners=(groups * parallelism // max_key_groups).astype(np.int32))
