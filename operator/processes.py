"""Child processes of the local host: started with their logs in files, stopped for sure.

Children run in their own session, so a Ctrl-C at the terminal reaches the host alone (which
drains the job in order), and they learn the host's pid so they die with it even if the host is
killed outright (`keyshift.runtime.lifecycle`). Used by `keyshift.operator.local_host`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

from keyshift.runtime.lifecycle import PARENT_ENV


class Child:
    """One running child process of the local host."""

    def __init__(
        self, name: str, args: list[str], log_path: Path, env: dict[str, str] | None = None
    ):
        self.name = name
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-P", *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, PARENT_ENV: str(os.getpid()), **(env or {})},
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def exit_code(self) -> int | None:
        return self.process.poll()

    def exit_code_within(self, seconds: float) -> int | None:
        """The exit code once the process has exited, waiting up to `seconds` for it."""
        try:
            return self.process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return None

    def tail(self, lines: int = 15) -> str:
        try:
            with self.log_path.open("rb") as f:
                last = deque(f, maxlen=lines)
        except OSError:
            return ""
        return b"".join(last).decode(errors="replace").rstrip()

    def stop(self, grace: float) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds; always reaps the process."""
        if self.process.poll() is None:
            self.process.terminate()
            deadline = time.monotonic() + grace
            while self.process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            if self.process.poll() is None:
                self.process.kill()
        self.process.wait()
        self._log.close()
