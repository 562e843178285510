"""State that leaves a process is authenticated before it is decoded, and plain values never
need pickle (keyshift.runtime.state_integrity, keyshift.runtime.state_values).

The checkpoint cases write real shards and metadata to a local directory, then play the
attacker who can write the bucket: files rewritten with fresh SHA-256 checksums but without the
job's key must be refused, and the newest checkpoint an attacker did not touch is the one a
recovery picks. The live case rescales a job whose process-function state only pickle can
carry (real processes), so its sealed chunks and fetch replies travel between instances.
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from keyshift.runtime.checkpoint_store import CheckpointCorrupt, CheckpointStore
from keyshift.runtime.job_secret import SECRET_ENV, new_job_secret
from keyshift.runtime.state import ProcessState
from keyshift.runtime.state_integrity import StateIntegrityError, StateSeal
from keyshift.runtime.state_values import PICKLED, StateValueError, ValueCodec
from tests.job_fns import Tally, tally
from tests.test_checkpoints import aggregate, checkpoint
from tests.test_rescale import run_with_rescales, tracked_job
from tests.test_state import G, make_batch

KEY = b"k" * 32
plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text()
    | st.binary(),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(st.text() | st.integers(-100, 100), inner, max_size=4)
    ),
    max_leaves=20,
)


@given(plain)
def test_plain_values_round_trip_without_pickle(value: Any) -> None:
    codec = ValueCodec(allow_pickle=False)
    blob = codec.encode(value)
    assert not blob.startswith(PICKLED)
    assert codec.decode(blob) == value
    assert type(codec.decode(blob)) is type(value)


def test_other_values_need_a_job_whose_state_is_authenticated() -> None:
    with pytest.raises(StateValueError, match="only a job with a secret"):
        ValueCodec(allow_pickle=False).encode(Tally(3))
    trusted = ValueCodec(allow_pickle=True)
    blob = trusted.encode(Tally(3))
    assert blob.startswith(PICKLED) and trusted.decode(blob) == Tally(3)
    # A pickle arriving where nothing authenticated it is never loaded.
    with pytest.raises(StateValueError, match="refusing a pickled state value"):
        ValueCodec(allow_pickle=False).decode(blob)
    with pytest.raises(StateValueError, match="unknown encoding"):
        trusted.decode(b"x" + pickle.dumps(1))


def test_a_process_state_refuses_a_snapshot_holding_pickles_when_unauthenticated() -> None:
    state = ProcessState(tally, G, pa.int64(), ValueCodec(allow_pickle=True))
    state.apply(make_batch([1, 2], [1.0, 1.0]), "key")
    snapshot = state.snapshot_groups(range(G))
    with pytest.raises(StateValueError):
        ProcessState(tally, G, pa.int64()).restore(snapshot)


def test_a_sealed_message_opens_only_unchanged_and_under_the_same_key() -> None:
    seal = StateSeal(KEY)
    sealed = seal.seal(b"state bytes")
    assert bytes(seal.open(sealed, "chunk")) == b"state bytes"
    tampered = bytearray(sealed)
    tampered[0] ^= 1
    for bad in (bytes(tampered), sealed[:-1], b"short"):
        with pytest.raises(StateIntegrityError):
            seal.open(bad, "chunk")
    with pytest.raises(StateIntegrityError, match="does not match its signature"):
        StateSeal(b"o" * 32).open(sealed, "chunk")
    # Without a secret nothing is sealed or checked (and such a job keeps plain values only).
    unsealed = StateSeal(None)
    assert not unsealed.authenticated and unsealed.seal(b"x") == b"x"


def test_the_seal_comes_from_the_jobs_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert not StateSeal.from_environment().authenticated
    monkeypatch.setenv(SECRET_ENV, new_job_secret())
    first = StateSeal.from_environment()
    assert first.authenticated
    monkeypatch.setenv(SECRET_ENV, new_job_secret())
    with pytest.raises(StateIntegrityError):
        StateSeal.from_environment().open(first.seal(b"x"), "chunk from another job")


def _rewrite_with_fresh_checksum(path: Path, data: bytes) -> None:
    """What someone who can write the bucket but lacks the job's key can do."""
    path.write_bytes(data)


def test_checkpoint_files_forged_without_the_key_are_refused(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), seal=StateSeal(KEY))
    state = aggregate(5_000, 500)
    first, _ = checkpoint(store, state, 1, None)
    state.apply(make_batch([1, 2, 3], [1.0] * 3, first_seq=10**6), "key", "value")
    second, _ = checkpoint(store, state, 2, first)
    assert all(f.mac for chain in second.groups.values() for f in chain.files)
    assert store.latest_valid() == store.load(2)

    # A shard replaced by other bytes, its checksum in the metadata recomputed to match.
    meta_path = tmp_path / "checkpoints" / f"{2:010d}.json"
    document = json.loads(meta_path.read_text())
    body = json.loads(document["body"])
    forged = pickle.dumps({"anything": 1})
    shard = next(f for f in body["shards"] if f["path"].startswith(f"shards/{2:010d}"))
    _rewrite_with_fresh_checksum(tmp_path / shard["path"], forged)
    shard["sha256"], shard["size"] = hashlib.sha256(forged).hexdigest(), len(forged)
    document["body"] = json.dumps(body, sort_keys=True)
    document["sha256"] = hashlib.sha256(document["body"].encode()).hexdigest()
    meta_path.write_text(json.dumps(document))
    with pytest.raises(CheckpointCorrupt, match="does not match its signature"):
        store.load(2)
    # The metadata's signature left out altogether: refused too.
    document.pop("mac")
    meta_path.write_text(json.dumps(document))
    with pytest.raises(CheckpointCorrupt, match="not signed"):
        store.load(2)
    # A recovery goes back to the newest checkpoint nobody forged.
    assert store.latest_valid() == first
    assert store.skipped == 1


def test_a_job_with_a_secret_refuses_a_checkpoint_written_without_one(tmp_path: Path) -> None:
    checkpoint(CheckpointStore(str(tmp_path), seal=StateSeal(None)), aggregate(500, 50), 1, None)
    with pytest.raises(CheckpointCorrupt, match="not signed"):
        CheckpointStore(str(tmp_path), seal=StateSeal(KEY)).load(1)
    assert CheckpointStore(str(tmp_path), seal=StateSeal(KEY)).latest_valid() is None


@pytest.mark.live
@pytest.mark.slow
def test_pickled_state_moves_sealed_between_instances_exactly_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SECRET_ENV, new_job_secret())
    source = {"kind": "generator", "keys": 2000, "distribution": "zipf", "seed": 5,
              "profile": {"rate": 8_000}}  # fmt: skip
    job = tracked_job(tmp_path / "out", source, 1)
    job["keyed"]["operator"]["function"] = "tests.job_fns:tally"
    # Fetched keys (lazy) and pushed chunks (hot-first) both travel sealed.
    for result in run_with_rescales(tmp_path, source, 1, [(2, "lazy"), (1, "hot-first")], job):
        assert result["groups_moved"] == result["groups_to_move"] > 0
