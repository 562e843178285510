"""Tests of the ingest endpoint (keyshift.runtime.ingest) and its client
(keyshift.runtime.ingest_client), over a real loopback gRPC server in this process: rows arrive
with the job's columns and consecutive sequence numbers, bad rows are rejected one by one,
unparseable requests as a whole, a retried batch id is applied once, and a full queue pushes
back on the client.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pyarrow as pa
import pytest

from keyshift.runtime import ingest
from keyshift.runtime.auth import Security
from keyshift.runtime.ingest import (
    NULL_EVENT_TIME,
    PUSH_METHOD,
    EventTimeCheck,
    IngestService,
    pack_request,
)
from keyshift.runtime.ingest_backlog import ClientBacklog
from keyshift.runtime.ingest_client import IngestClient, IngestError, IngestReply
from keyshift.runtime.records import now_us, record_schema
from keyshift.runtime.transport import GRPC_OPTIONS, TransportError, start_server
from tests.conftest import wait_for

FIELDS = {"user": "str", "clicks": "int", "amount": "float", "mobile": "bool"}
SOURCE_ID = 3
NO_TIME_CHECK = EventTimeCheck()


def good(i: int) -> dict[str, Any]:
    return {"user": f"u{i}", "clicks": i, "amount": i / 2, "mobile": i % 2 == 0}


def table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows)


@dataclass
class Endpoint:
    service: IngestService
    client: IngestClient
    port: int
    rejects: list[tuple[str, Any, int]] = field(default_factory=list)
    bad_times: list[tuple[Any, str]] = field(default_factory=list)  # (row, reason)

    def take(self) -> pa.RecordBatch:
        batch = self.service.take(timeout=5)
        assert batch is not None, "no batch arrived"
        return batch

    def rejected_counts(self) -> dict[str, int]:
        """Per reason, the rows rejected: for the schema, or (handed over apart, one by one)
        for their event time."""
        counts: dict[str, int] = {}
        for reason, _sample, count in self.rejects:
            counts[reason] = counts.get(reason, 0) + count
        for _row, reason in self.bad_times:
            counts[reason] = counts.get(reason, 0) + 1
        return counts


Start = Callable[..., Endpoint]


@pytest.fixture
def start() -> Iterator[Start]:
    started: list[tuple[grpc.Server, IngestClient]] = []

    def make(
        fields: dict[str, str] = FIELDS,
        max_pending: int = 64,
        push_timeout: float = 30.0,
        event_times: EventTimeCheck = NO_TIME_CHECK,
    ) -> Endpoint:
        rejects: list[tuple[str, Any, int]] = []
        bad_times: list[tuple[Any, str]] = []
        service = IngestService(
            fields,
            SOURCE_ID,
            max_pending,
            lambda reason, sample, count: rejects.append((reason, sample, count)),
            push_timeout=push_timeout,
            event_times=event_times,
            on_bad_times=lambda rows, reasons: bad_times.extend(zip(rows, reasons, strict=True)),
        )
        server, port = start_server("127.0.0.1:0", [service.handler()])
        client = IngestClient(f"127.0.0.1:{port}")
        started.append((server, client))
        return Endpoint(service, client, port, rejects, bad_times)

    try:
        yield make
    finally:
        for server, client in started:
            client.close()
            server.stop(0)


# --- rows arrive ------------------------------------------------------------------------------


def test_arrow_rows_arrive_with_job_columns_and_metadata(start: Start) -> None:
    ep = start()
    rows = [{**good(i), "extra": "ignored"} for i in range(5)]
    before = now_us()
    reply = ep.client.push(table(rows))
    after = now_us()
    assert reply == IngestReply(5, 0, (), duplicate=False, first_seq=0)
    batch = ep.take()
    assert batch.schema == record_schema(FIELDS)
    data = batch.to_pydict()
    for name in FIELDS:
        assert data[name] == [good(i)[name] for i in range(5)]
    assert data["seq"] == [0, 1, 2, 3, 4]
    assert data["source"] == [SOURCE_ID] * 5
    assert data["_group"] == [0] * 5
    stamp = data["ingest_time"][0]
    assert before <= stamp <= after and data["ingest_time"] == [stamp] * 5
    assert data["event_time"] == data["ingest_time"]  # no event_time column
    assert ep.service.pending() == 0 and ep.rejects == []


def test_json_rows_arrive_and_seqs_continue_across_pushes(start: Start) -> None:
    ep = start()
    assert ep.client.push(table([good(i) for i in range(3)])).first_seq == 0
    reply = ep.client.push([good(i) for i in range(3, 7)])
    assert reply == IngestReply(4, 0, (), duplicate=False, first_seq=3)
    assert ep.service.pending() == 2
    assert ep.take().column("seq").to_pylist() == [0, 1, 2]
    batch = ep.take()
    assert batch.schema == record_schema(FIELDS)
    assert batch.to_pydict()["seq"] == [3, 4, 5, 6]
    assert batch.to_pydict()["user"] == ["u3", "u4", "u5", "u6"]
    assert batch.to_pydict()["amount"] == [1.5, 2.0, 2.5, 3.0]


def test_record_batch_and_compatible_column_types_are_accepted(start: Start) -> None:
    ep = start()
    batch = pa.RecordBatch.from_pydict(
        {
            "user": pa.array(["a", "b", "a"]).dictionary_encode(),
            "clicks": pa.array([1, 2, 3], pa.int8()),
            "amount": pa.array([2**60 + 1, -1, 7], pa.int64()),  # int -> float
            "mobile": pa.array([True, False, True]),
        }
    )
    assert ep.client.push(batch).accepted == 3
    data = ep.take().to_pydict()
    assert data["user"] == ["a", "b", "a"]
    assert data["clicks"] == [1, 2, 3]
    assert data["amount"] == [float(2**60 + 1), -1.0, 7.0]
    large = pa.table(
        {
            "user": pa.array(["x"], pa.large_string()),
            "clicks": pa.array([2**63 - 1], pa.uint64()),
            "amount": pa.array([0.5], pa.float32()),
            "mobile": [False],
        }
    )
    assert ep.client.push(large).accepted == 1
    assert ep.take().to_pylist()[0] | {"ingest_time": 0, "event_time": 0} == {
        "user": "x",
        "clicks": 2**63 - 1,
        "amount": 0.5,
        "mobile": False,
        "event_time": 0,
        "ingest_time": 0,
        "source": SOURCE_ID,
        "seq": 3,
        "_group": 0,
    }


def test_event_time_is_honoured_and_null_means_ingest_time(start: Start) -> None:
    ep = start()
    rows = table([{**good(i), "event_time": t} for i, t in enumerate([100, None, 300])])
    ep.client.push(rows)
    data = ep.take().to_pydict()
    assert data["event_time"] == [100, data["ingest_time"][1], 300]
    stamps = pa.table(
        {
            **{n: table([good(0), good(1)]).column(n) for n in FIELDS},
            "event_time": pa.array([1_500, 2_000_000], pa.timestamp("ns", tz="UTC")),
        }
    )
    ep.client.push(stamps)
    assert ep.take().column("event_time").to_pylist() == [1, 2_000]
    ep.client.push([{**good(0), "event_time": 42}, good(1)])
    data = ep.take().to_pydict()
    assert data["event_time"] == [42, data["ingest_time"][1]]


# --- bad rows -----------------------------------------------------------------------------------


def test_arrow_bad_rows_are_rejected_and_the_rest_kept_in_order(start: Start) -> None:
    ep = start()
    rows = pa.table(
        {
            "user": ["a", None, "c", "d", "e", "f"],
            "clicks": pa.array([1, 2, 3, 2**64 - 1, 5, None], pa.uint64()),
            "amount": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
            "mobile": [True, True, False, False, True, True],
            "event_time": [10, 20, 30, 40, 50, 60],
        }
    )
    reply = ep.client.push(rows)
    range_reason = "field 'clicks' is out of the 64-bit integer range"
    assert reply.accepted == 3 and reply.rejected == 3
    assert reply.reasons == ("missing field 'user'", "missing field 'clicks'", range_reason)
    assert reply.first_seq == 0
    data = ep.take().to_pydict()
    assert data["user"] == ["a", "c", "e"] and data["clicks"] == [1, 3, 5]
    assert data["event_time"] == [10, 30, 50] and data["seq"] == [0, 1, 2]
    assert ep.rejected_counts() == {
        "missing field 'user'": 1,
        "missing field 'clicks'": 1,
        range_reason: 1,
    }
    samples = {reason: sample for reason, sample, _ in ep.rejects}
    assert samples[range_reason]["user"] == "d"


@pytest.mark.parametrize(
    ("column", "values", "reason"),
    [
        ("clicks", ["1", "2"], "field 'clicks' should be int, got string"),
        ("clicks", [True, False], "field 'clicks' should be int, got bool"),
        ("clicks", [1.0, 2.0], "field 'clicks' should be int, got double"),
        ("mobile", [1, 0], "field 'mobile' should be bool, got int64"),
        ("user", [1, 2], "field 'user' should be str, got int64"),
        ("amount", ["1.5", "2"], "field 'amount' should be float, got string"),
        ("event_time", ["x", "y"], "field 'event_time' should be int, got string"),
    ],
)
def test_a_column_of_the_wrong_type_rejects_every_row(
    start: Start, column: str, values: list[Any], reason: str
) -> None:
    ep = start()
    rows = table([good(0), good(1)]).drop_columns([column] if column in FIELDS else [])
    rows = rows.append_column(column, pa.array(values))
    reply = ep.client.push(rows)
    assert reply == IngestReply(0, 2, (reason,), duplicate=False, first_seq=None)
    assert ep.rejected_counts() == {reason: 2}
    assert ep.service.take(timeout=0) is None


def test_a_missing_column_rejects_every_row(start: Start) -> None:
    ep = start()
    reply = ep.client.push(table([good(0), good(1)]).drop_columns(["mobile"]))
    assert (reply.accepted, reply.rejected, reply.reasons) == (0, 2, ("missing field 'mobile'",))
    sample = {k: v for k, v in good(0).items() if k != "mobile"}
    assert ep.rejects == [("missing field 'mobile'", sample, 2)]


def test_json_bad_rows_are_rejected_and_the_rest_kept_in_order(start: Start) -> None:
    ep = start()
    missing = {k: v for k, v in good(1).items() if k != "amount"}
    rows: list[Any] = [
        good(0),
        missing,
        {**good(2), "user": None},
        {**good(3), "clicks": "3"},
        {**good(4), "clicks": True},
        {**good(5), "clicks": 2**63},
        good(6),
        {**good(7), "amount": 10**400},
        {**good(8), "event_time": "yesterday"},
        {**good(9), "clicks": -(2**63) - 1},
        good(10),
    ]
    reply = ep.client.push(rows)
    assert reply.accepted == 3 and reply.rejected == 8 and reply.first_seq == 0
    assert reply.reasons == (
        "missing field 'amount'",
        "missing field 'user'",
        "field 'clicks' should be int, got str",
        "field 'clicks' should be int, got bool",
        "field 'clicks' is out of the 64-bit integer range",
    )
    data = ep.take().to_pydict()
    assert data["user"] == ["u0", "u6", "u10"] and data["seq"] == [0, 1, 2]
    assert ep.rejected_counts() == {
        "missing field 'amount'": 1,
        "missing field 'user'": 1,
        "field 'clicks' should be int, got str": 1,
        "field 'clicks' should be int, got bool": 1,
        "field 'clicks' is out of the 64-bit integer range": 2,
        "field 'amount' is out of the float range": 1,
        "field 'event_time' should be int, got str": 1,
    }
    samples = {reason: sample for reason, sample, _ in ep.rejects}
    assert samples["missing field 'amount'"] == missing


def test_rows_whose_event_time_field_is_bad_go_to_the_bad_times_not_to_the_rejects(
    start: Start,
) -> None:
    """A source taking its event times from `clicks`: a row whose clicks are null or no int is
    a bad event time, even when something else is wrong with it too (its event time is judged
    first); handed over with its reason, row by row, on both formats. A row bad otherwise is a
    plain reject; the rest go on."""
    ep = start(event_times=EventTimeCheck(field="clicks"))
    rows = table([good(0), {**good(1), "clicks": None}, {**good(2), "user": None}, good(3),
                  {**good(4), "clicks": None, "user": None}])  # fmt: skip
    reply = ep.client.push(rows)
    assert reply.accepted == 2 and reply.rejected == 3
    assert ep.take().to_pydict()["user"] == ["u0", "u3"]
    missing = "missing field 'clicks'"
    assert [(row["user"], why) for row, why in ep.bad_times] == [("u1", missing), (None, missing)]
    assert ep.rejects == [("missing field 'user'", {**good(2), "user": None}, 1)]
    reply = ep.client.push([{**good(5), "clicks": "soon"}, {**good(6), "clicks": 1.5}, good(7)])
    assert reply.accepted == 1 and reply.rejected == 2
    assert [why for _, why in ep.bad_times[2:]] == [
        "field 'clicks' should be int, got str",
        "field 'clicks' should be int, got float",
    ]
    assert ep.bad_times[2][0] == {**good(5), "clicks": "soon"}
    reply = ep.client.push([{**good(8), "event_time": "x"}])  # unused, but no timestamp either
    assert reply.rejected == 1 and ep.bad_times[4][1] == "field 'event_time' should be int, got str"


def test_a_null_event_time_is_bad_in_a_source_with_event_time_and_the_ingest_time_else(
    start: Start,
) -> None:
    """With event-time settings (no field), a null where `event_time` is given is a bad event
    time; a row (or push) without it still takes its ingest time. Without them, a null is the
    ingest time as ever."""
    strict = start(event_times=EventTimeCheck(nulls_bad=True))
    rows = table([good(0), good(1), good(2)]).append_column(
        "event_time", pa.array([10, None, 30], pa.int64())
    )
    assert strict.client.push(rows).accepted == 2
    assert strict.take().to_pydict()["event_time"] == [10, 30]
    assert [(r["user"], why) for r, why in strict.bad_times] == [("u1", NULL_EVENT_TIME)]
    reply = strict.client.push([{**good(3), "event_time": None}, good(4)])
    assert reply.accepted == 1 and reply.reasons == (NULL_EVENT_TIME,)
    assert len(strict.bad_times) == 2 and strict.rejects == []
    lenient = start()
    assert lenient.client.push(rows).accepted == 3 and lenient.bad_times == []


def test_json_non_objects_are_rejected_and_ints_become_floats(start: Start) -> None:
    ep = start()
    reply = ep.client.push([5, {**good(1), "amount": 3}, "row"])
    assert reply.accepted == 1 and reply.rejected == 2
    assert set(reply.reasons) == {"not a record (got int)", "not a record (got str)"}
    assert ep.take().column("amount").to_pylist() == [3.0]


# --- requests refused as a whole ----------------------------------------------------------------


def raw_push(port: int, body: bytes) -> grpc.StatusCode:
    with Security.from_env().channel(f"127.0.0.1:{port}", GRPC_OPTIONS) as channel:
        try:
            channel.unary_unary(PUSH_METHOD, None, None)(body, timeout=5)
        except grpc.RpcError as exc:
            assert isinstance(exc, grpc.Call)
            return exc.code()
    return grpc.StatusCode.OK


def test_unparseable_requests_are_refused_and_nothing_is_accepted(start: Start) -> None:
    ep = start()
    ipc = ingest_ipc(table([good(i) for i in range(50)]))
    bad_payloads = [
        ("arrow", b"not arrow at all", "not an Arrow IPC stream"),
        ("arrow", ipc[: len(ipc) // 2], "not an Arrow IPC stream"),
        ("json", b"[{", "not JSON"),
        ("json", b"[" * 100_000, "not JSON"),
        ("json", b'{"user": "a"}', "must be an array of row objects, got dict"),
        ("xml", b"<rows/>", "'format' must be 'arrow' or 'json'"),
    ]
    for fmt, payload, message in bad_payloads:
        with pytest.raises(TransportError, match=message) as caught:
            ep.client.push_payload(fmt, payload)
        assert isinstance(caught.value, IngestError)
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert ep.client.address in str(caught.value)
    bad_bodies = [
        b"\x01",  # shorter than the header length
        b"\xff\x00\x00\x00{}",  # header length beyond the body
        b"\x03\x00\x00\x00{x}[]",  # header not JSON
        b"\x02\x00\x00\x00[][]",  # header not an object
        pack_request({}, b"[]"),  # no format
        pack_request({"format": "json", "batch_id": 7}, b"[]"),
    ]
    for body in bad_bodies:
        assert raw_push(ep.port, body) == grpc.StatusCode.INVALID_ARGUMENT, body
    assert ep.service.pending() == 0 and ep.rejects == []
    assert ep.client.push([good(0)]).first_seq == 0  # no sequence number was used up


def ingest_ipc(rows: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, rows.schema) as writer:
        writer.write_table(rows)
    return bytes(sink.getvalue().to_pybytes())


def test_unreachable_endpoint_raises_transport_error_naming_it(start: Start) -> None:
    server, port = start_server("127.0.0.1:0", [])
    server.stop(0)
    with (
        IngestClient(f"127.0.0.1:{port}") as client,
        pytest.raises(TransportError, match=f"127.0.0.1:{port}") as caught,
    ):
        client.push([good(0)], timeout=5)
    assert isinstance(caught.value, IngestError)
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE


# --- batch ids -----------------------------------------------------------------------------------


def test_a_retried_batch_id_is_not_applied_twice(start: Start) -> None:
    ep = start()
    rows = table([good(i) for i in range(3)])
    assert ep.client.push(rows, batch_id="query-1/7") == IngestReply(3, 0, (), False, 0)
    assert ep.client.push(rows, batch_id="query-1/7") == IngestReply(0, 0, (), True, None)
    assert ep.client.push([good(0)], batch_id="query-1/7").duplicate  # json: same id space
    assert ep.client.push(rows, batch_id="query-1/8").first_seq == 3
    assert ep.service.pending() == 2


def test_concurrent_pushes_of_one_batch_id_apply_it_once(start: Start) -> None:
    ep = start()
    replies = run_threads(4, lambda _: ep.client.push([good(1), good(2)], batch_id="b"))
    assert sorted(r.duplicate for r in replies) == [False, True, True, True]
    assert sum(r.accepted for r in replies) == 2 and ep.service.pending() == 1


def test_remembered_batch_ids_are_bounded(start: Start, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ingest, "REMEMBERED_BATCH_IDS", 3)
    ep = start()
    for i in range(4):
        assert not ep.client.push([good(i)], batch_id=f"b{i}").duplicate
    assert ep.client.push([good(0)], batch_id="b3").duplicate
    assert not ep.client.push([good(0)], batch_id="b0").duplicate  # forgotten: the oldest


# --- concurrency and backpressure -----------------------------------------------------------------


def run_threads(n: int, work: Callable[[int], Any]) -> list[Any]:
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = work(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    return results


def test_concurrent_pushes_get_disjoint_contiguous_seq_ranges(start: Start) -> None:
    ep = start(max_pending=1000)

    def pushes(thread: int) -> list[tuple[int, int]]:
        ranges = []
        for k in range(20):
            n = 1 + (thread * 7 + k) % 13
            rows = [good(i) for i in range(n)]
            reply = ep.client.push(table(rows) if k % 2 else rows)
            assert reply.accepted == n and reply.first_seq is not None
            ranges.append((reply.first_seq, n))
        return ranges

    ranges = sorted(r for rs in run_threads(4, pushes) for r in rs)
    position = 0
    for first, n in ranges:
        assert first == position, ranges
        position += n
    taken = []
    while (batch := ep.service.take(timeout=0)) is not None:
        seqs = batch.column("seq").to_pylist()
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        taken.append((seqs[0], len(seqs)))
    assert taken == ranges  # the queue holds batches in seq order


def test_a_full_queue_backpressures_pushes_until_space_is_taken(start: Start) -> None:
    ep = start(max_pending=1, push_timeout=0.3)
    assert ep.client.push([good(0), good(1)]).accepted == 2
    began = time.monotonic()
    with pytest.raises(IngestError, match="keyshift is backpressuring; retry") as caught:
        ep.client.push([good(2)], batch_id="retry-me")
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert time.monotonic() - began >= 0.3
    assert ep.service.pending() == 1

    ep.service.push_timeout = 30.0
    done = threading.Event()
    replies: list[IngestReply] = []

    def retry() -> None:
        replies.append(ep.client.push([good(2)], batch_id="retry-me"))
        done.set()

    pusher = threading.Thread(target=retry)
    pusher.start()
    try:
        assert not done.wait(0.3), "a push went through while the queue was full"
        assert ep.take().num_rows == 2
        wait_for(done.is_set, 5, "the blocked push to go through")
    finally:
        pusher.join(timeout=10)
    # The refused push used no sequence number and its batch id was not remembered.
    assert replies == [IngestReply(1, 0, (), duplicate=False, first_seq=2)]
    assert ep.take().column("seq").to_pylist() == [2]


def test_close_refuses_new_and_waiting_pushes_but_take_drains(start: Start) -> None:
    ep = start(max_pending=1)
    ep.client.push([good(0)])
    errors: list[IngestError] = []

    def blocked() -> None:
        try:
            ep.client.push([good(1)])
        except IngestError as exc:
            errors.append(exc)

    pusher = threading.Thread(target=blocked)
    pusher.start()
    ep.service.close()
    pusher.join(timeout=10)
    assert not pusher.is_alive()
    with pytest.raises(IngestError, match="job is draining") as caught:
        ep.client.push([good(2)])
    for error in [*errors, caught.value]:
        assert error.code == grpc.StatusCode.UNAVAILABLE
    assert len(errors) == 1
    assert ep.take().column("seq").to_pylist() == [0]
    assert ep.service.take(timeout=0) is None and ep.service.pending() == 0


def test_constructor_rejects_a_queue_without_room() -> None:
    with pytest.raises(ValueError, match="max_pending"):
        IngestService(FIELDS, 0, 0, lambda *_: None)


# --- two-phase pushes (the PySpark writer's) --------------------------------------------------


def test_staged_parts_flow_only_when_committed_and_only_once(start: Start) -> None:
    ep = start()
    assert ep.client.stage(table([good(0), good(1)]), "q:7", "0-0").accepted == 0
    ep.client.stage(table([good(2)]), "q:7", "1-0")
    assert ep.service.pending() == 0 and ep.service.staged_rows() == 3
    reply = ep.client.commit("q:7", ["0-0", "1-0"])
    assert (reply.accepted, reply.duplicate, reply.first_seq) == (3, False, 0)
    users = [u for _ in range(2) for u in ep.take().column("user").to_pylist()]
    assert users == ["u0", "u1", "u2"]
    # A retried micro-batch stages again and commits again: nothing more flows.
    assert ep.client.stage(table([good(0)]), "q:7", "0-0").duplicate
    assert ep.client.commit("q:7", ["0-0", "1-0"]).duplicate
    assert ep.service.pending() == 0 and ep.service.staged_rows() == 0


def test_a_retried_task_replaces_its_part_and_unnamed_attempts_are_dropped(start: Start) -> None:
    ep = start()
    ep.client.stage(table([good(0), good(1)]), "q:1", "0-0")  # attempt 0 failed after staging
    ep.client.stage(table([good(5)]), "q:1", "0-1")  # attempt 1 succeeded
    ep.client.stage(table([good(6)]), "q:1", "1-0")
    ep.client.stage(table([good(7)]), "q:1", "1-0")  # the same part again replaces it
    assert ep.client.commit("q:1", ["0-1", "1-0"]).accepted == 2
    users = [u for _ in range(2) for u in ep.take().column("user").to_pylist()]
    assert users == ["u5", "u7"]
    assert ep.service.staged_rows() == 0


def test_a_commit_naming_a_part_that_is_not_staged_applies_nothing(start: Start) -> None:
    ep = start()
    ep.client.stage(table([good(0)]), "q:2", "0-0")
    with pytest.raises(
        IngestError, match=r"parts \['1-0'\] of transaction 'q:2' are not staged"
    ) as exc:
        ep.client.commit("q:2", ["0-0", "1-0"])
    assert exc.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert ep.service.pending() == 0
    ep.client.stage(table([good(1)]), "q:2", "1-0")  # the retried batch stages every part
    assert ep.client.commit("q:2", ["0-0", "1-0"]).accepted == 2


def test_abort_and_expiry_drop_staged_parts(start: Start) -> None:
    ep = start()
    ep.client.stage(table([good(0)]), "q:3", "0-0")
    assert ep.client.abort("q:3") == 1
    assert ep.service.staged_rows() == 0 and ep.client.abort("q:3") == 0
    ep.service.staged_ttl = 0.0
    ep.client.stage(table([good(0)]), "old", "0-0")
    ep.client.stage(table([good(1)]), "new", "0-0")  # staging expires what is too old
    assert ep.service.staged_rows() == 1


def test_staging_rejects_bad_rows_and_keeps_the_valid_ones(start: Start) -> None:
    ep = start()
    reply = ep.client.stage([good(0), {**good(1), "clicks": None}, good(2)], "q:4", "0-0")
    assert (reply.accepted, reply.rejected) == (0, 1)
    assert reply.reasons == ("missing field 'clicks'",)
    assert ep.client.commit("q:4", ["0-0"]).accepted == 2
    assert ep.rejected_counts() == {"missing field 'clicks'": 1}


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ({"format": "json", "transaction": "t"}, "'transaction' and 'part' come together"),
        ({"format": "json", "transaction": "t", "part": "p", "batch_id": "b"}, "no 'batch_id'"),
        ({"format": "json", "transaction": 5, "part": "p"}, "'transaction' must be a non-empty"),
    ],
)
def test_malformed_two_phase_headers_are_refused(
    start: Start, header: dict[str, Any], message: str
) -> None:
    ep = start()
    with Security.from_env().channel(f"127.0.0.1:{ep.port}", GRPC_OPTIONS) as channel:
        push = channel.unary_unary(PUSH_METHOD, None, None)
        with pytest.raises(grpc.RpcError) as exc:
            push(pack_request(header, b"[]"), timeout=5)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (exc.value.details() or "")


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"nope", "commit request is not JSON"),
        (b"[]", "commit request must be a JSON object"),
        (b'{"transaction": "t"}', "needs 'transaction' (a string) and 'parts' (a list)"),
    ],
)
def test_malformed_commits_are_refused(start: Start, body: bytes, message: str) -> None:
    ep = start()
    with Security.from_env().channel(f"127.0.0.1:{ep.port}", GRPC_OPTIONS) as channel:
        commit = channel.unary_unary(ingest.COMMIT_METHOD, None, None)
        with pytest.raises(grpc.RpcError) as exc:
            commit(body, timeout=5)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (exc.value.details() or "")


def test_batch_ids_and_transactions_do_not_collide(start: Start) -> None:
    ep = start()
    assert not ep.client.push(table([good(0)]), batch_id="same").duplicate
    ep.client.stage(table([good(1)]), "same", "0-0")
    reply = ep.client.commit("same", ["0-0"])
    assert (reply.accepted, reply.duplicate) == (1, False)


# --- the backlog clients report -----------------------------------------------------------------


def test_pushes_report_the_clients_backlog_and_old_clients_report_none(start: Start) -> None:
    ep = start()
    ep.client.push([good(0)])  # an older client: no backlog field at all
    assert ep.service.client_backlogs.total(time.monotonic()).rows == 0
    ep.client.push([good(1)], backlog=ClientBacklog("spark-q", 5000, 1.5))
    ep.client.stage([good(2)], "t1", "p0", backlog=ClientBacklog("other", 200, 0.5))
    total = ep.service.client_backlogs.total(time.monotonic())
    assert total.rows == 5200 and total.oldest_seconds >= 1.5
    assert ep.service.pending_rows() == 2  # the rows themselves flow as ever


def test_a_split_push_tells_each_piece_the_rows_after_it(start: Start) -> None:
    ep = start()
    reports: list[int] = []
    report = ep.service.client_backlogs.report

    def spy(backlog: ClientBacklog, now: float) -> None:
        reports.append(backlog.rows)
        report(backlog, now)

    ep.service.client_backlogs.report = spy  # type: ignore[method-assign]
    with IngestClient(f"127.0.0.1:{ep.port}", max_request_rows=40) as client:
        reply = client.push([good(i) for i in range(100)], backlog=ClientBacklog("q", 7, 0.0))
    assert reply.accepted == 100
    assert reports == [67, 27, 7]  # pieces of 40, 40 and 20 rows


def test_a_bad_backlog_refuses_the_push_and_accepts_nothing(start: Start) -> None:
    ep = start()
    bad = [
        {"version": 2, "client": "q", "rows": 1, "oldest_seconds": 0.0},
        {"version": 1, "client": "q", "rows": -5, "oldest_seconds": 0.0},
        "lots",
    ]
    for backlog in bad:
        body = pack_request({"format": "json", "backlog": backlog}, b"[]")
        assert raw_push(ep.port, body) == grpc.StatusCode.INVALID_ARGUMENT, backlog
    header = {"format": "json", "backlog": bad[0]}
    with pytest.raises(ingest.IngestRefused, match="reads version 1"):
        ep.service.push(pack_request(header, b'[{"user": "a", "clicks": 1}]'))
    assert ep.service.pending() == 0
    assert ep.service.client_backlogs.total(time.monotonic()).rows == 0
