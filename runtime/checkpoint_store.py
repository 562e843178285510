"""Where checkpoints live: state shard files and each checkpoint's metadata, through fsspec.

Used by keyshift.runtime.state_checkpoint (which writes and reads keyed state through it) and,
as checkpoints are wired into the job, by the coordinator. A local directory by default; any
fsspec URL works, and `s3://bucket/prefix` goes through s3fs (tested against moto's S3 server).

Layout under the root URL::

    shards/<checkpoint:010d>-<writer>-<uuid>.arrow   Arrow IPC files of state rows
    shards/<checkpoint:010d>-<writer>-<uuid>-<name>  a file of a RocksDB instance's native
                                                    checkpoint (SSTs, MANIFEST, ...), first
                                                    uploaded for that checkpoint
    checkpoints/<checkpoint:010d>.json              the metadata of a completed checkpoint
    recovery/failure.json                           why the job is being restarted, and when
    recovery/history.json                           the recoveries so far (the last 100)

A shard is written before the metadata that names it, and the metadata last, in one write
(a rename on a local disk, a single PUT on S3): a checkpoint is complete exactly when its
metadata exists. Every shard's SHA-256 and size are in the metadata, and the metadata carries
the SHA-256 of its own body, so a corrupt or partial file is detected on read
(CheckpointCorrupt) and `latest_valid` falls back to the previous complete checkpoint. In a job
with a secret every shard and the metadata also carry an HMAC under the job's state key
(`keyshift.runtime.state_integrity`): a checksum only catches accidents, and whoever can write
the bucket could otherwise hand the job state (pickles included) of their own making. A file
whose HMAC is missing or wrong is treated as corrupt. Files
no retained checkpoint names are deleted by `retain` (after a crash, or a failed checkpoint).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import pyarrow as pa

from keyshift.runtime.state_integrity import StateIntegrityError, StateSeal
from keyshift.runtime.storage import Storage, StorageError

log = logging.getLogger("keyshift.checkpoints")

SHARDS = "shards"
CHECKPOINTS = "checkpoints"
FAILURE = "recovery/failure.json"
HISTORY = "recovery/history.json"
KEPT_RECOVERIES = 100
_METADATA_NAME = re.compile(r"^(\d{10})\.json$")
_WRITER_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,60}$")
FORMAT_VERSION = 3
# 1: before native RocksDB checkpoints (no databases); 2: before keyed stages in a line (no later)
_READABLE_FORMATS = (1, 2, 3)
_FILE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,100}$")


class CheckpointError(StorageError):
    """Checkpoint storage that cannot be used as asked (unreachable, full, misused)."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint file whose bytes do not match its checksum, or cannot be parsed."""


@dataclass(frozen=True)
class ShardFile:
    """One written shard: its path below the root, SHA-256, size in bytes and HMAC."""

    path: str
    sha256: str
    size: int
    mac: str | None = None  # None in a job without a secret


@dataclass(frozen=True)
class GroupChain:
    """A key group's state at a checkpoint: a base shard, then delta shards in order; or, for
    a group a RocksDB instance checkpointed natively, the writer whose database holds it (the
    checkpoint's `databases` names that database's files)."""

    files: tuple[ShardFile, ...]
    database: str | None = None

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class KeyedGroups:
    """A keyed stage's part of a checkpoint: its owners and its groups' chains."""

    assignment: dict[str, Any]
    groups: dict[int, GroupChain]


@dataclass(frozen=True)
class SinkOutputs:
    """A sink's part of a checkpoint: its output log's end offsets by partition, and which of
    its instances owned each partition (an assignment of partitions)."""

    outputs: dict[str, int]
    partitions: dict[str, Any]


