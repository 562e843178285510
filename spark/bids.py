"""A NEXMark-like bid stream for Spark: `spark.readStream.format("keyshift-bids")`.

Used by the example source job (examples/spark/source_job.py), `make demo` and the tests. Bid
number `seq` is a pure function of (seed, seq): its auction is drawn zipf-skewed from
`auctions` (auction 0 is the hottest), its bidder uniformly, its price from 1 to 100 (keyshift's
own generator, keyshift.runtime.generator.KeyGenerator, draws them). So a stream query and a
batch query over the same bid numbers see the same bids, which is how a test or the demo gets
the expected aggregates.

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

from keyshift.runtime.generator import KeyGenerator, records_due
from keyshift.runtime.job import GeneratorSource, LoadProfile

SCHEMA = "seq long, auction long, bidder long, price long"
BIDDERS = 1_000_000
_PROFILE: TypeAdapter[Any] = TypeAdapter(LoadProfile)


class BidOptions:
    def __init__(self, options: dict[str, str]) -> None:
        def number(name: str, default: str, cast: type = int, low: float = 0) -> Any:
            raw = options.get(name.lower(), default)
            try:
                value = cast(raw)
            except ValueError:
                raise ValueError(f"option {name!r} must be a number, got {raw!r}") from None
            if value < low:
                raise ValueError(f"option {name!r} must be >= {low}, got {value}")
            return value

        self.auctions: int = number("auctions", "10000", low=1)
        self.zipf: float = number("zipf", "1.0", float, low=0.01)
        self.seed: int = number("seed", "0")
        self.partitions: int = number("partitions", "2", low=1)
        raw_max = options.get("maxrecordsperbatch")
        self.max_records: int | None = (
            None if raw_max is None else number("maxRecordsPerBatch", raw_max, low=1)
        )
        raw_total = options.get("total")
        self.total: int | None = None if raw_total is None else number("total", raw_total)
        raw_profile = options.get("profile")
        self.profile: Any = None
        if raw_profile is not None:
            try:
                self.profile = _PROFILE.validate_json(raw_profile)
            except ValidationError as exc:
                raise ValueError(f"option 'profile' is not a load profile: {exc}") from None
        if self.profile is None and self.total is None:
            raise ValueError("give option 'profile' (a load profile as JSON), 'total', or both")

    def generator(self) -> KeyGenerator:
        config = GeneratorSource(
            keys=self.auctions, distribution="zipf", zipf_exponent=self.zipf, seed=self.seed
        )
        return KeyGenerator(config, source_id=0)


class BidRange(InputPartition):
    def __init__(self, start: int, end: int) -> None:
        super().__init__(start)
        self.start, self.end = start, end


def bids(options: BidOptions, start: int, end: int) -> pa.RecordBatch:
    """Bids number start .. end - 1."""
    auctions, values = options.generator().records(start, end - start)
    seqs = np.arange(start, end, dtype=np.int64)
    # A cheap, fixed mix of the bid number: bidders spread over all of them.
    bidders = (seqs * 2654435761 + options.seed) % BIDDERS
    return pa.RecordBatch.from_arrays(
        [
            pa.array(seqs),
            pa.array(auctions),
            pa.array(bidders),
            pa.array(values.astype(np.int64) + 1),
        ],
        names=["seq", "auction", "bidder", "price"],
    )


def _split(start: int, end: int, parts: int) -> list[BidRange]:
    step = max(math.ceil((end - start) / parts), 1)
    return [BidRange(a, min(a + step, end)) for a in range(start, end, step)]


class BidStreamReader(DataSourceStreamReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.options = BidOptions(options)

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
        return _split(int(start["seq"]), int(end["seq"]), self.options.partitions)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, BidRange)
        yield bids(self.options, partition.start, partition.end)


class BidBatchReader(DataSourceReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.options = BidOptions(options)
        if self.options.total is None:
            raise ValueError("a batch read of bids needs option 'total'")

    def partitions(self) -> list[BidRange]:
        assert self.options.total is not None
        return _split(0, self.options.total, self.options.partitions) or [BidRange(0, 0)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, BidRange)
        if partition.end > partition.start:
            yield bids(self.options, partition.start, partition.end)


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
