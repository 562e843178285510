"""Data-path benchmark: the CPU one message costs to send and to receive, per batch size.

Two processes on loopback, as two stage instances are: this one sends record batches of the
runtime's record schema (`keyshift.runtime.records.record_schema`) through an `Outlet`, with the
job's token checked like every call, and a child process takes them off its `Inbox` (which
decodes them) and hands the credit back, as a stage loop does. Measured per batch size, over
`--seconds` of sending as fast as the credits allow:

- messages/s and rows/s through the one stream;
- CPU per message at each end (user + system time of the whole process: gRPC's threads
  included), in µs;
- so the fixed cost of a message (what a batch of 100 rows pays as much as one of 10,000 rows).

`--job count chain` measures the whole data path instead: a real job's source, keyed and sink
processes (`run_job`), CPU per batch each.

CPU time, unlike wall-clock time, is little affected by other load on a shared machine, but run
each size more than once (`--repeat`). Run: `.venv/bin/python bench/data_path.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pyarrow as pa
import yaml

from keyshift.runtime.auth import Security
from keyshift.runtime.job_secret import SECRET_ENV, new_job_secret
from keyshift.runtime.records import record_schema
from keyshift.runtime.transport import BATCH, END, Inbox, Outlet, start_server

FIELDS = {"key": "int", "value": "float"}
# The chained functions (examples/pages.py), imported by the job's check here and by the
# instances, which run in this directory.
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def batch_of(rows: int) -> pa.RecordBatch:
    schema = record_schema(FIELDS)
    rng = np.random.default_rng(1)
    columns = {
        "key": rng.integers(0, 1_000_000, rows),
        "value": rng.random(rows),
    }
    arrays = [
        pa.array(columns[field.name]) if field.name in columns else pa.array(np.arange(rows))
        for field in schema
    ]
    return pa.RecordBatch.from_arrays(
        [array.cast(field.type) for array, field in zip(arrays, schema, strict=True)],
        schema=schema,
    )


def receive(port_file: Path) -> None:
    """The child: serve an inbox, take every message until END, print what it cost."""
    inbox = Inbox()
    server, port = start_server("127.0.0.1:0", [inbox.handler()], max_calls=4)
    inbox.open(credits_per_sender=8)
    port_file.write_text(str(port))
    messages = 0
    start_cpu = start = None
    while True:
        delivery = inbox.get(timeout=60)
        if delivery is None:
            raise SystemExit("no message for 60 s")
        if delivery.kind == END:
            break
        if start is None:
            start, start_cpu = time.perf_counter(), cpu_seconds()
        assert delivery.records is not None and delivery.records.num_rows > 0
        delivery.release()
        messages += 1
    assert start is not None and start_cpu is not None
    print(json.dumps({"messages": messages, "cpu_s": cpu_seconds() - start_cpu,
                      "wall_s": time.perf_counter() - start}))  # fmt: skip
    server.stop(0)


def run_one(rows: int, seconds: float) -> dict[str, Any]:
    env = {**os.environ, SECRET_ENV: os.environ.get(SECRET_ENV) or new_job_secret()}
    os.environ[SECRET_ENV] = env[SECRET_ENV]
    port_file = Path(f"/tmp/keyshift-data-path-{os.getpid()}.port")
    port_file.unlink(missing_ok=True)
    child = subprocess.Popen(
        [sys.executable, __file__, "--receive", str(port_file)], env=env, stdout=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text():
            if time.monotonic() > deadline or child.poll() is not None:
                raise SystemExit("the receiver did not start")
            time.sleep(0.05)
        outlet = Outlet(f"127.0.0.1:{port_file.read_text()}", "bench-0", Security.from_env())
        batch = batch_of(rows)
        sent = 0
        start, start_cpu = time.perf_counter(), cpu_seconds()
        while time.perf_counter() - start < seconds:
            outlet.send(batch, kind=BATCH)
            sent += 1
        sender_cpu = cpu_seconds() - start_cpu
        outlet.finish(timeout=60)
        out, _ = child.communicate(timeout=120)
        got = json.loads(out)
    finally:
        child.kill()
        port_file.unlink(missing_ok=True)
    assert got["messages"] == sent, (got, sent)
    per = 1e6 / sent
    return {
        "rows": rows,
        "messages_per_s": round(sent / got["wall_s"]),
        "rows_per_s": round(sent * rows / got["wall_s"]),
        "send_cpu_us": round(sender_cpu * per),
        "receive_cpu_us": round(got["cpu_s"] * per),
    }


# --- the whole data path: a real job's processes -------------------------------------------

JOB_SHAPES = ("count", "chain")
JOB_STAGES = ("source", "counts", "sink")  # the processes on the data path, in order


def job_spec(shape: str, rows: int) -> dict[str, Any]:
    """generator -> keyed count -> discarding sink, each one instance, batches of `rows`
    records as fast as the job takes them; `chain` puts examples/pages.py's map and filter
    (run per record in the source's process) before the keyed stage."""
    source = {"name": "source", "kind": "source", "parallelism": 1,
              "config": {"kind": "generator", "keys": 1000, "seed": 1}}  # fmt: skip
    chained: list[dict[str, Any]] = []
    key_by = "key"
    if shape == "chain":
        view = {"user": "int", "page": "int", "seconds": "float"}
        chained = [
            {"name": "views", "kind": "map", "input": "source",
             "function": "examples.pages:to_view", "fields": view},
            {"name": "long-views", "kind": "filter", "input": "views",
             "function": "examples.pages:lasted"},
        ]  # fmt: skip
        key_by = "page"
    keyed = {"name": "counts", "kind": "keyed", "input": (chained or [source])[-1]["name"],
             "parallelism": 1, "key_by": key_by, "operator": {"function": "count"}}  # fmt: skip
    sink = {"name": "sink", "kind": "sink", "input": "counts",
            "config": {"kind": "log", "format": "none"}}  # fmt: skip
    return {
        "name": f"bench-data-path-{shape}",
        "graph": [source, *chained, keyed, sink],
        "batching": {"max_records": rows, "linger_ms": 5, "credits": 8},
    }


def cpu_of(pids: dict[str, int]) -> dict[str, float]:
    """User + system seconds of each process so far (all its threads)."""
    times = {name: psutil.Process(pid).cpu_times() for name, pid in pids.items()}
    return {name: t.user + t.system for name, t in times.items()}


def run_job(shape: str, rows: int, warmup: float, seconds: float) -> dict[str, Any]:
    """CPU per batch of each process on the data path, over a steady window.

    Batches are counted from the source's own counter of the records it made, `rows` a batch;
    with one instance a stage nothing is split, so the keyed stage takes and the sink gets
    one message per batch (the keyed stage's updates go on as one batch; in `chain`, a batch
    the filter empties goes nowhere: ~1 % of them at one row)."""
    # Here, not at the top: the transport's receiving child starts without the local host.
    from throughput import ratio, snapshot, start_flowing

    from keyshift.operator.local_host import LocalJob
    from keyshift.runtime.job import parse_job

    spec_data = job_spec(shape, rows)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.yaml"
        path.write_text(yaml.safe_dump(spec_data))
        with LocalJob(parse_job(spec_data), path, log_dir=Path(tmp) / "logs") as local:
            start_flowing(local)
            time.sleep(warmup)
            stages = {s["name"]: s["instances"][0] for s in local.status()["stages"]}
            pids = {name: stages[name]["pid"] for name in JOB_STAGES}
            before, cpu_before, t0 = snapshot(local), cpu_of(pids), time.monotonic()
            time.sleep(seconds)
            after, cpu_after, t1 = snapshot(local), cpu_of(pids), time.monotonic()
    # The batch rate over the source's own clock (its counters are as of its last report),
    # the CPU over this one's.
    batches_per_s = ratio(before["source"], after["source"], "records_in") / rows
    result: dict[str, Any] = {"shape": shape, "rows": rows, "batches_per_s": round(batches_per_s)}
    for name in JOB_STAGES:
        cpu_per_s = (cpu_after[name] - cpu_before[name]) / (t1 - t0)
        result[f"{name}_cpu_us"] = round(1e6 * cpu_per_s / batches_per_s)
        result[f"{name}_cores"] = round(cpu_per_s, 2)
    return result


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each number's median over the runs (the rest as the first run has it)."""
    first = runs[0]
    return {
        k: statistics.median(r[k] for r in runs) if isinstance(v, int | float) else v
        for k, v in first.items()
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[100, 1000, 10_000])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument(
        "--job", nargs="+", choices=JOB_SHAPES, help="measure a job's processes, not the transport"
    )
    parser.add_argument("--warmup", type=float, default=3.0, help="--job: seconds before measuring")
    parser.add_argument("--receive", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receive:
        receive(args.receive)
        return 0
    if args.job:
        for shape in args.job:
            for rows in args.rows:
                runs = [run_job(shape, rows, args.warmup, args.seconds) for _ in range(args.repeat)]
                print(json.dumps({"load": os.getloadavg()[0], **median_of(runs)}), flush=True)
        return 0
    for rows in args.rows:
        runs = [run_one(rows, args.seconds) for _ in range(args.repeat)]
        print(json.dumps(median_of(runs)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