@dataclass(frozen=True)
class CheckpointMeta:
    id: int
    created: float  # wall-clock seconds
    epochs: dict[str, int] = field(default_factory=dict)  # assignment epoch per stage
    sources: dict[str, Any] = field(default_factory=dict)  # source positions to rewind to
    outputs: dict[str, int] = field(default_factory=dict)  # output log end offsets, by partition
    groups: dict[int, GroupChain] = field(default_factory=dict)
    written: int = 0  # bytes written for this checkpoint (its new shards)
    assignment: dict[str, Any] = field(default_factory=dict)  # the keyed stage's owners
    # Native RocksDB checkpoints: per writer, its database's files by their local names.
    databases: dict[str, dict[str, ShardFile]] = field(default_factory=dict)
    # Per stage, its event-time watermark: the lowest of its instances' when they aligned.
    watermarks: dict[str, int] = field(default_factory=dict)
    # Per stage, each instance's (by index) when it aligned: a restore takes the windows of its
    # groups below it as fired (keyshift.runtime.windows).
    instance_watermarks: dict[str, dict[str, int]] = field(default_factory=dict)
    # The keyed stages after the first in a job of several (the first's are `assignment` and
    # `groups`, as in a job of one), by stage.
    later: dict[str, KeyedGroups] = field(default_factory=dict)
    # Which sink instance owned each output partition (an assignment of partitions; none in a
    # checkpoint taken before sinks rescaled: one partition per instance).
    partitions: dict[str, Any] = field(default_factory=dict)
    # The sinks after the first in a job of several (the first's are `outputs` and
    # `partitions`, as in a job of one), by stage.
    later_sinks: dict[str, SinkOutputs] = field(default_factory=dict)

    def of_sink(self, sink: str) -> SinkOutputs:
        """Sink `sink`'s offsets and partition owners (the first sink's: the top level's)."""
        return self.later_sinks.get(sink, SinkOutputs(self.outputs, self.partitions))

    def of_stage(self, stage: str) -> CheckpointMeta:
        """The checkpoint as keyed stage `stage` restores from it: that stage's owners and
        chains as `assignment` and `groups`."""
        if stage not in self.later:
            return self
        part = self.later[stage]
        return replace(self, assignment=part.assignment, groups=part.groups, later={})

    def stored(self) -> set[ShardFile]:
        """Every file the checkpoint names, each once (thousands of groups share a shard)."""
        chains = [self.groups, *(part.groups for part in self.later.values())]
        files = {f for groups in chains for chain in groups.values() for f in chain.files}
        return files | {f for database in self.databases.values() for f in database.values()}

    def files(self) -> set[str]:
        return {f.path for f in self.stored()}

    def size(self) -> int:
        """Bytes of all the files the checkpoint names: what a restore of every group reads."""
        return sum(f.size for f in self.stored())

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        body.update(chains_to_json(self.groups))
        body["later"] = {
            stage: {"assignment": part.assignment, **chains_to_json(part.groups)}
            for stage, part in self.later.items()
        }
        return {"format": FORMAT_VERSION, **body}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CheckpointMeta:
        if data.get("format") not in _READABLE_FORMATS:
            raise ValueError(f"unknown checkpoint format {data.get('format')!r}")
        return cls(
            id=int(data["id"]),
            created=float(data["created"]),
            epochs={str(k): int(v) for k, v in data["epochs"].items()},
            sources=dict(data["sources"]),
            outputs={str(k): int(v) for k, v in data["outputs"].items()},
            groups=chains_from_json(data),
            written=int(data["written"]),
            assignment=dict(data["assignment"]),
            databases=databases_from_json(data.get("databases", {})),
            later={
                str(stage): KeyedGroups(dict(part["assignment"]), chains_from_json(part))
                for stage, part in data.get("later", {}).items()
            },
            watermarks={str(k): int(v) for k, v in data.get("watermarks", {}).items()},
            instance_watermarks={
                str(stage): {str(i): int(mark) for i, mark in marks.items()}
                for stage, marks in data.get("instance_watermarks", {}).items()
            },
            partitions=dict(data.get("partitions", {})),
            later_sinks={
                str(sink): SinkOutputs(
                    {str(k): int(v) for k, v in part["outputs"].items()},
                    dict(part["partitions"]),
                )
                for sink, part in data.get("later_sinks", {}).items()
            },
        )


def chains_to_json(chains: Mapping[int, GroupChain]) -> dict[str, Any]:
    """Group chains as JSON: the distinct shards once, each group as indices into them (a
    group's chain shares its shards with thousands of other groups), or as the name of the
    database that holds it."""
    shards: dict[ShardFile, int] = {}
    groups: dict[str, list[int] | str] = {}
    for g, chain in sorted(chains.items()):
        if chain.database is not None:
            groups[str(g)] = chain.database
        else:
            groups[str(g)] = [shards.setdefault(f, len(shards)) for f in chain.files]
    return {"shards": [asdict(f) for f in shards], "groups": groups}


def chains_from_json(data: Mapping[str, Any]) -> dict[int, GroupChain]:
    shards = [ShardFile(**f) for f in data["shards"]]
    return {
        int(g): GroupChain((), ids)
        if isinstance(ids, str)
        else GroupChain(tuple(shards[i] for i in ids))
        for g, ids in data["groups"].items()
    }


