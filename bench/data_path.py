"""Data-path benchmark: the CPU one message costs to send and to receive, per batch size.

Two processes on loopback, as two stage instances are: this one sends record batches of the
runtime's record schema (`keyshift.runtime.records.record_schema`) through an `Outlet`, with the
job's token checked like every call, and a child process takes them off its `Inbox`, decodes them
and hands the credit back, as a stage loop does. Measured per batch size, over `--seconds` of
sending as fast as the credits allow:

- messages/s and rows/s through the one stream;
- CPU per message at each end (user + system time of the whole process: gRPC's threads
  included), in µs, and at the receiver split into the decode and the rest;
- so the fixed cost of a message (what a batch of 100 rows pays as much as one of 10,000 rows).

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
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from keyshift.runtime.auth import Security
from keyshift.runtime.job_secret import SECRET_ENV, new_job_secret
from keyshift.runtime.records import decode, encode, record_schema
from keyshift.runtime.transport import BATCH, END, Inbox, Outlet, start_server

FIELDS = {"key": "int", "value": "float"}


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
    decode_s = 0.0
    start_cpu = start = None
    while True:
        delivery = inbox.get(timeout=60)
        if delivery is None:
            raise SystemExit("no message for 60 s")
        if delivery.kind == END:
            break
        if start is None:
            start, start_cpu = time.perf_counter(), cpu_seconds()
        t = time.perf_counter()
        batch = decode(delivery.payload)
        decode_s += time.perf_counter() - t
        assert batch.num_rows > 0
        delivery.release()
        messages += 1
    assert start is not None and start_cpu is not None
    print(json.dumps({"messages": messages, "cpu_s": cpu_seconds() - start_cpu,
                      "decode_s": decode_s, "wall_s": time.perf_counter() - start}))  # fmt: skip
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
        encode_s = 0.0
        start, start_cpu = time.perf_counter(), cpu_seconds()
        while time.perf_counter() - start < seconds:
            t = time.perf_counter()
            payload = encode(batch)
            encode_s += time.perf_counter() - t
            outlet.send(payload, kind=BATCH)
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
        "send_encode_us": round(encode_s * per),
        "receive_cpu_us": round(got["cpu_s"] * per),
        "receive_decode_us": round(got["decode_s"] * per),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[100, 1000, 10_000])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--receive", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receive:
        receive(args.receive)
        return 0
    results = []
    for rows in args.rows:
        runs = [run_one(rows, args.seconds) for _ in range(args.repeat)]
        median = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        results.append(median)
        print(json.dumps(median), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
