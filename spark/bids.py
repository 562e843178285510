"""A NEXMark-like bid stream for Spark: `spark.readStream.format("keyshift-bids")`.

Used by the example source job (examples/spark/source_job.py), `make demo` and the tests. Bid
number `seq` is a pure function of (seed, seq): its auction is drawn zipf-skewed from
`auctions` (auction 0 is the hottest), its bidder uniformly, its price from 1 to 100 (keyshift's
own generator, keyshift.runtime.generator.KeyGenerator, draws them). So a stream query and a
batch query over the same bid numbers see the same bids, which is how a test or the demo gets
the expected aggregates. A streamed bid's `due_us` says when the profile made it due (epoch
microseconds); the keyshift writer's option `dueColumn` reports the backlog from it (null in a
batch read, which has no schedule).

The stream follows a load profile (the job file's `profile` models, given as JSON in option
`profile`): the offset `{"seq": n, "started": t}` says n bids are due, t being the wall-clock
start of the first run, kept in the offsets so a restarted query goes on with the same curve.
Option `total` ends the stream after that many bids; the batch read (`spark.read`) needs it.
Other options: `auctions` (default 10000), `zipf` (exponent, default 1.0), `seed` (default 0),
`partitions` (tasks per micro-batch, default 2), `maxRecordsPerBatch` (the stream's default
read limit; none by default).
"""

from __future__ import annotations

import json
import math
import time
from abc import abstractmethod
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
from pydantic import TypeAdapter, ValidationError
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows

from keyshift.runtime.generator import KeyGenerator, Pacer, records_due
from keyshift.runtime.job import GeneratorSource, LoadProfile

SCHEMA = "seq long, auction long, bidder long, price long, due_us long"
BIDDERS = 1_000_000
DUE_COLUMN = "due_us"
# Due times are interpolated between this many exact points of the schedule per partition
# (exact points for every bid would cost a bisection each): off by a few milliseconds at most,
# next to a corner of the profile, which a backlog report does not feel.
DUE_POINTS = 64
_PROFILE: TypeAdapter[Any] = TypeAdapter(LoadProfile)


class PacedOptions:
    """The options of a source paced by a load profile (this one and keyshift.spark.nexmark):
    `profile`, `total`, `seed`, `partitions`, `maxRecordsPerBatch`. Spark hands options over
    with lower-cased names."""

    def __init__(self, options: dict[str, str]) -> None:
        self.raw = options
        self.seed: int = self.number("seed", "0")
        self.partitions: int = self.number("partitions", "2", low=1)
        raw_max = options.get("maxrecordsperbatch")
        self.max_records: int | None = (
            None if raw_max is None else self.number("maxRecordsPerBatch", raw_max, low=1)
        )
        raw_total = options.get("total")
        self.total: int | None = None if raw_total is None else self.number("total", raw_total)
        raw_profile = options.get("profile")
        self.profile: Any = None
        if raw_profile is not None:
            try:
                self.profile = _PROFILE.validate_json(raw_profile)
            except ValidationError as exc:
                raise ValueError(f"option 'profile' is not a load profile: {exc}") from None
        if self.profile is None and self.total is None:
            raise ValueError("give option 'profile' (a load profile as JSON), 'total', or both")

    def number(self, name: str, default: str, cast: type = int, low: float = 0) -> Any:
        raw = self.raw.get(name.lower(), default)
        try:
            value = cast(raw)
        except ValueError:
            raise ValueError(f"option {name!r} must be a number, got {raw!r}") from None
        if value < low:
            raise ValueError(f"option {name!r} must be >= {low}, got {value}")
        return value


class BidOptions(PacedOptions):
    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options)
        self.auctions: int = self.number("auctions", "10000", low=1)
        self.zipf: float = self.number("zipf", "1.0", float, low=0.01)

    def generator(self) -> KeyGenerator:
        config = GeneratorSource(
            keys=self.auctions, distribution="zipf", zipf_exponent=self.zipf, seed=self.seed
        )
        return KeyGenerator(config, source_id=0)


class BidRange(InputPartition):
    def __init__(self, start: int, end: int, started: float | None = None) -> None:
        super().__init__(start)
        self.start, self.end, self.started = start, end, started


