"""A size-capped tmpfs, for the tests of a full disk (the output log's): mounted for the test
and unmounted after it, also when it fails. Mounting needs root and a sandbox that allows it;
where it does not, the test is skipped, saying why."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_disk(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (as mount's `size=` option: "2m") mounted at `path`."""
    path.mkdir(parents=True, exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    mounted = subprocess.run(mount, capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=True)


def fill(disk: Path, leave: int) -> Path:
    """Fill the disk but for about `leave` bytes; the filler file (delete it to free them)."""
    filler = disk / "filler"
    with open(filler, "wb") as f:
        f.write(bytes(max(shutil.disk_usage(disk).free - leave, 0)))
    return filler
