"""The ingest endpoint's limits (keyshift.runtime.ingest.IngestLimits) over a real loopback
gRPC server: a push above the row or byte cap is refused whole with INVALID_ARGUMENT naming
the limit and nothing of it is accepted; the client splits its pushes under the caps so its
users never meet them, and a retried split push is applied once; staged parts are capped, the
least recently staged transaction making room with a clear error at its commit; JSON parsed in
chunks gives the same rows, reasons and order as in one piece. Last, the same in a running job
with checkpoints: it keeps running and counts every row once."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pyarrow as pa
import pytest

from keyshift.runtime import ingest
from keyshift.runtime.ingest import IngestLimits, IngestService
from keyshift.runtime.ingest_client import IngestClient, IngestError, encode_rows, split_rows
from keyshift.runtime.transport import start_server
from tests.conftest import count_job, ingest_address, latest_by_version, running_job, wait_for

FIELDS = {"user": "str", "clicks": "int"}
LIMITS = IngestLimits(max_request_rows=100, max_request_bytes=4096, max_staged_bytes=4096)


def rows(start: int, stop: int) -> list[dict[str, Any]]:
    return [{"user": f"u{i % 7}", "clicks": i} for i in range(start, stop)]


@pytest.fixture
def endpoint() -> Iterator[Callable[[IngestLimits], tuple[IngestService, str]]]:
    servers: list[grpc.Server] = []

    def make(limits: IngestLimits = LIMITS) -> tuple[IngestService, str]:
        service = IngestService(FIELDS, 0, 1000, lambda *_: None, limits=limits)
        server, port = start_server("127.0.0.1:0", [service.handler()])
        servers.append(server)
        return service, f"127.0.0.1:{port}"

    try:
        yield make
    finally:
        for server in servers:
            server.stop(0)


Endpoint = Callable[..., tuple[IngestService, str]]


def taken(service: IngestService) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    while (batch := service.take(0)) is not None:
        out += batch.select(["user", "clicks", "seq"]).to_pylist()
    return out


@pytest.mark.parametrize(
    ("payload_rows", "limit"),
    [
        (
            rows(0, 101),
            "the push has more than 100 rows, over this endpoint's max_request_rows (100)",
        ),
        (
            pa.Table.from_pylist(rows(0, 101)),
            "the push has 101 rows, over this endpoint's max_request_rows (100)",
        ),
        (
            [{"user": "x" * 5000, "clicks": 1}],
            "over this endpoint's max_request_bytes (4,096); split it",
        ),
        (
            pa.table({"user": ["x" * 5000], "clicks": [1]}),
            "over this endpoint's max_request_bytes (4,096); split it",
        ),
    ],
)
def test_a_push_above_a_cap_is_refused_whole_naming_the_limit(
    endpoint: Endpoint, payload_rows: Any, limit: str
) -> None:
    service, address = endpoint()
    with IngestClient(address) as client:
        with pytest.raises(IngestError, match=re.escape(limit)) as caught:
            client.push_payload(*encode_rows(payload_rows))  # as one push, unsplit
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert service.pending() == 0
        assert client.push(rows(0, 3)).first_seq == 0  # no sequence number was used up


def test_the_client_splits_pushes_under_the_caps_and_a_retry_applies_once(
    endpoint: Endpoint,
) -> None:
    service, address = endpoint()
    with IngestClient(address, LIMITS.max_request_rows, LIMITS.max_request_bytes) as client:
        for i, batch in enumerate([rows(0, 1000), pa.Table.from_pylist(rows(1000, 2000))]):
            reply = client.push(batch, batch_id=f"b{i}")
            assert (reply.accepted, reply.rejected, reply.duplicate) == (1000, 0, False)
            again = client.push(batch, batch_id=f"b{i}")
            assert again.duplicate and again.accepted == 0
        mixed = client.push([*rows(2000, 2150), {"user": 5, "clicks": 1}], batch_id="m")
        assert (mixed.accepted, mixed.rejected) == (150, 1)
        assert mixed.reasons == ("field 'user' should be str, got int",)
    got = taken(service)
    assert [(r["user"], r["clicks"]) for r in got] == [
        (r["user"], r["clicks"]) for r in rows(0, 2150)
    ]
    assert [r["seq"] for r in got] == list(range(2150))


def test_split_rows_keeps_every_piece_within_the_caps() -> None:
    varied = [{"user": "x" * (i % 50), "clicks": i} for i in range(500)]
    for source in (varied, pa.Table.from_pylist(varied)):
        pieces = list(split_rows(source, 64, 2048))
        assert all(count <= 64 and len(payload) <= 2048 for _, payload, count in pieces)
        assert sum(count for *_, count in pieces) == 500
    assert [count for *_, count in split_rows([], 64, 2048)] == [0]
    with pytest.raises(ValueError, match="row 1 alone takes"):
        list(split_rows([{"user": "a"}, {"user": "b" * 3000}], 64, 2048))
    for limits in ((0, 2048), (64, 0)):
        with pytest.raises(ValueError, match="an endpoint's limits are positive"):
            list(split_rows(varied, *limits))
        with pytest.raises(ValueError, match="an endpoint's limits are positive"):
            IngestClient("127.0.0.1:1", *limits)


def staged_bytes(service: IngestService) -> int:
    return sum(s.nbytes for s in service._staged.values())


def test_staging_past_the_cap_drops_the_oldest_other_transaction_with_a_clear_error(
    endpoint: Endpoint,
) -> None:
    service, address = endpoint(IngestLimits(1000, 1 << 20, max_staged_bytes=3000))
    with IngestClient(address) as client:
        # ~1,300 bytes of Arrow per part: two fit, the third makes room.
        for transaction in ("t1", "t2", "t3"):
            client.stage(rows(0, 90), transaction, "0-0")
            assert staged_bytes(service) <= 3000
        with pytest.raises(IngestError, match=re.escape("max_staged_bytes is 3,000")) as caught:
            client.commit("t1", ["0-0"])
        assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "retry the whole batch" in str(caught.value)
        assert client.commit("t2", ["0-0"]).accepted == 90
        assert client.commit("t3", ["0-0"]).accepted == 90
        # A transaction that alone would pass the cap is refused; the others' parts stay.
        client.stage(rows(0, 10), "small", "0-0")
        client.stage(rows(0, 90), "big", "0-0")
        with pytest.raises(IngestError, match=r"'big' would stage [\d,]+ bytes") as caught:
            client.stage(rows(0, 150), "big", "0-1")
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert client.commit("small", ["0-0"]).accepted == 10
        assert client.commit("big", ["0-0"]).accepted == 90  # its first part was kept
    assert len(taken(service)) == 280


def test_json_parsed_in_chunks_gives_the_rows_and_reasons_of_one_piece(
    endpoint: Endpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ingest, "JSON_CHUNK_ROWS", 4)
    service, address = endpoint(IngestLimits(1000, 1 << 20, 1 << 20))
    pushed = [
        {**row, **({"event_time": 7} if i % 3 == 0 else {})} for i, row in enumerate(rows(0, 30))
    ]
    pushed[5]["clicks"] = None
    pushed[9]["user"] = 1
    pushed[13]["clicks"] = None
    with IngestClient(address) as client:
        reply = client.push(pushed)
        assert (reply.accepted, reply.rejected) == (27, 3)
        assert reply.reasons == ("missing field 'clicks'", "field 'user' should be str, got int")
        for body, message in [
            (b" [ ] ", None),
            (b"[1,]", "not JSON"),
            (b"[{}, {} ]]", "extra data"),
            (b"[{} {}]", "expected ',' or ']'"),
            (b"\xff[]", "not JSON"),
            (b'{"a": 1}', "must be an array of row objects, got dict"),
        ]:
            if message is None:
                assert client.push_payload("json", body).accepted == 0
                continue
            with pytest.raises(IngestError, match=message) as caught:
                client.push_payload("json", body)
            assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    batch = service.take(0)
    assert batch is not None and service.take(0) is None
    kept = [r for i, r in enumerate(pushed) if i not in (5, 9, 13)]
    assert batch.column("clicks").to_pylist() == [r["clicks"] for r in kept]
    times = batch.column("event_time").to_pylist()
    assert [t == 7 for t in times] == ["event_time" in r for r in kept]


def test_the_spark_writer_stages_parts_under_the_caps(endpoint: Endpoint) -> None:
    # The writer's task and driver sides, called as Spark calls them, without a Spark session
    # (the live Spark path is in tests/test_spark.py; here only the splitting is at stake).
    from keyshift.spark.ingest_writer import KeyshiftBatchWriter, WriterOptions

    service, address = endpoint(IngestLimits(100, 4096, max_staged_bytes=1 << 20))
    options = {"endpoint": address, "maxrequestrows": "100", "maxrequestbytes": "4096"}
    writer = KeyshiftBatchWriter(options)
    table = pa.Table.from_pylist(rows(0, 1000))
    staged = writer.write(iter(table.to_batches(max_chunksize=300)))
    assert staged.rows == 1000 and len(staged.parts) >= 10
    writer.commit([staged])
    assert [r["clicks"] for r in taken(service)] == list(range(1000))
    for name, value in (("maxrequestrows", "0"), ("maxrequestbytes", "lots")):
        with pytest.raises(ValueError, match=f"option '{name}' must be a positive whole number"):
            WriterOptions.parse({"endpoint": address, name: value})


@pytest.mark.live
@pytest.mark.slow
def test_a_job_with_tight_limits_keeps_running_and_counts_every_row_once(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    limits = {"max_request_rows": 500, "max_request_bytes": 16384, "max_staged_bytes": 16384}
    job = count_job(
        fields=FIELDS,
        source={"parallelism": 1, "config": {"kind": "ingest", **limits}},
        keyed={"key_by": "user", "operator": {"function": "sum", "field": "clicks"}},
        sink={"config": {"kind": "log", "path": str(out), "format": "parquet"}},
        checkpoints={"interval": 0.5, "storage": str(tmp_path / "checkpoints")},
    )
    with running_job(tmp_path, job) as local:
        address = wait_for(lambda: ingest_address(local), 60, "the ingest endpoint")
        with IngestClient(address) as unaware:  # the default caps: larger than this job's
            with pytest.raises(
                IngestError, match=r"over this endpoint.s max_request_bytes \(16,384\)"
            ) as caught:
                unaware.push(rows(0, 3000), batch_id="too-big")
            assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with IngestClient(address, 500, 16384) as client:
            reply = client.push(rows(0, 3000), batch_id="split")
            assert (reply.accepted, reply.rejected) == (3000, 0)
            assert client.push(rows(0, 3000), batch_id="split").duplicate  # a retry: once
            # Three transactions of ~7 KB staged at once: the first is pushed out.
            for transaction in ("t1", "t2", "t3"):
                client.stage(rows(3000, 3500), transaction, "0-0")
            with pytest.raises(IngestError, match="max_staged_bytes") as caught:
                client.commit("t1", ["0-0"])
            assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
            for transaction in ("t2", "t3"):
                assert client.commit(transaction, ["0-0"]).accepted == 500
            client.stage(rows(3000, 3500), "t1", "0-0")  # the writer retries the batch whole
            assert client.commit("t1", ["0-0"]).accepted == 500
        assert local.status()["phase"] == "running" and not local.recoveries
        local.drain()
        wait_for(lambda: local.status()["phase"] == "finished", 60, "the job to drain")
    truth: dict[str, int] = {}
    for row in rows(0, 3000) + rows(3000, 3500) * 3:
        truth[row["user"]] = truth.get(row["user"], 0) + row["clicks"]
    latest = latest_by_version(out)
    assert {u: v for u, (_, v) in latest.items()} == truth
    assert sum(n for n, _ in latest.values()) == 4500
