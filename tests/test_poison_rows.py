"""Poison rows on real processes: rows no stage could process (invalid UTF-8, lone surrogates,
NaN and infinities, floats beyond the double range) are rejected alone, at the ingest
endpoint or after the source's transforms, with their reasons; the job keeps running with no
recovery, and every valid row is counted once."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from keyshift.runtime.generator import KeyGenerator
from keyshift.runtime.ingest import IngestService, pack_request
from keyshift.runtime.ingest_client import IngestClient
from keyshift.runtime.job import GeneratorSource, JobError, parse_job
from tests.conftest import count_job, ingest_address, latest_by_version, running_job, wait_for


def invalid_utf8_users(users: list[bytes]) -> pa.Array:
    """A string array holding these bytes as they are (pa.array would refuse invalid UTF-8)."""
    offsets = [0]
    for user in users:
        offsets.append(offsets[-1] + len(user))
    return pa.Array.from_buffers(
        pa.string(),
        len(users),
        [
            None,
            pa.py_buffer(pa.array(offsets, pa.int32()).buffers()[1]),
            pa.py_buffer(b"".join(users)),
        ],
    )


def ingest_job(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    return count_job(
        fields={"user": "str", "amount": "float"},
        source={"parallelism": 1, "config": {"kind": "ingest"}},
        keyed={
            "name": "per-user",
            "parallelism": 2,
            "key_by": "user",
            "operator": {"function": "sum", "field": "amount"},
        },
        sink={"config": {"kind": "log", "path": str(tmp_path / "out"), "format": "parquet"}},
        checkpoints={"interval": 0.5, "storage": str(tmp_path / "checkpoints")},
        **overrides,
    )


@pytest.mark.live
@pytest.mark.slow
def test_poison_rows_at_the_endpoint_are_rejected_alone_and_the_job_goes_on(
    tmp_path: Path,
) -> None:
    with running_job(tmp_path, ingest_job(tmp_path)) as local:
        endpoint = wait_for(lambda: ingest_address(local), 60, "the ingest endpoint")
        with IngestClient(endpoint) as client:
            users = invalid_utf8_users([b"ann", b"bob", b"\xff\xfebad", b"ann", b"caf\xc3"])
            amounts = pa.array([1.0, 2.0, 4.0, 8.0, 16.0])
            reply = client.push(pa.table({"user": users, "amount": amounts}), batch_id="a")
            assert (reply.accepted, reply.rejected) == (3, 2)
            assert reply.reasons == ("field 'user' is not valid UTF-8",)

            rows = [{"user": "ann", "amount": 1.0}, {"user": "\ud800", "amount": 2.0},
                    {"user": "bob", "amount": 32.0}]  # fmt: skip
            reply = client.push(rows, batch_id="j")
            assert (reply.accepted, reply.rejected) == (2, 1)
            assert "field 'user' is not valid UTF-8" in reply.reasons[0]

            # json.dumps writes NaN and Infinity, as many JSON writers do.
            rows = [{"user": "ann", "amount": math.nan}, {"user": "bob", "amount": math.inf},
                    {"user": "cid", "amount": 64.0}]  # fmt: skip
            reply = client.push_payload("json", json.dumps(rows).encode(), batch_id="n")
            assert (reply.accepted, reply.rejected) == (1, 2)
            assert reply.reasons[0].startswith("field 'amount' is not a finite number")
            arrow = pa.table({"user": ["cid", "cid"], "amount": [-math.inf, 128.0]})
            assert client.push(arrow, batch_id="i").rejected == 1

        done = local.status()["checkpoints"]["completed"]
        wait_for(
            lambda: local.status()["checkpoints"]["completed"] >= done + 3, 60, "3 checkpoints"
        )
        status = local.status()
        assert status["phase"] == "running" and not local.recoveries
        assert status["stages"][0]["instances"][0]["stats"]["invalid"] == 6
        local.drain()
        wait_for(lambda: local.status()["phase"] == "finished", 60, "the job to drain")
    assert not local.recoveries
    latest = latest_by_version(tmp_path / "out")
    assert {u: v for u, (_, v) in latest.items()} == {"ann": 10.0, "bob": 34.0, "cid": 192.0}
    assert {u: n for u, (n, _) in latest.items()} == {"ann": 3, "bob": 2, "cid": 2}


@pytest.mark.live
@pytest.mark.slow
def test_poison_records_made_by_a_transform_are_rejected_alone(tmp_path: Path) -> None:
    total = 3000
    source = {"kind": "generator", "keys": 50, "seed": 4, "total": total}
    job = count_job(
        fields={"key": "int", "value": "float", "tag": "str"},
        source={"config": source, "transforms": [{"map": "tests.poison_fns:poison_some"}]},
        keyed={"operator": {"function": "sum", "field": "value"}},
        sink={"config": {"kind": "log", "path": str(tmp_path / "out"), "format": "parquet"}},
    )
    with running_job(tmp_path, job) as local:
        wait_for(lambda: local.status()["phase"] == "finished", 90, "the job to finish")
        stats = local.status()["stages"][0]["instances"][0]["stats"]
        assert stats["invalid"] == total // 5
    log = (tmp_path / "logs" / "source-0.log").read_text()
    for reason in ("is out of the float range", "'tag' is not valid UTF-8", "not a finite number"):
        assert reason in log
    keys, _ = KeyGenerator(GeneratorSource.model_validate(source), 0).records(0, total)
    truth = Counter(int(k) for seq, k in enumerate(keys) if seq % 5 != 0)
    latest = latest_by_version(tmp_path / "out")
    assert {k: v for k, (_, v) in latest.items()} == {k: float(n) for k, n in truth.items()}


def test_allow_non_finite_lets_named_float_fields_hold_nan_and_infinity() -> None:
    fields = {"user": "str", "amount": "float", "ratio": "float"}
    service = IngestService(fields, 0, 8, lambda *_: None, non_finite={"ratio"})
    rows = [{"user": "a", "amount": 1.0, "ratio": math.nan},
            {"user": "b", "amount": math.inf, "ratio": 1.0},
            {"user": "c", "amount": 2.0, "ratio": -math.inf}]  # fmt: skip
    for body in (json.dumps(rows).encode(), ingest_ipc(pa.Table.from_pylist(rows))):
        fmt = "json" if body.startswith(b"[") else "arrow"
        reply = service.push(pack_request({"format": fmt}, body))
        assert (reply["accepted"], reply["rejected"]) == (2, 1)
        assert reply["reasons"][0].startswith("field 'amount' is not a finite number")
    job = {"name": "x", "fields": fields, "source": {"config": {"kind": "ingest"}},
           "keyed": {"key_by": "user"}}  # fmt: skip
    with pytest.raises(JobError, match=r"allow_non_finite names \['user'\], which are not float"):
        parse_job({**job, "allow_non_finite": ["user"]})
    spec = parse_job({**job, "allow_non_finite": ["ratio"]})
    assert spec.allow_non_finite == ["ratio"]


def ingest_ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())
