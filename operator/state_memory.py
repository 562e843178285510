"""The memory a keyed instance on RocksDB needs: its pods' memory request and limit.

On RocksDB a keyed instance's resident memory is set by its state settings, not by its number
of keys (README, "Sizing"): a per-process base (Python, Arrow, gRPC and the batches in flight,
measured by bench/state_memory.py), the block cache (index and filter blocks are charged to
it), and RocksDB's two write buffers. The limit adds room for a checkpoint file moved whole
through memory (an SST file is uploaded and downloaded in one piece) and RocksDB's allocations
beside the cache (table readers, iterators). Used by keyshift.operator.k8s_children for the
keyed stage's pods: the job's own requests and limits are raised to these, never lowered.
"""

from __future__ import annotations

import re

from keyshift.operator.streamingjob import QUANTITY_PATTERN, ResourceList, Resources
from keyshift.runtime.job import StateSettings

# glibc gives threads that contend for malloc arenas of their own (up to 8 per core), and what is
# freed stays in them: with two, a keyed instance on RocksDB peaked 41 MB lower (bench/README.md).
# Every keyshift process gets it, from both hosts.
PROCESS_ENV = {"MALLOC_ARENA_MAX": "2"}
# Measured (bench/state_memory.py, bench/README.md): a keyed instance's peak RSS less its
# block cache and write buffers, with 65,536-record batches, was 248 MiB.
PROCESS_BASE_MIB = 256
# A file moved whole through memory (compaction's SST files are cut at 8 MiB, a flushed one is a
# write buffer's size) and RocksDB's table readers and iterators, with slack.
HEADROOM_MIB = 128
_UNITS = {
    "": 1,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}


def quantity_bytes(quantity: str) -> float:
    """Bytes of a Kubernetes memory quantity ("512Mi", "1G", "1073741824")."""
    found = re.match(QUANTITY_PATTERN, quantity)
    if found is None:
        raise ValueError(f"{quantity!r} is not a Kubernetes quantity")
    unit = found.group(2) or ""
    return float(quantity.removesuffix(unit)) * _UNITS[unit]


def state_memory_mib(settings: StateSettings) -> tuple[int, int]:
    """The memory (MiB) a keyed instance with these state settings requests, and its limit."""
    request = PROCESS_BASE_MIB + settings.block_cache_mb + 2 * settings.write_buffer_mb
    return request, request + HEADROOM_MIB


def _at_least(memory: str | None, mib: int) -> str:
    if memory is not None and quantity_bytes(memory) >= mib * 2**20:
        return memory
    return f"{mib}Mi"


def sized_resources(resources: Resources, settings: StateSettings) -> Resources:
    """`resources` with the memory request and limit raised to what `settings` need on
    RocksDB (unchanged for the memory backend, whose state grows with its keys)."""
    if settings.backend != "rocksdb":
        return resources
    request, limit = state_memory_mib(settings)
    return Resources(
        requests=ResourceList(
            cpu=resources.requests.cpu, memory=_at_least(resources.requests.memory, request)
        ),
        limits=ResourceList(
            cpu=resources.limits.cpu, memory=_at_least(resources.limits.memory, limit)
        ),
    )
