"""Durable files through fsspec: whole-file writes that are never seen half-written, reads,
listings and deletes below one root URL.

The base of keyshift.runtime.checkpoint_store (checkpoints) and keyshift.runtime.ingest_log
(the ingest endpoint's log of accepted rows). A local directory by default; any fsspec URL
works, and `s3://bucket/prefix` goes through s3fs (tested against moto's S3 server).

This is the one place where a storage backend's failures are classified: whatever fsspec's
backends raise when storage is unreachable or full (OSError, botocore's and aiohttp's errors,
which s3fs lets through untranslated) becomes a StorageError with `retryable` set, so callers
handle one type. `Backoff` and `retrying` are how the callers try again (the checkpoint
driver, recovery, the sink's output log, the instances' start-up reads).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, TypeVar

log = logging.getLogger("keyshift.storage")
T = TypeVar("T")


class StorageError(RuntimeError):
    """Storage that cannot be used as asked (unreachable, full, misused). `retryable` when the
    storage failed (unreachable, timed out, full) and may work again later; not when what it
    holds is corrupt or the request is wrong."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


@functools.cache
def storage_failures() -> tuple[type[Exception], ...]:
    """What fsspec's backends raise when their storage fails: OSError (local disks, and
    s3fs's translation of S3's answers), and the HTTP clients' own errors for a connection
    that fails (s3fs re-raises those as they are), when those clients are installed. Looked
    up when a call fails, not at import: an instance that stores nothing never loads them."""
    errors: list[type[Exception]] = [OSError]
    for module, names in (
        ("botocore.exceptions", ("BotoCoreError", "ClientError")),
        ("aiohttp", ("ClientError",)),
    ):
        try:
            found = importlib.import_module(module)
        except ImportError:
            continue
        errors += [getattr(found, name) for name in names]
    return tuple(errors)


class Backoff:
    """Pauses between attempts at failing storage: `first` seconds, doubling up to `longest`;
    `reset` after a success."""

    def __init__(self, first: float = 0.5, longest: float = 30.0) -> None:
        self.first = first
        self.longest = longest
        self.failures = 0
        self.next_try = 0.0  # monotonic time before which not to try again

    def failed(self) -> float:
        """Count a failure; the pause before the next attempt."""
        pause = min(self.first * 2.0**self.failures, self.longest)
        self.failures += 1
        self.next_try = time.monotonic() + pause
        return pause

    def reset(self) -> None:
        self.failures = 0
        self.next_try = 0.0

    def due(self) -> bool:
        return time.monotonic() >= self.next_try


def retrying(
    call: Callable[[], T],
    what: str,
    stop: threading.Event | None = None,
    backoff: Backoff | None = None,
) -> T:
    """`call()`, tried again after a growing pause for as long as storage fails retryably
    (each failure logged with `what`); an error that is not retryable, or any once `stop` is
    set, is raised."""
    backoff = backoff or Backoff()
    while True:
        try:
            return call()
        except StorageError as exc:
            if not exc.retryable or (stop is not None and stop.is_set()):
                raise
            pause = backoff.failed()
            log.warning("%s: %s; trying again in %.1f s", what, exc, pause)
            if stop is not None and stop.wait(pause):
                raise
            if stop is None:
                time.sleep(pause)


class Storage:
    """Files below `url`; every failure is raised as `error` (a subclass names its use)."""

    error: ClassVar[type[StorageError]] = StorageError
    what: ClassVar[str] = "storage"

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        # Imported here, not with the module: most instances never store a file, and fsspec
        # would cost each of them memory and start time (see bench/README.md, wide jobs).
        import fsspec
        from fsspec.implementations.local import LocalFileSystem

        try:
            self.fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        except (ImportError, ValueError) as exc:
            raise self.error(f"cannot use {self.what} {url!r}: {exc}") from None
        self.url = url
        self.root = root.rstrip("/")
        self._local = isinstance(self.fs, LocalFileSystem)

    def _failed(self, verb: str, relative: str, exc: Exception) -> StorageError:
        return self.error(f"cannot {verb} {self.url}/{relative}: {exc}", retryable=True)

    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def _write(self, relative: str, data: bytes) -> None:
        """Write a whole file at once: a local file under a temporary name, fsynced and renamed,
        an object store's object in one PUT; never a half-written file under the final name."""
        path = self._path(relative)
        try:
            if self._local:
                self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
                tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())  # acknowledged means durable
                self.fs.mv(tmp, path)
            else:
                self.fs.pipe_file(path, data)
        except storage_failures() as exc:
            raise self._failed("write", relative, exc) from exc

    def _read(self, relative: str) -> bytes:
        """A file's bytes; FileNotFoundError when it is not there."""
        try:
            data: bytes = self.fs.cat_file(self._path(relative))
        except FileNotFoundError:
            raise
        except storage_failures() as exc:
            raise self._failed("read", relative, exc) from exc
        return data

    def _names(self, relative: str) -> list[str]:
        """The names of the files in a directory (none when it does not exist)."""
        try:
            entries = self.fs.ls(self._path(relative), detail=False)
        except FileNotFoundError:
            return []
        except storage_failures() as exc:
            raise self._failed("list", relative, exc) from exc
        return [str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries]

    def _delete(self, relative: str) -> None:
        """Delete a file; one that is already gone is fine."""
        try:
            self.fs.rm_file(self._path(relative))
        except FileNotFoundError:
            pass
        except storage_failures() as exc:
            raise self._failed("delete", relative, exc) from exc
