"""NEXMark's events for Spark: `spark.readStream.format("keyshift-nexmark")` (and `spark.read`).

The same Person / Auction / Bid events a job's `kind: nexmark` source makes
(keyshift.runtime.nexmark), event number n being row n, in the schema of that source (one
schema for the three kinds, `kind` telling them apart) plus `event_time` (epoch µs). A stream
follows a load profile as `format("keyshift-bids")` does (keyshift.spark.bids: options
`profile`, `total`, `seed`, `partitions`, `maxRecordsPerBatch`); a batch read needs `total`.
The model's options: `eventRate` (events per second of event time), `startTimeUs`,
`maxDisorderMs`, `hotAuctionRatio`, `hotSellerRatio`, `hotBidderRatio`, `activePeople`,
`inFlightAuctions`, checked as a job file's nexmark source is.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
from pydantic import ValidationError
from pyspark.sql.datasource import DataSource

from keyshift.runtime import nexmark
from keyshift.runtime.job import NexmarkSource
from keyshift.runtime.records import EVENT_TIME
from keyshift.spark.bids import PacedBatchReader, PacedOptions, PacedStreamReader

_SPARK_TYPES = {"int": "long", "float": "double", "str": "string", "bool": "boolean"}
SCHEMA = ", ".join(
    [f"{name} {_SPARK_TYPES[kind]}" for name, kind in nexmark.FIELDS.items()]
    + [f"{EVENT_TIME} long"]
)
# Spark's option name (lower-cased, as Spark hands options over) -> the source's field.
_MODEL_OPTIONS = {
    "eventrate": "event_rate",
    "starttimeus": "start_time_us",
    "maxdisorderms": "max_disorder_ms",
    "hotauctionratio": "hot_auction_ratio",
    "hotsellerratio": "hot_seller_ratio",
    "hotbidderratio": "hot_bidder_ratio",
    "activepeople": "active_people",
    "inflightauctions": "in_flight_auctions",
}


class NexmarkOptions(PacedOptions):
    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options)
        given: dict[str, Any] = {
            field: options[name] for name, field in _MODEL_OPTIONS.items() if name in options
        }
        try:
            source = NexmarkSource.model_validate(
                {"kind": "nexmark", "seed": self.seed, **given}, strict=False
            )
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()
            )
            raise ValueError(f"bad NEXMark options: {problems}") from None
        self.model = source.model()


def nexmark_rows(options: NexmarkOptions, start: int, end: int) -> pa.RecordBatch:
    return nexmark.events(options.model, np.arange(start, end, dtype=np.int64))


class NexmarkStreamReader(PacedStreamReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.nexmark_options = NexmarkOptions(options)
        super().__init__(self.nexmark_options)

    def rows(self, start: int, end: int, started: float | None) -> pa.RecordBatch:
        return nexmark_rows(self.nexmark_options, start, end)


class NexmarkBatchReader(PacedBatchReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.nexmark_options = NexmarkOptions(options)
        super().__init__(self.nexmark_options)

    def rows(self, start: int, end: int) -> pa.RecordBatch:
        return nexmark_rows(self.nexmark_options, start, end)


class NexmarkDataSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "keyshift-nexmark"

    def schema(self) -> str:
        return SCHEMA

    def reader(self, schema: Any) -> NexmarkBatchReader:
        return NexmarkBatchReader(dict(self.options))

    def streamReader(self, schema: Any) -> NexmarkStreamReader:
        return NexmarkStreamReader(dict(self.options))