def due_times(profile: Any, started: float, seqs: np.ndarray) -> pa.Array:
    """When bids `seqs` (ascending) fell due by the profile, in epoch microseconds: bid n is due
    once n + 1 bids are."""
    pacer = Pacer(profile, 1.0, None)
    first, last = pacer.elapsed_at(int(seqs[0]) + 1), pacer.elapsed_at(int(seqs[-1]) + 1)
    times = np.linspace(first, last, DUE_POINTS)
    counts = np.array([records_due(profile, t) or 0.0 for t in times])
    elapsed = np.interp(seqs + 1, counts, times)
    return pa.array(((started + elapsed) * 1e6).astype(np.int64))


def bids(options: BidOptions, start: int, end: int, started: float | None = None) -> pa.RecordBatch:
    """Bids number start .. end - 1; with the stream's start time, when each fell due."""
    auctions, values = options.generator().records(start, end - start)
    seqs = np.arange(start, end, dtype=np.int64)
    due = pa.nulls(end - start, pa.int64())
    if started is not None and options.profile is not None and end > start:
        due = due_times(options.profile, started, seqs)
    # A cheap, fixed mix of the bid number: bidders spread over all of them.
    bidders = (seqs * 2654435761 + options.seed) % BIDDERS
    return pa.RecordBatch.from_arrays(
        [
            pa.array(seqs),
            pa.array(auctions),
            pa.array(bidders),
            pa.array(values.astype(np.int64) + 1),
            due,
        ],
        names=["seq", "auction", "bidder", "price", DUE_COLUMN],
    )


def _split(start: int, end: int, parts: int, started: float | None = None) -> list[BidRange]:
    step = max(math.ceil((end - start) / parts), 1)
    return [BidRange(a, min(a + step, end), started) for a in range(start, end, step)]


class PacedStreamReader(DataSourceStreamReader):
    """A stream of numbered rows as due by the options' profile; `rows` makes them."""

    def __init__(self, options: PacedOptions) -> None:
        self.options = options

    @abstractmethod
    def rows(self, start: int, end: int, started: float | None) -> pa.RecordBatch:
        """Rows number start .. end - 1; `started` is the stream's wall-clock start."""

    def initialOffset(self) -> dict[str, Any]:
        return {"seq": 0, "started": time.time()}

    def getDefaultReadLimit(self) -> ReadLimit:
        limit = self.options.max_records
        return ReadAllAvailable() if limit is None else ReadMaxRows(limit)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        due = records_due(self.options.profile, time.time() - float(start["started"]))
        target = math.inf if due is None else math.floor(due)
        if self.options.total is not None:
            target = min(target, self.options.total)
        if isinstance(limit, ReadMaxRows):
            target = min(target, int(start["seq"]) + limit.max_rows)
        return {"seq": max(int(target), int(start["seq"])), "started": start["started"]}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[BidRange]:
        started = float(start["started"])
        return _split(int(start["seq"]), int(end["seq"]), self.options.partitions, started)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, BidRange)
        yield self.rows(partition.start, partition.end, partition.started)


class PacedBatchReader(DataSourceReader):
    """All `total` numbered rows at once; `rows` makes them."""

    def __init__(self, options: PacedOptions) -> None:
        self.options = options
        if self.options.total is None:
            raise ValueError("a batch read needs option 'total'")

    @abstractmethod
    def rows(self, start: int, end: int) -> pa.RecordBatch:
        """Rows number start .. end - 1."""

    def partitions(self) -> list[BidRange]:
        assert self.options.total is not None
        return _split(0, self.options.total, self.options.partitions) or [BidRange(0, 0)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, BidRange)
        if partition.end > partition.start:
            yield self.rows(partition.start, partition.end)


class BidStreamReader(PacedStreamReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.bid_options = BidOptions(options)
        super().__init__(self.bid_options)

    def rows(self, start: int, end: int, started: float | None) -> pa.RecordBatch:
        return bids(self.bid_options, start, end, started)


class BidBatchReader(PacedBatchReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.bid_options = BidOptions(options)
        super().__init__(self.bid_options)

    def rows(self, start: int, end: int) -> pa.RecordBatch:
        return bids(self.bid_options, start, end)


class BidsDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "keyshift-bids"

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: Any) -> BidBatchReader:
        return BidBatchReader(dict(self.options))

    def streamReader(self, schema: Any) -> BidStreamReader:
        return BidStreamReader(dict(self.options))


def profile_json(profile: Any) -> str:
    """A load profile model as the JSON option `profile` takes."""
    return json.dumps(_PROFILE.dump_python(profile, mode="json"))
