"""State larger than memory: a keyed stage on RocksDB runs, rescales 1 -> 2 -> 1 live and
recovers from a `kill -9`, with every key's final count equal to the truth computed from the
source's seed, while its processes' resident memory stays within what the operator sizes its
pods for (operator/state_memory.py) and the state is at least five times the largest of them.

Each key's state is wide: a count beside a 4 KiB pad derived from the key (`padded_count`,
random bytes, so RocksDB's compression cannot shrink them; the function checks them whenever
its key comes again, so a value a move or a restore damaged shows in the output: the trickle
after the fill revisits keys). Fewer keys then make
the same bytes: the per-key work (Python per record, a RocksDB lookup per key) is what bounded
the earlier keyed count, which took 11 minutes to fill 22 M keys here.

Real processes on loopback, played by the local host's own run loop (`run_job`, on a thread:
it starts the instances a rescale wants and restarts the job from its checkpoint after the
kill). The source walks the keys in order (`sequential`), as fast as the keyed instance takes
them, until every key is in, then trickles on through the rescales and the recovery, so the
job is live throughout; the truth is then a function of how many records the source emitted.
A thread samples the keyed processes' RSS (VmRSS) throughout. The state's size is its logical
bytes (each key's and value's bytes as the database stores them), and the test also prints
what its SST files take on disk.

`KEYSHIFT_LARGE_STATE_KEYS` sets the keys (400 k by default). Marked `alone`: minutes of both
cores (make test's second phase).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from keyshift.operator.local_host import LocalJob, RunResult, run_job
from keyshift.operator.state_memory import state_memory_mib
from keyshift.runtime.job import StateSettings
from keyshift.runtime.output_log import OutputLogReader
from keyshift.runtime.rocksdb_state import DATABASE, HITS_BYTES
from keyshift.runtime.state_values import ValueCodec
from keyshift.runtime.transport import JsonClient, TransportError
from tests.conftest import count_job, running_job, wait_for
from tests.job_fns import key_pad
from tests.test_rescale import SERVICE

pytestmark = [pytest.mark.slow, pytest.mark.live, pytest.mark.alone, pytest.mark.timeout(3600)]

KEYS = int(os.environ.get("KEYSHIFT_LARGE_STATE_KEYS", 400_000))
FILL_RATE = 2_000_000  # records/s asked for until every key is due: more than the job takes
TRICKLE = 100  # records/s afterwards (a backlog the fill left would park at the new owners)
READ_ROWS = 2_000_000  # output rows read at a time
STATE = {"backend": "rocksdb", "block_cache_mb": 8, "write_buffer_mb": 4}
# A move's chunk holds this many keys: 2 MiB of these values (the default, 32,768 keys, would be
# 128 MiB at each end, times the chunks in flight).
CHUNK_KEYS = 512
KEY_BYTES = 12  # the key group and the integer key (keyshift.runtime.rocksdb_state)


class RssSampler:
    """Samples the keyed instances' VmRSS every `every` seconds on a thread, with the keys the
    coordinator last heard each holds."""

    def __init__(self, local: LocalJob, stage: str, every: float = 0.5) -> None:
        self.local = local
        self.stage = stage
        self.every = every
        self.samples: list[tuple[int, float, int]] = []  # (pid, rss MiB, state keys)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            try:
                stages = {s["name"]: s for s in self.local.status()["stages"]}
            except (TransportError, AssertionError):
                continue  # the coordinator is restarting
            for instance in stages[self.stage]["instances"]:
                rss = rss_mib(int(instance["pid"]))
                if rss is not None:
                    keys = int(instance["stats"].get("state_keys", 0))
                    self.samples.append((int(instance["pid"]), rss, keys))

    def full(self, keys: int) -> bool:
        """Whether a sample was taken of an instance holding at least `keys` keys."""
        return any(held >= keys for _, _, held in self.samples)

    def peak(self) -> float:
        return max(rss for _, rss, _ in self.samples)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def rss_mib(pid: int) -> float | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None  # gone (killed, retired)
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


def state_bytes_per_key() -> int:
    """The bytes the database holds for a key seen once: its key, its hits and its encoded
    value (the same for every key: the pads are all as long)."""
    return KEY_BYTES + HITS_BYTES + len(ValueCodec(allow_pickle=False).encode([1, key_pad(0)]))


def sst_mib(state: Path) -> float:
    """What the keyed instances' databases take on disk (their SST files, compressed)."""
    return sum(f.stat().st_size for f in state.glob(f"*/*/{DATABASE}/*.sst")) / 2**20


