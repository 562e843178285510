"""Live rescales of the sink with real processes: whole output partitions move between sink
instances under load, and the output log stays what its readers rely on.

The job tracks each record (tests.job_fns:track: a key's count after it, with the record's
source and sequence number) through two keyed instances into a sink of four partitions. At the
end, read partition by partition in offset order: every record is in the output exactly once,
the counts equal the truth computed from the generator's seed, every key is in its partition
(key group % 4) only, and in it a key's counts rise by one at each offset: the order the keyed
instance applied them, kept across every hand-over of the partition.
"""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from keyshift.operator.local_host import LocalJob
from keyshift.runtime.generator import instance_total
from keyshift.runtime.keyspace import key_groups
from keyshift.runtime.output_log import OutputLogReader
from keyshift.runtime.transport import JsonClient
from tests.conftest import running_job, wait_for
from tests.test_recovery import Run, start_run
from tests.test_rescale import SERVICE, check_output, rescale_via, tracked_job

pytestmark = pytest.mark.live

PARTITIONS = 4
MAX_KEY_GROUPS = 4096


def sink_job(out: Path, source: dict[str, Any], sinks: int) -> dict[str, Any]:
    job = tracked_job(out, source, 2)
    job["sink"] = {**job["sink"], "parallelism": sinks, "partitions": PARTITIONS}
    return job


def check_partitions(out: Path) -> None:
    """Each key in its own partition only, and there in the order its counts were made."""
    reader = OutputLogReader(out)
    assert reader.partitions() == list(range(PARTITIONS))
    for partition in reader.partitions():
        table = reader.read(partition, reader.start_offset(partition))
        keys = table.column("key")
        groups = key_groups(keys.combine_chunks() if isinstance(keys, pa.ChunkedArray) else keys,
                            MAX_KEY_GROUPS)  # fmt: skip
        assert set((groups % PARTITIONS).tolist()) <= {partition}
        last: dict[int, int] = {}
        for key, value in zip(keys.to_pylist(), table.column("value").to_pylist(), strict=True):
            count = json.loads(value)[0]
            assert count == last.get(key, 0) + 1, f"partition {partition}, key {key}: {count}"
            last[key] = count


def sink_instances(local: LocalJob) -> list[dict[str, Any]]:
    stages = {s["name"]: s for s in local.status()["stages"]}
    return list(stages["sink"]["instances"])


def written(local: LocalJob) -> int:
    """Records in the output log so far: each partition is counted at its one owner."""
    return sum(int(i["stats"].get("output_offset", 0)) for i in sink_instances(local))


def test_random_sink_rescales_under_load_keep_exactly_once_and_each_keys_order(
    tmp_path: Path,
) -> None:
    source = {"kind": "generator", "keys": 2000, "distribution": "zipf", "seed": 29,
              "profile": {"rate": 4000}}  # fmt: skip
    out = tmp_path / "out"
    rng = random.Random(15)
    width = 1
    with running_job(tmp_path, sink_job(out, source, width)) as local:
        client = JsonClient(local.address, SERVICE)
        wait_for(lambda: local.status()["phase"] == "running", 120, "the job to run")
        durations = []
        for _ in range(4):
            before = written(local)
            wait_for(lambda b=before: written(local) > b + 2000, 30, "records to flow")  # type: ignore[misc]
            width = rng.choice([n for n in range(1, PARTITIONS + 1) if n != width])
            result = rescale_via(local, client, width, "hot-first", stage="sink")
            assert (result["stage"], result["to"]) == ("sink", width)
            assert result["groups_moved"] == result["groups_to_move"] > 0, result

            durations.append(result["duration"])

            def spread(w: int = width) -> bool:
                owned = [i["stats"].get("partitions", []) for i in sink_instances(local)]
                every = sorted(p for ps in owned for p in ps)
                return len(owned) == w and every == list(range(PARTITIONS))

            # Reports lag: each partition at one instance, once all have reported since.
            wait_for(spread, 30, "the sink's instances to report their partitions")
        local.drain()
        final = wait_for(
            lambda: (s := local.status())["phase"] == "finished" and s, 120, "the job to drain"
        )
        client.close()
    print("sink rescales took", durations)
    emitted = [i["stats"]["emitted"] for i in final["stages"][0]["instances"]]
    check_output(out, source, emitted)
    check_partitions(out)


# 15 s of records: a sink instance started by the rescale may take seconds to come up on a
# busy machine, and checkpoints must go on after the rescale, while the sources run.
TOTAL = 45_000
CHECKPOINTED = {"kind": "generator", "keys": 2000, "distribution": "zipf", "seed": 31,
                "profile": {"rate": 3000}, "total": TOTAL}  # fmt: skip


@pytest.mark.parametrize(("when", "width", "victim"), [("during", 1, 1), ("after", 3, 2)])
def test_a_sink_instance_killed_around_a_sink_rescale_recovers_exactly_once(
    tmp_path: Path, when: str, width: int, victim: int
) -> None:
    """With checkpoints: a sink instance killed while the sink rescales (the old owner of the
    partitions a scale-in moves, at once after the request: in its hand-over) or after one (the
    instance a scale-out started, once a checkpoint recorded the new owners): the job restarts
    from its checkpoint, each partition is truncated to it there, and the output is still the
    truth, once, in order."""
    out = tmp_path / "out"
    context, port = start_run(tmp_path, sink_job(out, CHECKPOINTED, 2))
    with context as proc:
        run = Run(proc, f"127.0.0.1:{port}")
        try:
            wait_for(lambda: run.completed() >= 1, 60, "a checkpoint")
            pid = run.pid_of("sink", victim) if when == "during" else None
            started = run.client.call("Rescale", {"stage": "sink", "parallelism": width})
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
            else:

                def done() -> bool:
                    status = run.status_now() or {}
                    ids = [r["id"] for r in status.get("rescales", []) if r["phase"] == "done"]
                    return started["id"] in ids

                wait_for(done, 60, "the sink's rescale")
                done_at = run.completed()
                wait_for(lambda: run.completed() > done_at, 30, "a checkpoint after it")
                os.kill(run.pid_of("sink", victim), signal.SIGKILL)
            code = proc.wait(timeout=180)
        finally:
            run.client.close()
        assert code == 0, run.output.text()
    assert "recovered from checkpoint" in run.output.text()
    emitted = [instance_total(TOTAL, s, 2) or 0 for s in range(2)]
    check_output(out, CHECKPOINTED, emitted)
    check_partitions(out)
