"""How long the sink keeps its output log: until the named readers have committed it.

Used by the sink stage (keyshift.runtime.sink_stage) when its log sink names `readers` (a Spark
sink query reading with `spark.readStream.format("keyshift")` commits through
keyshift.runtime.output_log.commit_reader). A partition is trimmed up to the lowest offset all
readers committed; while one reader lags `max_unread` records behind, `blocked` says so and the
sink stops taking records, so the job is backpressured instead of dropping output.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from keyshift.runtime.output_log import OutputLogWriter, reader_offsets

CHECK_INTERVAL = 0.25  # seconds between reads of the readers' offsets


class LogRetention:
    def __init__(
        self,
        writer: OutputLogWriter,
        path: str | Path,
        readers: Sequence[str],
        max_unread: int,
        check_interval: float = CHECK_INTERVAL,
    ) -> None:
        self._writer = writer
        self._path = Path(path)
        self._readers = tuple(readers)
        self._max_unread = max_unread
        self._committed = writer.trimmed_offset
        self._check_interval = check_interval
        self._checked = -float("inf")

    @property
    def committed(self) -> int:
        """The lowest offset of this partition that every reader committed."""
        return self._committed

    def unread(self) -> int:
        """Records readers could read and have not: what is not published yet does not
        count (readers cannot catch up on it; the next checkpoint publishes it)."""
        return self._writer.visible_offset - self._committed

    def poll(self) -> None:
        """Read the readers' offsets now and then, and trim what all of them have read."""
        if not self._readers or time.monotonic() - self._checked < self._check_interval:
            return
        self._checked = time.monotonic()
        offsets = reader_offsets(self._path)
        partition = self._writer.partition
        committed = min(offsets.get(r, {}).get(partition, 0) for r in self._readers)
        # A reader cannot commit what it could not read; clamp a confused one.
        self._committed = max(self._committed, min(committed, self._writer.visible_offset))
        self._writer.trim(self._committed)

    def blocked(self) -> bool:
        """True while a reader lags too far behind: take no more records."""
        return bool(self._readers) and self.unread() >= self._max_unread