def final_counts(out: Path) -> np.ndarray:
    """Each key's latest count in the output log (counts only grow, so the largest)."""
    reader = OutputLogReader(out)
    final = np.zeros(KEYS, dtype=np.int64)
    for partition in reader.partitions():
        start, end = reader.start_offset(partition), reader.end_offset(partition)
        for offset in range(start, end, READ_ROWS):
            rows = reader.read(partition, offset, min(offset + READ_ROWS, end))
            keys = rows.column("key").to_numpy()
            # A process function's outputs are JSON: here one integer each.
            np.maximum.at(final, keys, pc.cast(rows.column("value"), pa.int64()).to_numpy())
    return final


class Host:
    """The local host's run loop over a started job, on a thread; `finish` drains the job."""

    def __init__(self, local: LocalJob) -> None:
        self.interrupted = threading.Event()
        self.result: list[RunResult | BaseException] = []
        self.thread = threading.Thread(target=self._run, args=(local,), daemon=True)
        self.thread.start()

    def _run(self, local: LocalJob) -> None:
        try:
            self.result.append(run_job(local, None, self.interrupted, drain_timeout=120))
        except BaseException as exc:  # reported by `finish`
            self.result.append(exc)

    def finish(self) -> RunResult:
        self.interrupted.set()
        self.thread.join(timeout=180)
        assert self.result, "the job did not drain within 180 s"
        outcome = self.result[0]
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def keyed(local: LocalJob) -> list[dict[str, Any]]:
    try:
        stages = {s["name"]: s for s in local.status()["stages"]}
    except (TransportError, AssertionError):
        return []  # the coordinator is restarting
    return list(stages["counts"]["instances"])


def rescale(local: LocalJob, parallelism: int) -> dict[str, Any]:
    client = JsonClient(local.address, SERVICE)
    try:
        request = {"stage": "counts", "parallelism": parallelism, "strategy": "hot-first"}
        options = {"chunk_keys": CHUNK_KEYS}
        # The coordinator answers once the checkpoint in flight is over (its timeout is 60 s):
        # uploading this much state, one often is.
        started = client.call("Rescale", {**request, "options": options}, timeout=90)
    finally:
        client.close()

    def done() -> dict[str, Any] | None:
        found = [r for r in local.status()["rescales"] if r["id"] == started["id"]]
        return found[0] if found else None

    result: dict[str, Any] = wait_for(done, 600, f"the rescale to {parallelism}", every=0.5)
    assert result["phase"] == "done", result.get("error")
    return result


def completed(local: LocalJob) -> int:
    try:
        return int(local.status()["checkpoints"]["completed"])
    except (TransportError, AssertionError):
        return 0  # the coordinator is restarting


