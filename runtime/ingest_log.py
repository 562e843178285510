"""The ingest endpoint's durable log: what it accepted, kept until a checkpoint covers it.

Used by keyshift.runtime.ingest (IngestService) when the job takes checkpoints; its storage
is the checkpoints' (a local directory or an fsspec URL such as s3://), one directory per
source instance. Every accepted request is written here before it is acknowledged, so a
client (the PySpark writer) that got an answer never has to send it again, and after a crash
the source replays from the checkpoint's position what the checkpoint does not hold yet.
Staged parts of open transactions are written here too, so a transaction staged before a
crash can still be committed after it; and the ids of applied batches and committed
transactions are recovered with the log, so a retry after a crash is still applied once.

Layout below the instance's directory::

    log/<first seq:020d>-<end seq:020d>.arrow   accepted rows (records ready to emit, with
                                                their sequence numbers), in an Arrow IPC file
                                                whose metadata names the request's once-id
    staged/<transaction hash>-<part hash>.arrow one staged part; its metadata names both
    seen.json                                   {"next_seq": n, "ids": [...]}: what the
                                                entries a checkpoint covered leave behind
    endpoint.json                               {"port": n}: the port it listened on, which
                                                a restarted instance takes again if it can,
                                                so that clients find it where they left it

`trim(position)` runs once a checkpoint with the source at `position` is complete: entries
wholly below it are deleted, their once-ids folded into seen.json first.

While its storage fails (unreachable, full), rows are refused, never accepted without being
durable: after a failed write, the next ones are refused at once (a retryable error naming
the failure) until a pause that doubles up to PAUSE_LIMIT has passed, and then tried again;
the first write that succeeds ends the pauses.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from keyshift.runtime.storage import Backoff, Storage, StorageError

log = logging.getLogger("keyshift.ingest")

LOG = "log"
STAGED = "staged"
SEEN = "seen.json"
ENDPOINT = "endpoint.json"
_ENTRY_NAME = re.compile(r"^(\d{20})-(\d{20})\.arrow$")
_STAGED_NAME = re.compile(r"^([0-9a-f]{32})-[0-9a-f]{16}\.arrow$")
_ONCE = b"keyshift.once"
_TRANSACTION = b"keyshift.transaction"
_PART = b"keyshift.part"
PAUSE_LIMIT = 5.0  # seconds: the longest a failing log refuses rows without trying storage


class IngestLogError(StorageError):
    """The ingest log cannot be written or read: the request is not acknowledged."""


def _hash(text: str, length: int) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def _ipc_file(batches: Sequence[pa.RecordBatch], metadata: dict[bytes, bytes]) -> bytes:
    schema = batches[0].schema.with_metadata(metadata)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as out:
        for batch in batches:
            out.write_batch(batch.replace_schema_metadata(metadata))
    return bytes(sink.getvalue())


@dataclass(frozen=True)
class Entry:
    first: int  # sequence number of its first row
    end: int  # one after its last
    once: str | None

    @property
    def name(self) -> str:
        return f"{LOG}/{self.first:020d}-{self.end:020d}.arrow"


@dataclass
class Reopened:
    """What a source instance finds in its log when it starts."""

    next_seq: int  # the sequence number the next accepted row gets
    seen: OrderedDict[str, None]  # once-ids applied, oldest first
    replay: list[pa.RecordBatch]  # rows at or after the position, to emit again first
    staged: dict[str, dict[str, pa.Table]] = field(default_factory=dict)  # transaction -> parts


class IngestLog(Storage):
    """One source instance's log; not thread-safe (IngestService calls it under its lock)."""

    error = IngestLogError
    what = "ingest log storage"

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any],
        remembered: int,
        on_failure: Callable[[], None] = lambda: None,
    ) -> None:
        """`on_failure` is called for each write refused because storage fails (a metric)."""
        super().__init__(url, storage_options)
        self.remembered = remembered
        self.on_failure = on_failure
        self._entries: list[Entry] = []  # not yet covered by a completed checkpoint
        # What the covered entries left behind (seen.json).
        self._next_seq = 0
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._backoff = Backoff(0.2, PAUSE_LIMIT)
        self._failure: StorageError | None = None  # the last failed write, while pausing

    # -- start ----------------------------------------------------------------------------

    def reopen(self, position: int | None) -> Reopened:
        """Read the log. With `position` (a recovery: the checkpoint's), the rows from there on
        are to be replayed; without (a fresh start), the rows earlier runs left are dropped,
        but not their once-ids nor their sequence numbers."""
        self._next_seq, self._seen = self._read_seen()
        seen = OrderedDict(self._seen)
        next_seq = self._next_seq
        replay: list[pa.RecordBatch] = []
        self._entries = []
        for entry, batches in self._read_entries():
            self._entries.append(entry)
            if entry.once is not None:
                seen[entry.once] = None
            next_seq = max(next_seq, entry.end)
            if position is not None and entry.end > position:
                replay += _rows_from(batches, entry.first, position)
        if position is None:
            dropped = sum(e.end - e.first for e in self._entries)
            if dropped:
                log.warning("a fresh start drops %d rows an earlier run left in its log", dropped)
            self.trim(next_seq)
        else:
            next_seq = max(next_seq, position)
        staged = self._read_staged(seen)
        return Reopened(next_seq, _newest(seen, self.remembered), replay, staged)

    def _read_seen(self) -> tuple[int, OrderedDict[str, None]]:
        try:
            data = json.loads(self._read(SEEN))
            return int(data["next_seq"]), OrderedDict.fromkeys(str(i) for i in data["ids"])
        except FileNotFoundError:
            return 0, OrderedDict()
        except (ValueError, KeyError, TypeError) as exc:
            raise self.error(f"corrupt {self.url}/{SEEN}: {exc}") from None

    def _read_entries(self) -> Iterable[tuple[Entry, list[pa.RecordBatch]]]:
        found = []
        for name in self._names(LOG):
            m = _ENTRY_NAME.match(name)
            if m is not None:
                found.append((int(m.group(1)), int(m.group(2)), f"{LOG}/{name}"))
        for first, end, relative in sorted(found):
            table, metadata = self._read_ipc(relative)
            once = metadata.get(_ONCE)
            yield Entry(first, end, once.decode() if once else None), table.to_batches()

    def _read_staged(self, applied: OrderedDict[str, None]) -> dict[str, dict[str, pa.Table]]:
        """Staged parts of the transactions not applied yet (the others' are deleted)."""
        staged: dict[str, dict[str, pa.Table]] = {}
        for name in self._names(STAGED):
            if _STAGED_NAME.match(name) is None:
                continue
            relative = f"{STAGED}/{name}"
            table, metadata = self._read_ipc(relative)
            transaction = metadata[_TRANSACTION].decode()
            if f"transaction {transaction}" in applied:
                self._delete(relative)
            else:
                staged.setdefault(transaction, {})[metadata[_PART].decode()] = table
        return staged

    def _read_ipc(self, relative: str) -> tuple[pa.Table, dict[bytes, bytes]]:
        try:
            reader = pa.ipc.open_file(pa.py_buffer(self._read(relative)))
            return reader.read_all().replace_schema_metadata(None), dict(
                reader.schema.metadata or {}
            )
        except FileNotFoundError:
            raise self.error(f"{self.url}/{relative} disappeared while reading") from None
        except (pa.ArrowException, ValueError) as exc:
            raise self.error(f"corrupt ingest log file {self.url}/{relative}: {exc}") from exc

    # -- while running ----------------------------------------------------------------------

    def append(self, first: int, batches: Sequence[pa.RecordBatch], once: str | None) -> None:
        """Write accepted rows (sequence numbers `first`..) durably; then they may be acked."""
        end = first + sum(b.num_rows for b in batches)
        entry = Entry(first, end, once)
        metadata = {_ONCE: once.encode()} if once is not None else {}
        self._durably(entry.name, _ipc_file(batches, metadata))
        self._entries.append(entry)

    def stage(self, transaction: str, part: str, rows: pa.Table) -> None:
        """Keep a staged part durably (a later one of the same name replaces it)."""
        metadata = {_TRANSACTION: transaction.encode(), _PART: part.encode()}
        batches = rows.to_batches() or [pa.RecordBatch.from_pylist([], schema=rows.schema)]
        self._durably(_staged_name(transaction, part), _ipc_file(batches, metadata))

    def _durably(self, relative: str, data: bytes) -> None:
        """Write what a client is about to be told is durable, unless storage failed moments
        ago: then refuse at once (a client retries) rather than wait for it again."""
        if self._failure is not None and not self._backoff.due():
            self.on_failure()
            raise self.error(f"storage is failing: {self._failure}", retryable=True)
        try:
            self._write(relative, data)
        except StorageError as exc:
            if exc.retryable:
                self.on_failure()
                self._failure = exc
                self._backoff.failed()
            raise
        if self._failure is not None:
            log.info("ingest log storage %s works again", self.url)
            self._failure = None
            self._backoff.reset()

    def unstage(self, transaction: str) -> None:
        """Delete a transaction's staged parts (committed, aborted or expired)."""
        prefix = _hash(transaction, 32)
        for name in self._names(STAGED):
            if name.startswith(prefix + "-"):
                self._delete(f"{STAGED}/{name}")

    def trim(self, position: int) -> int:
        """Delete the entries a completed checkpoint covers (wholly below `position`), keeping
        their once-ids; the rows deleted."""
        covered = [e for e in self._entries if e.end <= position]
        if not covered:
            return 0
        for entry in covered:
            self._next_seq = max(self._next_seq, entry.end)
            if entry.once is not None:
                self._seen[entry.once] = None
        self._seen = _newest(self._seen, self.remembered)
        body = {"next_seq": self._next_seq, "ids": list(self._seen)}
        self._write(SEEN, json.dumps(body).encode())  # before the entries go
        for entry in covered:
            self._delete(entry.name)
        self._entries = [e for e in self._entries if e.end > position]
        return sum(e.end - e.first for e in covered)

    def last_port(self) -> int | None:
        try:
            return int(json.loads(self._read(ENDPOINT))["port"])
        except FileNotFoundError:
            return None
        except (ValueError, KeyError, TypeError, StorageError):
            return None  # only a preference: any port will do

    def remember_port(self, port: int) -> None:
        try:
            self._write(ENDPOINT, json.dumps({"port": port}).encode())
        except StorageError as exc:  # only a preference for the next start
            log.warning("cannot remember the ingest port: %s", exc)

    def kept_rows(self) -> int:
        """Rows in the log that no completed checkpoint covers yet."""
        return sum(e.end - e.first for e in self._entries)


def ingest_log_url(storage: str, stage: str, index: int) -> str:
    """Where a source instance keeps its log: beside the job's checkpoints."""
    return f"{storage.rstrip('/')}/ingest/{stage}-{index}"


def _staged_name(transaction: str, part: str) -> str:
    return f"{STAGED}/{_hash(transaction, 32)}-{_hash(part, 16)}.arrow"


def _rows_from(batches: list[pa.RecordBatch], first: int, position: int) -> list[pa.RecordBatch]:
    """The rows of an entry whose sequence numbers are `position` or more (they are
    consecutive from `first`)."""
    out = []
    seq = first
    for batch in batches:
        skip = max(position - seq, 0)
        if skip < batch.num_rows:
            out.append(batch.slice(skip))
        seq += batch.num_rows
    return out


def _newest(ids: OrderedDict[str, None], keep: int) -> OrderedDict[str, None]:
    while len(ids) > keep:
        ids.popitem(last=False)
    return ids
