"""The ingest endpoint's durable log (keyshift.runtime.ingest_log), through IngestService as a
source instance uses it, on a local directory and on S3 (moto's server on loopback): what was
acknowledged survives a restart of the instance, is replayed from a checkpoint's position,
and is still applied only once; staged parts can be committed after a restart; a completed
checkpoint lets the log delete rows but not what it remembers; storage that fails refuses
requests (retryably) instead of acknowledging what it could not keep, accepts them again once
it is back (moto's server stopped and started again), and a log that cannot be read yet is
waited for.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
from pathlib import Path
from typing import Any

import grpc
import pyarrow as pa
import pytest

from keyshift.runtime.ingest import REMEMBERED_BATCH_IDS, IngestRefused, IngestService, pack_request
from keyshift.runtime.ingest_client import encode_rows
from keyshift.runtime.ingest_log import IngestLog, IngestLogError
from tests.conftest import wait_for
from tests.s3_server import MotoServer, create_bucket, s3_bucket, s3_options

FIELDS = {"user": "str", "clicks": "int"}


def rows(first: int, n: int) -> pa.Table:
    return pa.table({"user": [f"u{i}" for i in range(first, first + n)], "clicks": list(range(n))})


def push(service: IngestService, table: pa.Table, batch_id: str) -> dict[str, Any]:
    fmt, payload = encode_rows(table)
    return service.push(pack_request({"format": fmt, "batch_id": batch_id}, payload))


def stage(service: IngestService, table: pa.Table, transaction: str, part: str) -> None:
    fmt, payload = encode_rows(table)
    service.push(pack_request({"format": fmt, "transaction": transaction, "part": part}, payload))


def commit(service: IngestService, transaction: str, parts: list[str]) -> dict[str, Any]:
    return service.commit(json.dumps({"transaction": transaction, "parts": parts}).encode())


def take_all(service: IngestService) -> pa.Table:
    batches = []
    while (batch := service.take(timeout=0.05)) is not None:
        batches.append(batch)
    return pa.Table.from_batches(batches) if batches else pa.table({})


class Storage:
    def __init__(self, url: str, options: dict[str, Any]) -> None:
        self.url, self.options = url, options
        self.failures = 0  # writes refused because storage failed (the metric's count)

    def failed(self) -> None:
        self.failures += 1

    def service(self, position: int | None) -> IngestService:
        """A source instance's endpoint starting on this log: fresh (None) or recovering."""
        durable = IngestLog(self.url, self.options, REMEMBERED_BATCH_IDS, self.failed)
        return IngestService(
            FIELDS, 0, 64, lambda *rejected: None, durable=durable, position=position
        )


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.live)])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "local":
        return Storage(str(tmp_path / "ingest"), {})
    endpoint = request.getfixturevalue("s3_endpoint")
    return Storage(f"s3://{s3_bucket(endpoint, 'ingest')}/job/source-0", s3_options(endpoint))


def test_acknowledged_rows_are_replayed_from_the_checkpoint_position(storage: Storage) -> None:
    first = storage.service(position=None)
    assert push(first, rows(0, 10), "b1")["first_seq"] == 0
    stage(first, rows(10, 5), "q:1", "0-0")
    stage(first, rows(15, 5), "q:1", "1-0")
    assert commit(first, "q:1", ["0-0", "1-0"])["first_seq"] == 10
    assert push(first, rows(20, 10), "b2")["first_seq"] == 20
    taken = take_all(first)
    assert taken.column("seq").to_pylist() == list(range(30))

    # The instance dies; the checkpoint it recovers from had taken rows 0..14.
    second = storage.service(position=15)
    assert second.next_seq == 15
    replayed = take_all(second)
    assert replayed.equals(taken.slice(15)), "the replay differs from what was taken"
    assert push(second, rows(0, 10), "b1")["duplicate"]
    assert commit(second, "q:1", ["0-0", "1-0"])["duplicate"]
    assert push(second, rows(30, 3), "b3")["first_seq"] == 30


def test_parts_staged_before_a_crash_are_committed_after_it(storage: Storage) -> None:
    first = storage.service(position=None)
    stage(first, rows(0, 4), "q:7", "0-0")
    stage(first, rows(4, 4), "q:7", "1-0")
    stage(first, rows(100, 4), "q:7", "1-1")  # an attempt the commit does not name
    assert first.staged_rows() == 12

    second = storage.service(position=0)
    assert second.staged_rows() == 12
    reply = commit(second, "q:7", ["0-0", "1-0"])
    assert (reply["accepted"], reply["duplicate"]) == (8, False)
    assert take_all(second).column("user").to_pylist() == [f"u{i}" for i in range(8)]
    assert second.staged_rows() == 0

    third = storage.service(position=0)  # committed: replayed, not staged again
    assert third.staged_rows() == 0
    assert take_all(third).num_rows == 8
    assert commit(third, "q:7", ["0-0", "1-0"])["duplicate"]