def test_state_beyond_memory_rescales_and_recovers_exactly_in_bounded_memory(
    tmp_path: Path,
) -> None:
    t0 = time.monotonic()
    out = tmp_path / "out"
    source = {
        "kind": "generator", "keys": KEYS, "distribution": "sequential", "seed": 11,
        "profile": {"kind": "step", "rate": FILL_RATE, "to": TRICKLE, "at": KEYS / FILL_RATE},
    }  # fmt: skip
    job = count_job(
        source={"parallelism": 1, "config": source},
        keyed={
            "name": "counts",
            "parallelism": 1,
            "operator": {"kind": "process", "function": "tests.job_fns:padded_count"},
            "state": STATE | {"path": str(tmp_path / "state")},
        },
        sink={
            "parallelism": 1,
            "config": {
                "kind": "log",
                "path": str(out),
                "format": "parquet",
                "segment_records": 1_000_000,
            },
        },
        # 2,048 records of these values are 8 MiB of pads a batch, held a few times over.
        batching={"max_records": 2048, "linger_ms": 20, "credits": 4},
        checkpoints={"interval": 20, "storage": str(tmp_path / "checkpoints")},
        # At 22 M keys on a loaded machine an instance receiving state sent no report for over
        # 15 s (the default), and was taken as lost; this test is about the state.
        heartbeat_timeout=60,
    )
    with running_job(tmp_path, job) as local:
        host = Host(local)
        sampler = RssSampler(local, "counts")
        try:
            # Waits on the sampler's own samples: a fast machine filled every key between two of
            # them, so the coordinator's count alone left none taken at the full state.
            wait_for(lambda: sampler.full(KEYS), 1200, f"{KEYS} keys in the state", every=1.0)
            filled = time.monotonic() - t0
            on_disk = sst_mib(tmp_path / "state")
            one = max(rss for _, rss, keys in sampler.samples if keys >= KEYS)
            moves = [rescale(local, 2), rescale(local, 1)]
            rescaled = time.monotonic() - t0
            done = completed(local)
            wait_for(lambda: completed(local) > done, 300, "a checkpoint after the rescales")
            (instance,) = keyed(local)
            os.kill(int(instance["pid"]), signal.SIGKILL)
            wait_for(lambda: bool(local.recoveries), 60, "the recovery to start")
            wait_for(
                lambda: [int(i["stats"].get("state_keys", 0)) for i in keyed(local)] == [KEYS],
                600, "the restored instance to hold every key", every=1.0,
            )  # fmt: skip
            recovered = time.monotonic() - t0
        finally:
            sampler.close()
        result = host.finish()
    final = result.status
    (source_instance,) = final["stages"][0]["instances"]
    emitted = int(source_instance["stats"]["emitted"])
    assert emitted > KEYS and len(local.recoveries) == 1, (emitted, local.recoveries)

    # Record n has key n % KEYS: every key once, and the first emitted - KEYS keys twice.
    truth = np.full(KEYS, emitted // KEYS, dtype=np.int64)
    truth[: emitted % KEYS] += 1
    counts = final_counts(out)
    wrong = np.flatnonzero(counts != truth)
    assert not len(wrong), f"{len(wrong)} keys wrong, e.g. key {wrong[0]}: {counts[wrong[0]]}"

    state_mib = KEYS * state_bytes_per_key() / 2**20
    out_s, back_s = (m["duration"] for m in moves)
    peak = sampler.peak()
    print(
        f"\n{KEYS} keys: {state_mib:.0f} MiB of state ({on_disk:.0f} MiB of SST files once "
        f"filled); keyed RSS peak {peak:.0f} MiB ({one:.0f} MiB holding every key before the "
        f"rescales), ratio {state_mib / peak:.1f}; 1 -> 2 took {out_s:.1f} s, 2 -> 1 "
        f"{back_s:.1f} s; filled at {filled:.0f} s, rescaled by {rescaled:.0f} s, "
        f"recovered by {recovered:.0f} s, all in {time.monotonic() - t0:.0f} s"
    )
    _, limit = state_memory_mib(StateSettings.model_validate(STATE | {"path": "unused"}))
    assert peak <= limit, f"a keyed process peaked at {peak:.0f} MiB, over its pods' {limit} MiB"
    assert state_mib >= 5 * peak, f"state {state_mib:.0f} MiB is not 5x the peak RSS {peak:.0f}"
