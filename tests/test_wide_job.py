"""Jobs wider than gRPC's old fixed pools: every instance holds a command stream on the
coordinator and every keyed instance a data stream into the sink, each for the job's whole life,
on a server thread of its own. With 64 threads per server a job of 72 instances could not
register; servers are now sized from the job's shape, and a call beyond a server's size is
refused at once with RESOURCE_EXHAUSTED rather than left to hang until its deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from keyshift.operator.local_host import run_job
from keyshift.runtime.transport import JsonClient, TransportError, json_handler, start_server
from tests.conftest import count_job, running_job, wait_for
from tests.test_rescale import check_output

WIDE = 80  # keyed instances: with the source and the sink, 82, more than the old 64 threads


def test_a_call_beyond_the_servers_size_is_refused_at_once_not_left_to_hang() -> None:
    held = threading.Event()

    def hold(body: dict[str, Any], context: grpc.ServicerContext) -> Iterator[dict[str, Any]]:
        yield {"held": True}
        while not held.wait(0.05) and context.is_active():
            pass

    handler = json_handler("t.Wide", {"Ping": lambda body: {"pong": True}}, {"Hold": hold})
    server, port = start_server("127.0.0.1:0", [handler], max_calls=2)
    clients = [JsonClient(f"127.0.0.1:{port}", "t.Wide") for _ in range(3)]
    try:
        open_streams = [clients[i].stream("Hold", {}) for i in range(2)]
        for stream in open_streams:
            assert next(stream) == {"held": True}
        started = time.monotonic()
        with pytest.raises(TransportError, match="was refused: it serves as many calls at once"):
            clients[2].call("Ping", timeout=20.0)
        assert time.monotonic() - started < 10.0, "refused only at the deadline"
        held.set()  # the streams end: their threads serve calls again
        wait_for(lambda: _answers(clients[2]), 10, "the server to answer once the streams ended")
    finally:
        held.set()
        for client in clients:
            client.close()
        server.stop(None)


def _answers(client: JsonClient) -> bool:
    try:
        return bool(client.call("Ping", timeout=2.0)["pong"])
    except TransportError:
        return False


@pytest.mark.slow
@pytest.mark.alone
def test_a_job_of_80_keyed_instances_registers_runs_and_drains_exactly_once(
    tmp_path: Path,
) -> None:
    source = {"kind": "generator", "keys": 400, "seed": 7, "profile": {"rate": 2000}}
    out = tmp_path / "out"
    job = count_job(
        source={"parallelism": 1, "config": source},
        keyed={
            "name": "track",
            "parallelism": WIDE,
            "operator": {"kind": "process", "function": "tests.job_fns:track"},
        },
        sink={"config": {"kind": "log", "path": str(out), "format": "jsonl"}},
    )
    # 82 processes start at once on the machine's two cores, each with ~0.8 s of CPU to spend
    # before it registers (README, Limits): about a minute here under load. The waits stay within
    # pytest's 300 s.
    with running_job(tmp_path, job, register_timeout=180.0) as local:
        wait_for(
            lambda: local.status()["phase"] == "running", 180, f"{WIDE + 2} instances to register"
        )
        assert {s["name"]: s["parallelism"] for s in local.status()["stages"]} == {
            "source": 1,
            "track": WIDE,
            "sink": 1,
        }
        result = run_job(local, duration=2.0, interrupted=threading.Event(), drain_timeout=60)
    assert result.status["phase"] == "finished", result.status["errors"]
    emitted = int(result.status["stages"][0]["instances"][0]["stats"]["emitted"])
    assert emitted > 0

    check_output(out, source, [emitted])