def database_from_json(data: Mapping[str, Any]) -> dict[str, ShardFile]:
    """One database's files (local name -> stored file), as `asdict` wrote them. A name is
    where the file lands at a restore: anything but a RocksDB file name is refused."""
    bad = [name for name in data if not _FILE_NAME.match(str(name))]
    if bad:
        raise ValueError(f"database file names {bad[:3]} are not RocksDB file names")
    return {str(name): ShardFile(**f) for name, f in data.items()}


def databases_from_json(data: Mapping[str, Any]) -> dict[str, dict[str, ShardFile]]:
    return {str(writer): database_from_json(files) for writer, files in data.items()}


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class CheckpointStore(Storage):
    error = CheckpointError
    what = "checkpoint storage"

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        seal: StateSeal | None = None,
    ) -> None:
        super().__init__(url, storage_options)
        self.seal = seal if seal is not None else StateSeal.from_environment()
        self.skipped = 0  # corrupt checkpoints skipped by latest_valid, for the metric

    def _read(self, relative: str) -> bytes:
        try:
            return super()._read(relative)
        except FileNotFoundError:
            raise CheckpointCorrupt(f"checkpoint file {self.url}/{relative} is missing") from None

    # -- shards ---------------------------------------------------------------------------------

    def write_shard(self, checkpoint: int, writer: str, table: pa.Table) -> ShardFile:
        """Write state rows as a new shard file of `checkpoint`, named for its writer."""
        sink = io.BytesIO()
        with pa.ipc.new_file(sink, table.schema) as out:
            out.write_table(table)
        return self._write_file(checkpoint, writer, ".arrow", sink.getvalue())

    def write_database_file(
        self, checkpoint: int, writer: str, name: str, data: bytes
    ) -> ShardFile:
        """Store one file of a RocksDB instance's native checkpoint (`name` is its local name,
        kept at the end of the stored one), checksummed and sealed like a shard."""
        if not _FILE_NAME.match(name):
            raise CheckpointError(f"database file name {name!r} is not a RocksDB file name")
        return self._write_file(checkpoint, writer, f"-{name}", data)

    def _write_file(self, checkpoint: int, writer: str, suffix: str, data: bytes) -> ShardFile:
        if not _WRITER_NAME.match(writer):
            raise CheckpointError(f"writer name {writer!r} must be lower-case letters, digits, '-'")
        relative = f"{SHARDS}/{checkpoint:010d}-{writer}-{uuid.uuid4().hex[:12]}{suffix}"
        self._write(relative, data)
        return ShardFile(relative, _digest(data), len(data), self.seal.mac(data))

    def read_database_file(self, shard: ShardFile) -> bytes:
        """A stored database file's bytes, once its checksum and HMAC check out."""
        return self._checked(shard)

    def _checked(self, shard: ShardFile) -> bytes:
        data = self._read(shard.path)
        if len(data) != shard.size or _digest(data) != shard.sha256:
            raise CheckpointCorrupt(
                f"checkpoint shard {self.url}/{shard.path} does not match its checksum "
                f"({len(data)} bytes, expected {shard.size})"
            )
        try:
            self.seal.check_mac(data, shard.mac, f"checkpoint shard {self.url}/{shard.path}")
        except StateIntegrityError as exc:
            raise CheckpointCorrupt(str(exc)) from None
        return data

    def read_shard(self, shard: ShardFile) -> pa.Table:
        data = self._checked(shard)
        try:
            return pa.ipc.open_file(pa.py_buffer(data)).read_all()
        except (pa.ArrowException, ValueError) as exc:
            raise CheckpointCorrupt(f"checkpoint shard {self.url}/{shard.path}: {exc}") from exc

    # -- metadata -------------------------------------------------------------------------------

    def commit(self, meta: CheckpointMeta) -> None:
        """Complete a checkpoint: write its metadata, with the checksum and HMAC of its body."""
        body = json.dumps(meta.to_json(), sort_keys=True)
        document = json.dumps(
            {"sha256": _digest(body.encode()), "mac": self.seal.mac(body.encode()), "body": body}
        )
        self._write(f"{CHECKPOINTS}/{meta.id:010d}.json", document.encode())

    def completed(self) -> list[int]:
        """The ids of the checkpoints whose metadata exists, ascending."""
        ids = []
        for name in self._names(CHECKPOINTS):
            m = _METADATA_NAME.match(name)
            if m is not None:
                ids.append(int(m.group(1)))
        return sorted(ids)

    def load(self, checkpoint: int) -> CheckpointMeta:
        relative = f"{CHECKPOINTS}/{checkpoint:010d}.json"
        data = self._read(relative)
        try:
            document = json.loads(data)
            body = document["body"]
            if _digest(body.encode()) != document["sha256"]:
                raise CheckpointCorrupt(f"{self.url}/{relative} does not match its checksum")
            self.seal.check_mac(body.encode(), document.get("mac"), f"{self.url}/{relative}")
            return CheckpointMeta.from_json(json.loads(body))
        except CheckpointCorrupt:
            raise
        except StateIntegrityError as exc:
            raise CheckpointCorrupt(str(exc)) from None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointCorrupt(f"{self.url}/{relative} cannot be parsed: {exc}") from exc

    def verify(self, meta: CheckpointMeta) -> None:
        """Check that every file of a checkpoint is present and matches its checksum."""
        for shard in meta.stored():
            self._checked(shard)

    def latest_valid(self) -> CheckpointMeta | None:
        """The newest complete checkpoint whose files all verify; corrupt ones are skipped
        with a log line (and counted in `skipped`)."""
        for checkpoint in reversed(self.completed()):
            try:
                meta = self.load(checkpoint)
                self.verify(meta)
                return meta
            except CheckpointCorrupt as exc:
                self.skipped += 1
                log.error("skipping checkpoint %d for an older one: %s", checkpoint, exc)
        return None

    def discard_after(self, checkpoint: int) -> list[int]:
        """Delete the metadata of checkpoints newer than `checkpoint` (ones a restore skipped as
        corrupt: the job goes on from `checkpoint`, and numbers its next ones after them)."""
        doomed = [c for c in self.completed() if c > checkpoint]
        for c in doomed:
            self._delete(f"{CHECKPOINTS}/{c:010d}.json")
        return doomed

    # -- recoveries ------------------------------------------------------------------------------

    def note_failure(self, reason: str, at: float) -> None:
        """Say why the job is about to be restarted from a checkpoint (the recovery's start)."""
        self._write(FAILURE, json.dumps({"reason": reason, "at": at}).encode())

    def record_recovery(
        self, checkpoint: int, started: float, running: float, mode: str = "global"
    ) -> dict[str, Any]:
        """Add a recovery to the history once the recovered job runs: from `checkpoint`, timed
        from the noted failure (or from `started`, the restarted coordinator's start, when the
        coordinator itself was lost and noted nothing); `mode`: local (the lost instance
        replaced alone, the others rewound in place) or global (every process restarted). The
        entry added."""
        try:
            failure = json.loads(super()._read(FAILURE))
        except (FileNotFoundError, ValueError):
            failure = {"reason": "the coordinator was lost", "at": started}
        entry = {
            "checkpoint": checkpoint,
            "reason": str(failure["reason"]),
            "failed_at": float(failure["at"]),
            "running_at": running,
            "seconds": running - float(failure["at"]),
            "mode": mode,
        }
        history = [*self.recoveries(), entry][-KEPT_RECOVERIES:]
        self._write(HISTORY, json.dumps(history).encode())
        self._delete(FAILURE)
        return entry

    def recoveries(self) -> list[dict[str, Any]]:
        """The recoveries recorded so far, oldest first."""
        try:
            history = json.loads(super()._read(HISTORY))
        except FileNotFoundError:
            return []
        except ValueError as exc:
            log.error("ignoring a corrupt %s/%s: %s", self.url, HISTORY, exc)
            return []
        return list(history)

    # -- retention ------------------------------------------------------------------------------

    def retain(self, keep: int) -> list[str]:
        """Keep the newest `keep` complete checkpoints; delete older metadata and every shard
        that none of the kept ones names (shards newer than the newest kept checkpoint may
        belong to one being written, and stay). Returns the deleted paths."""
        if keep < 1:
            raise CheckpointError(f"keep must be at least 1, got {keep}")
        ids = self.completed()
        kept = ids[-keep:]
        if not kept:
            return []
        doomed = [f"{CHECKPOINTS}/{c:010d}.json" for c in ids[:-keep]]
        referenced: set[str] = set()
        for checkpoint in kept:
            referenced |= self.load(checkpoint).files()
        newest = kept[-1]
        for name in self._names(SHARDS):
            relative = f"{SHARDS}/{name}"
            prefix = relative.removeprefix(f"{SHARDS}/").split("-", 1)[0]
            in_progress = prefix.isdigit() and int(prefix) > newest
            if relative not in referenced and not in_progress:
                doomed.append(relative)
        for relative in doomed:
            self._delete(relative)
        return doomed
