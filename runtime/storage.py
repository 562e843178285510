"""Durable files through fsspec: whole-file writes that are never seen half-written, reads,
listings and deletes below one root URL.

The base of keyshift.runtime.checkpoint_store (checkpoints) and keyshift.runtime.ingest_log
(the ingest endpoint's log of accepted rows). A local directory by default; any fsspec URL
works, and `s3://bucket/prefix` goes through s3fs (tested against moto's S3 server).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from typing import Any, ClassVar


class StorageError(RuntimeError):
    """Storage that cannot be used as asked (unreachable, full, misused)."""


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
        except OSError as exc:
            raise self.error(f"cannot write {self.url}/{relative}: {exc}") from exc

    def _read(self, relative: str) -> bytes:
        """A file's bytes; FileNotFoundError when it is not there."""
        try:
            data: bytes = self.fs.cat_file(self._path(relative))
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise self.error(f"cannot read {self.url}/{relative}: {exc}") from exc
        return data

    def _names(self, relative: str) -> list[str]:
        """The names of the files in a directory (none when it does not exist)."""
        try:
            entries = self.fs.ls(self._path(relative), detail=False)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise self.error(f"cannot list {self.url}/{relative}: {exc}") from exc
        return [str(entry).rstrip("/").rsplit("/", 1)[-1] for entry in entries]

    def _delete(self, relative: str) -> None:
        """Delete a file; one that is already gone is fine."""
        try:
            self.fs.rm_file(self._path(relative))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise self.error(f"cannot delete {self.url}/{relative}: {exc}") from exc