def test_a_completed_checkpoint_lets_rows_go_but_not_their_ids(storage: Storage) -> None:
    first = storage.service(position=None)
    for i in range(3):
        push(first, rows(10 * i, 10), f"b{i}")
    take_all(first)
    first.trim(20)  # a checkpoint with the source at 20 completed
    assert first.next_seq == 30

    after_crash = storage.service(position=20)
    assert take_all(after_crash).column("seq").to_pylist() == list(range(20, 30))
    assert all(push(after_crash, rows(0, 10), f"b{i}")["duplicate"] for i in range(3))

    # A fresh start (a new run) drops the rows, keeps the ids and goes on numbering.
    fresh = storage.service(position=None)
    assert take_all(fresh).num_rows == 0
    assert push(fresh, rows(0, 10), "b2")["duplicate"]
    assert push(fresh, rows(0, 10), "b9")["first_seq"] == 30


def test_storage_that_fails_refuses_pushes_and_acknowledges_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "ingest"
    service = Storage(str(directory), {}).service(position=None)
    push(service, rows(0, 5), "b0")
    shutil.rmtree(directory)
    directory.write_text("not a directory")  # the storage is gone
    with pytest.raises(IngestRefused, match="cannot log the rows durably") as refused:
        push(service, rows(5, 5), "b1")
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(IngestRefused, match="cannot keep the part durably"):
        stage(service, rows(5, 5), "q:1", "0-0")
    assert take_all(service).num_rows == 5  # only what was acknowledged
    assert service.staged_rows() == 0
    # A source instance starting meanwhile waits for its log rather than fail.
    opened: list[IngestService] = []
    starting = threading.Thread(
        target=lambda: opened.append(Storage(str(directory / "log"), {}).service(position=0)),
        daemon=True,
    )
    with caplog.at_level(logging.WARNING, logger="keyshift.storage"):
        starting.start()
        wait_for(lambda: "reading the ingest log" in caplog.text, 30, "a failed read")
        assert "Not a directory" in caplog.text and not opened
        directory.unlink()  # the storage is back (empty)
        starting.join(timeout=60)
    assert opened and take_all(opened[0]).num_rows == 0


def accepted(service: IngestService, table: pa.Table, batch_id: str) -> bool:
    """Push; False when refused retryably (as a client would try again)."""
    try:
        push(service, table, batch_id)
    except IngestRefused as exc:
        assert exc.code == grpc.StatusCode.UNAVAILABLE, exc
        return False
    return True


@pytest.mark.live
def test_an_s3_outage_refuses_rows_retryably_and_accepts_them_after(tmp_path: Path) -> None:
    with MotoServer() as server:
        bucket = s3_bucket(server.url, "outage")
        storage = Storage(f"s3://{bucket}/job/source-0", s3_options(server.url))
        service = storage.service(None)
        push(service, rows(0, 5), "b0")
        assert storage.failures == 0
        server.stop()
        with pytest.raises(IngestRefused, match="cannot log the rows durably: cannot write s3://"):
            push(service, rows(5, 5), "b1")
        # Until a pause has passed, rows are refused without waiting for storage again.
        with pytest.raises(IngestRefused, match="storage is failing") as refused:
            push(service, rows(5, 5), "b1")
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(IngestRefused, match="storage is failing"):
            stage(service, rows(5, 5), "q:1", "0-0")
        assert storage.failures == 3
        server.start()
        create_bucket(server.url, bucket)  # moto lost its buckets with its process
        wait_for(lambda: accepted(service, rows(5, 5), "b1"), 60, "the rows to be accepted")
        assert push(service, rows(5, 5), "b1")["duplicate"]
    assert take_all(service).column("user").to_pylist() == [f"u{i}" for i in range(10)]


def test_a_corrupt_log_file_is_an_error_naming_it(tmp_path: Path) -> None:
    directory = tmp_path / "ingest"
    service = Storage(str(directory), {}).service(position=None)
    push(service, rows(0, 5), "b0")
    (entry,) = (directory / "log").iterdir()
    entry.write_bytes(entry.read_bytes()[:-20])  # a partial write
    with pytest.raises(IngestLogError, match=f"corrupt ingest log file .*{entry.name}"):
        Storage(str(directory), {}).service(position=0)
