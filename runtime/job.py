"""The job definition: pydantic models of a pipeline, loadable from YAML.

A job is a graph of named stages (`graph`: sources, map/filter/flat_map stages, keyed stages,
sinks, each naming its inputs), checked by `keyshift.runtime.job_graph`; a job file of the older
shape (source -> map/filter -> key_by -> one keyed operator -> sink at the top level) is
normalised into the same graph. The runtime executes one shape so far, which a graph is lowered
onto (`source`, `keyed`, `sink`, `fields`, and `keyed_stages()`, `source_routes()`, `sinks()`,
`sink_inputs()`: every keyed stage and sink and the edges between the stages);
any other shape is refused at load time. The local
host validates a job file with `load_job` before it starts anything; the coordinator and every
instance receive the same validated model. The Python API in `keyshift.runtime.pipeline` builds
these models too. Job files are read by `keyshift.runtime.job_file` (size, nesting, alias and
duplicate-key limits).
"""

from __future__ import annotations

import importlib
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from keyshift.runtime.job_file import JobFileError, check_data, read_job_file
from keyshift.runtime.job_graph import (
    KEY_FIELD,
    Graph,
    GraphError,
    Hop,
    Node,
    Partitioning,
    Role,
    Schema,
    build_graph,
    lower_to_chain,
)
from keyshift.runtime.job_graph import FieldType as FieldType
from keyshift.runtime.nexmark import FIELDS as NEXMARK_SCHEMA
from keyshift.runtime.nexmark import START_TIME_US, NexmarkModel
from keyshift.runtime.records import READER_NAME, RESERVED_FIELDS
from keyshift.runtime.restart_strategy import RestartStrategy
from keyshift.runtime.transport import MAX_MESSAGE

AggregateFunction = Literal["count", "sum", "min", "max", "mean"]
STAGE_NAME_PATTERN = r"^[a-z][a-z0-9-]{0,39}$"
MAX_PARALLELISM = 256  # instances of one stage at most (the policies' bounds stop there too)
# Idle pre-started instances of one keyed stage at most: each is a whole process kept waiting.
MAX_STANDBY = 8


class JobError(ValueError):
    """A job definition that cannot run; the message names the field and the reason."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def resolve_function(path: str) -> Callable[..., Any]:
    """Import `module:qualname` and return the callable, or raise JobError saying why not."""
    module_name, sep, qualname = path.partition(":")
    if not sep or not module_name or not qualname:
        raise JobError(f"{path!r} is not of the form 'module:function'")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # a user's module can fail to import in any way
        reason = f"{type(exc).__name__}: {exc}"
        raise JobError(f"cannot import module {module_name!r} for {path!r}: {reason}") from exc
    for part in qualname.split("."):
        try:
            target = getattr(target, part)
        except AttributeError as exc:
            raise JobError(f"module {module_name!r} has no attribute {qualname!r}") from exc
    if not callable(target):
        raise JobError(f"{path!r} is not callable")
    return target  # type: ignore[no-any-return]


_TAG_PREFIX = "kind="


def _kind_or(default: str, *kinds: str) -> Discriminator:
    """A discriminator on `kind` that lets a job file leave out the most common kind."""

    def pick(value: Any) -> str | None:
        kind = (
            value.get("kind", default) if isinstance(value, dict) else getattr(value, "kind", None)
        )
        return None if kind is None else _tag(str(kind))

    return Discriminator(
        pick,
        custom_error_type="unknown_kind",
        custom_error_message="kind must be one of " + ", ".join(repr(k) for k in kinds),
    )


def _tag(kind: str) -> str:
    """Union tags carry a prefix so error locations can leave them out (they are no field)."""
    return f"{_TAG_PREFIX}{kind}"


def check_signature(
    path: str, function: Callable[..., Any], arguments: int, per_record: bool
) -> None:
    """JobError unless `function` can be called with `arguments` positional arguments.

    Built-in (C) functions are refused for per-record use (map, filter, process): they would be
    called with a record dict (and a state), which no built-in function is written for, and an
    arity check cannot tell (`os:system` takes one argument, and would fail on every record).
    A sink function takes a batch, as `print` can; its arity is checked where it has a
    signature. Callables without a readable signature are checked when called."""
    if per_record and isinstance(function, types.BuiltinFunctionType):
        raise JobError(
            f"{path!r} is a built-in function; keyshift calls it with "
            f"{_ARGUMENTS[arguments]}: wrap it in a Python function that takes those"
        )
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # no signature to read (some C types): checked when called
        return
    try:
        signature.bind(*range(arguments))
    except TypeError:
        raise JobError(
            f"{path!r} has the signature {signature}, but keyshift calls it with "
            f"{_ARGUMENTS[arguments]}"
        ) from None


_ARGUMENTS = {
    1: "one argument",
    2: "two arguments (state, record)",
    3: "three arguments (state, record, timers)",
    5: "five arguments (state, key, timestamp, kind, timers)",
}


def _check_function_path(
    path: str, info: ValidationInfo, arguments: int, per_record: bool = True
) -> str:
    """Import the function now and check it takes `arguments` positional arguments, so a job
    that cannot run fails before anything starts; unless the validation context says the
    functions live elsewhere (the Kubernetes operator checks a job whose functions are in the
    job's image: there only the form is checked)."""
    if not (info.context or {}).get("resolve_functions", True):
        module, sep, name = path.partition(":")
        if not (sep and module and name):
            raise ValueError(f"{path!r} is not of the form 'module:function'")
        return path
    try:
        check_signature(path, resolve_function(path), arguments, per_record)
    except JobError as exc:
        raise ValueError(str(exc)) from exc
    return path


def _sink_function(path: str, info: ValidationInfo) -> str:
    return _check_function_path(path, info, 1, per_record=False)


class ConstantProfile(_Model):
    kind: Literal["constant"] = "constant"
    rate: float = Field(ge=0, description="records per second")


class StepProfile(_Model):
    kind: Literal["step"]
    rate: float = Field(ge=0, description="records per second before the step")
    to: float = Field(ge=0, description="records per second from `at` on")
    at: float = Field(ge=0, description="seconds after start")


class RampProfile(_Model):
    kind: Literal["ramp"]
    rate: float = Field(ge=0, description="records per second at the start")
    to: float = Field(ge=0, description="records per second at the end of the ramp")
    over: float = Field(gt=0, description="ramp duration in seconds; the rate holds after it")


class SineProfile(_Model):
    kind: Literal["sine"]
    rate: float = Field(ge=0, description="mean records per second")
    amplitude: float = Field(ge=0, description="records per second above and below the mean")
    period: float = Field(gt=0, description="seconds per cycle")

    @model_validator(mode="after")
    def _non_negative(self) -> SineProfile:
        if self.amplitude > self.rate:
            raise ValueError("amplitude must not exceed rate (the rate would go negative)")
        return self


class PointsProfile(_Model):
    kind: Literal["points"]
    points: list[tuple[float, float]] = Field(
        min_length=1,
        description="(seconds after start, records per second); each holds until the next",
    )

    @field_validator("points")
    @classmethod
    def _ordered(cls, points: list[tuple[float, float]]) -> list[tuple[float, float]]:
        times = [t for t, _ in points]
        if times != sorted(times) or len(set(times)) != len(times):
            raise ValueError("point times must be strictly increasing")
        if any(t < 0 or r < 0 for t, r in points):
            raise ValueError("point times and rates must be >= 0")
        return points


LoadProfile = Annotated[
    Annotated[ConstantProfile, Tag(_tag("constant"))]
    | Annotated[StepProfile, Tag(_tag("step"))]
    | Annotated[RampProfile, Tag(_tag("ramp"))]
    | Annotated[SineProfile, Tag(_tag("sine"))]
    | Annotated[PointsProfile, Tag(_tag("points"))],
    _kind_or("constant", "constant", "step", "ramp", "sine", "points"),
]


class GeneratorSource(_Model):
    kind: Literal["generator"] = "generator"
    profile: LoadProfile | None = Field(
        default=None, description="load over time; none means as fast as the pipeline takes"
    )
    keys: int = Field(default=10_000, ge=1, le=1 << 40, description="number of distinct keys")
    distribution: Literal["uniform", "zipf", "sequential"] = Field(
        default="uniform", description="sequential: record n has key n % keys"
    )
    zipf_exponent: float = Field(default=1.0, gt=0, le=5)
    seed: int = Field(default=0, ge=0)
    total: int | None = Field(
        default=None, ge=0, description="stop after this many records (all instances together)"
    )


DEFAULT_MAX_REQUEST_ROWS = 1_000_000
DEFAULT_MAX_REQUEST_BYTES = 32 << 20
DEFAULT_MAX_STAGED_BYTES = 128 << 20


class IngestSource(_Model):
    """Rows pushed by clients (PySpark writers, `keyshift.runtime.ingest_client`)."""

    kind: Literal["ingest"]
    port: int = Field(default=0, ge=0, le=65535, description="0 picks a free port")
    max_request_rows: int = Field(
        default=DEFAULT_MAX_REQUEST_ROWS,
        ge=1,
        le=100_000_000,
        description="rows in one push; a larger push is refused whole (clients split theirs)",
    )
    max_request_bytes: int = Field(
        default=DEFAULT_MAX_REQUEST_BYTES,
        ge=1024,
        le=MAX_MESSAGE - (1 << 20),  # a push's header must fit beside it in a gRPC message
        description="bytes of one push's payload; a larger push is refused whole",
    )
    max_staged_bytes: int = Field(
        default=DEFAULT_MAX_STAGED_BYTES,
        ge=1024,
        description="bytes (in Arrow) of the parts staged by uncommitted transactions; past it "
        "the oldest other transactions are dropped (their commit fails and is retried whole)",
    )


class NexmarkSource(_Model):
    """NEXMark's Person / Auction / Bid events (keyshift.runtime.nexmark), records of the
    schema `NEXMARK_FIELDS`, each with its event time from the model."""

    kind: Literal["nexmark"]
    profile: LoadProfile | None = Field(
        default=None,
        description="events per second over time (wall clock); none: as fast as the pipeline takes",
    )
    total: int | None = Field(
        default=None, ge=0, description="stop after this many events (all instances together)"
    )
    seed: int = Field(default=0, ge=0)
    event_rate: float = Field(default=10_000.0, gt=0, description="events per second of event time")
    start_time_us: int = Field(
        default=START_TIME_US, ge=0, description="event time of the first event, epoch µs"
    )
    max_disorder_ms: float = Field(
        default=0.0,
        ge=0,
        le=3_600_000,
        description="each event is up to this much earlier than its place in the stream",
    )
    hot_auction_ratio: int = Field(default=2, ge=1, description="1 - 1/ratio of bids are hot")
    hot_seller_ratio: int = Field(default=4, ge=1, description="1 - 1/ratio of sellers are hot")
    hot_bidder_ratio: int = Field(default=4, ge=1, description="1 - 1/ratio of bidders are hot")
    active_people: int = Field(default=1000, ge=1, description="people who sell and bid")
    in_flight_auctions: int = Field(default=100, ge=1, description="auctions open for bids")

    def model(self) -> NexmarkModel:
        return NexmarkModel(
            seed=self.seed,
            event_rate=self.event_rate,
            start_time_us=self.start_time_us,
            max_disorder_us=round(self.max_disorder_ms * 1000),
            hot_auction_ratio=self.hot_auction_ratio,
            hot_seller_ratio=self.hot_seller_ratio,
            hot_bidder_ratio=self.hot_bidder_ratio,
            active_people=self.active_people,
            in_flight_auctions=self.in_flight_auctions,
        )


SourceConfig = Annotated[
    Annotated[GeneratorSource, Tag(_tag("generator"))]
    | Annotated[IngestSource, Tag(_tag("ingest"))]
    | Annotated[NexmarkSource, Tag(_tag("nexmark"))],
    _kind_or("generator", "generator", "ingest", "nexmark"),
]


class LogSink(_Model):
    kind: Literal["log"] = "log"
    path: str = Field(default="out", description="directory of the output log")
    format: Literal["jsonl", "parquet", "none"] = Field(
        default="jsonl", description="'none' keeps offsets and metrics but writes no files"
    )
    segment_records: int = Field(default=100_000, ge=1, description="records per segment file")
    readers: list[str] = Field(
        default_factory=list,
        description="readers that must see every record (a Spark sink query's `reader` option):"
        " segments are deleted once all of them have committed past them, and the sink stops"
        " taking records while one lags max_unread_records behind (backpressure, not loss)",
    )
    max_unread_records: int = Field(
        default=1_000_000, ge=1, description="per partition, the most records kept unread"
    )

    @field_validator("readers")
    @classmethod
    def _reader_names(cls, readers: list[str]) -> list[str]:
        bad = [r for r in readers if not READER_NAME.match(r)]
        if bad:
            raise ValueError(
                f"reader names {bad} must be 1-100 letters, digits, '_', '.' or '-', "
                "starting with a letter or digit"
            )
        return readers

    @model_validator(mode="after")
    def _readers_need_files(self) -> LogSink:
        if self.readers and self.format == "none":
            raise ValueError("readers need a log with files: format must not be 'none'")
        return self


class LateRecordsLog(_Model):
    """The job's late-records log (keyshift.runtime.late_records)."""

    path: str = Field(description="directory: an output log per keyed stage under it")
    format: Literal["jsonl", "parquet"] = "jsonl"


class FunctionSink(_Model):
    kind: Literal["function"]
    function: str = Field(description="module:function called with each pyarrow.RecordBatch")

    _check = field_validator("function")(_sink_function)


SinkConfig = Annotated[
    Annotated[LogSink, Tag(_tag("log"))] | Annotated[FunctionSink, Tag(_tag("function"))],
    _kind_or("log", "log", "function"),
]


class Transform(_Model):
    map: str | None = Field(default=None, description="module:function(record) -> record")
    filter: str | None = Field(default=None, description="module:function(record) -> bool")

    @model_validator(mode="after")
    def _exactly_one(self, info: ValidationInfo) -> Transform:
        if (self.map is None) == (self.filter is None):
            raise ValueError("a transform has exactly one of 'map' or 'filter'")
        _check_function_path(self.map or self.filter or "", info, 1)
        return self


class _NoWindows(_Model):
    """An operator that fires no windows: a window's settings on it are refused by name."""

    @model_validator(mode="before")
    @classmethod
    def _no_lateness(cls, data: Any) -> Any:
        if isinstance(data, dict) and "allowed_lateness_ms" in data:
            raise ValueError(
                "allowed_lateness_ms is a window's setting: the "
                f"{data.get('kind', 'aggregate')!r} operator fires no windows to be late for"
            )
        return data


class AggregateOperator(_NoWindows):
    kind: Literal["aggregate"] = "aggregate"
    function: AggregateFunction = "count"
    field: str | None = Field(default=None, description="numeric field aggregated (not for count)")


class ProcessOperator(_NoWindows):
    kind: Literal["process"]
    function: str = Field(
        description="module:function(state, record) -> (state, output or None); with "
        "on_timer, module:function(state, record, timers)"
    )
    on_timer: str | None = Field(
        default=None,
        description="module:function(state, key, timestamp, kind, timers) -> (state, output "
        "or None), called once per timer the function registered through `timers` when it "
        "is due: an event-time timer when the watermark reaches it, a processing-time one "
        "when the wall clock does (keyshift.runtime.timers)",
    )

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo) -> ProcessOperator:
        # With timers the function also takes the key's timer service.
        _check_function_path(self.function, info, 2 if self.on_timer is None else 3)
        if self.on_timer is not None:
            _check_function_path(self.on_timer, info, 5)
        return self


class TumblingWindow(_Model):
    kind: Literal["tumbling"]
    size_ms: float = Field(gt=0, le=365 * 86_400_000, description="window length")


class SlidingWindow(_Model):
    kind: Literal["sliding"]
    size_ms: float = Field(gt=0, le=365 * 86_400_000, description="window length")
    slide_ms: float = Field(gt=0, description="a window starts every slide_ms")

    @model_validator(mode="after")
    def _no_gaps(self) -> SlidingWindow:
        if self.slide_ms > self.size_ms:
            raise ValueError(
                f"slide_ms ({self.slide_ms}) must not exceed size_ms ({self.size_ms}): records "
                "between the windows would belong to none"
            )
        return self


class SessionWindow(_Model):
    """A key's records less than `gap_ms` apart in event time are one session; a record that
    bridges two sessions merges them (keyshift.runtime.sessions)."""

    kind: Literal["session"]
    gap_ms: float = Field(
        ge=0.001,  # event times are µs
        le=365 * 86_400_000,
        description="a session ends this long after its last record",
    )

    @model_validator(mode="before")
    @classmethod
    def _no_size(cls, data: Any) -> Any:
        if isinstance(data, dict):
            given = [name for name in ("size_ms", "slide_ms") if name in data]
            if given:
                raise ValueError(
                    f"a session window has a gap_ms and no {' or '.join(given)}: a session "
                    "lasts as long as its key's records keep coming less than gap_ms apart"
                )
        return data


WindowConfig = Annotated[
    Annotated[TumblingWindow, Tag(_tag("tumbling"))]
    | Annotated[SlidingWindow, Tag(_tag("sliding"))]
    | Annotated[SessionWindow, Tag(_tag("session"))],
    _kind_or("tumbling", "tumbling", "sliding", "session"),
]


def _window_reduce(path: str | None, info: ValidationInfo) -> str | None:
    return None if path is None else _check_function_path(path, info, 2)


def _window_process(path: str | None, info: ValidationInfo) -> str | None:
    return None if path is None else _check_function_path(path, info, 1)


class WindowOperator(_Model):
    """An aggregate per key and event-time window, or a user's function over the window's
    records, fired once the watermark passes the window's end (keyshift.runtime.windows); the
    source needs `event_time` settings."""

    kind: Literal["window"]
    window: WindowConfig
    function: AggregateFunction | None = Field(
        default=None, description="the built-in aggregate; none: count, unless reduce or process"
    )
    field: str | None = Field(
        default=None,
        description="numeric field aggregated (not for count); with reduce or process, the "
        "field whose values they get instead of whole records",
    )
    reduce: str | None = Field(
        default=None,
        description="module:function(accumulator, record) -> accumulator, folding each record "
        "into its window as it arrives (accumulator None at first; a session's records when it "
        "fires, as sessions merge); the window's result is the last accumulator",
    )
    process: str | None = Field(
        default=None,
        description="module:function(records) -> result, called once when the window fires "
        "with its records in arrival order (each with its window_start; a session's merged "
        "parts one after another, earliest first)",
    )
    allowed_lateness_ms: float = Field(
        default=0,
        ge=0,
        le=365 * 86_400_000,
        description="a fired window is kept until the watermark passes its end by this much; a "
        "record for it meanwhile sends its updated result (a higher n and version, replacing "
        "the earlier one by key and window); records later than that go to the job's "
        "late_records log",
    )

    _check_reduce = field_validator("reduce")(_window_reduce)
    _check_process = field_validator("process")(_window_process)

    @model_validator(mode="after")
    def _one_function(self) -> WindowOperator:
        if self.reduce is not None and self.process is not None:
            raise ValueError("a window has a reduce or a process function, not both")
        if self.user_function is not None and self.function is not None:
            raise ValueError(
                f"a window with a reduce or process function has no aggregate function "
                f"(got function {self.function!r} too)"
            )
        return self

    @property
    def user_function(self) -> str | None:
        """The module:function of a reduce or process function; None for a built-in aggregate."""
        return self.reduce or self.process

    @property
    def aggregate(self) -> str | None:
        """The built-in aggregate; None when a user's function computes the window's result."""
        return None if self.user_function is not None else self.function or "count"

    def allowed_lateness_us(self) -> int:
        return round(self.allowed_lateness_ms * 1000)

    @property
    def session(self) -> bool:
        return isinstance(self.window, SessionWindow)

    def size_and_slide_us(self) -> tuple[int, int]:
        """A tumbling or sliding window's size and slide."""
        window = self.window
        if isinstance(window, SessionWindow):
            raise ValueError("a session window has a gap, no size or slide")
        size = round(window.size_ms * 1000)
        slide = round(window.slide_ms * 1000) if isinstance(window, SlidingWindow) else size
        return size, slide

    def gap_us(self) -> int:
        """A session window's gap."""
        if not isinstance(self.window, SessionWindow):
            raise ValueError(f"a {self.window.kind} window has no gap")
        return round(self.window.gap_ms * 1000)


def _join_function(path: str | None, info: ValidationInfo) -> str | None:
    return None if path is None else _check_function_path(path, info, 2)


_JOIN_FUNCTION = Field(
    default=None,
    description="module:function(left, right) -> value or None, called once per matched pair "
    "(each side's record with its event_time); its value is the output's (None: no output); "
    "none: the pair itself, [left, right]",
)


class WindowJoinOperator(_NoWindows):
    """A join of a keyed stage's two inputs (Flink's `a.join(b).where(..).equalTo(..)
    .window(...)`): a record of the first and one of the second with equal keys in the same
    tumbling event-time window match; a window's pairs are sent once the watermark passes its
    end (keyshift.runtime.joins). The source needs `event_time` settings."""

    kind: Literal["window_join"]
    window: TumblingWindow
    function: str | None = _JOIN_FUNCTION

    _check_function = field_validator("function")(_join_function)

    def size_us(self) -> int:
        return round(self.window.size_ms * 1000)


class IntervalJoinOperator(_NoWindows):
    """A join of a keyed stage's two inputs (Flink's `a.keyBy(..).intervalJoin(b.keyBy(..))
    .between(lower, upper)`): a record `left` of the first input and `right` of the second with
    equal keys match when left.ts + lower_ms <= right.ts <= left.ts + upper_ms; a pair is sent
    as soon as its second record arrives, and a side's records are dropped once the watermark
    makes further matches impossible (keyshift.runtime.joins). The source needs `event_time`."""

    kind: Literal["interval_join"]
    lower_ms: float = Field(ge=-365 * 86_400_000, le=365 * 86_400_000)
    upper_ms: float = Field(ge=-365 * 86_400_000, le=365 * 86_400_000)
    function: str | None = _JOIN_FUNCTION

    _check_function = field_validator("function")(_join_function)

    @model_validator(mode="after")
    def _ordered(self) -> IntervalJoinOperator:
        if self.lower_ms > self.upper_ms:
            raise ValueError(
                f"lower_ms ({self.lower_ms}) must not exceed upper_ms ({self.upper_ms}): no "
                "record would match any other"
            )
        return self

    def bounds_us(self) -> tuple[int, int]:
        return round(self.lower_ms * 1000), round(self.upper_ms * 1000)


JoinOperator = WindowJoinOperator | IntervalJoinOperator

OperatorConfig = Annotated[
    Annotated[AggregateOperator, Tag(_tag("aggregate"))]
    | Annotated[ProcessOperator, Tag(_tag("process"))]
    | Annotated[WindowOperator, Tag(_tag("window"))]
    | Annotated[WindowJoinOperator, Tag(_tag("window_join"))]
    | Annotated[IntervalJoinOperator, Tag(_tag("interval_join"))],
    _kind_or("aggregate", "aggregate", "process", "window", "window_join", "interval_join"),
]


class Stage(_Model):
    name: str = Field(pattern=STAGE_NAME_PATTERN)
    parallelism: int = Field(default=1, ge=1, le=MAX_PARALLELISM)


class EventTimeSettings(_Model):
    """Where a source's records take their event time from, and how its watermark follows
    them (keyshift.runtime.watermarks)."""

    field: str | None = Field(
        default=None,
        description="an int field of the source's records holding their event time (epoch µs); "
        "none: the source's own (the generator's due time, NEXMark's model, an ingest row's "
        "event_time or its arrival)",
    )
    max_out_of_orderness_ms: float = Field(
        default=0.0,
        ge=0,
        le=86_400_000,
        description="the watermark trails the highest event time seen by this much",
    )
    idle_timeout_ms: float | None = Field(
        default=None,
        gt=0,
        le=86_400_000,
        description="a source instance that emits nothing for this long stops holding the "
        "watermark back until it emits again; none: it always holds it",
    )


class SourceStage(Stage):
    name: str = Field(default="source", pattern=STAGE_NAME_PATTERN)
    config: SourceConfig = Field(default_factory=GeneratorSource)
    transforms: list[Transform] = Field(default_factory=list)
    event_time: EventTimeSettings | None = Field(
        default=None, description="event time and watermarks; none: the source sends none"
    )


class StateSettings(_Model):
    """Where a keyed stage keeps its state: in memory, or in an embedded RocksDB per instance
    for state larger than memory (see keyshift.runtime.rocksdb_state)."""

    backend: Literal["memory", "rocksdb"] = Field(default="memory", description="memory or rocksdb")
    path: str = Field(
        default="state",
        min_length=1,
        description="rocksdb: local directory below which each keyed instance keeps its "
        "database, in <path>/<job>/<stage>-<index> (rebuilt from checkpoints, never shared)",
    )
    block_cache_mb: int = Field(
        default=64, ge=8, le=1 << 20, description="rocksdb: block cache per instance, MiB"
    )
    write_buffer_mb: int = Field(
        default=16, ge=1, le=4096, description="rocksdb: each of the two write buffers, MiB"
    )


def _standby_field() -> Any:
    return Field(
        default=0,
        ge=0,
        le=MAX_STANDBY,
        description="idle pre-started instances a scale-out takes before starting processes",
    )


class KeyedStage(Stage):
    name: str = Field(default="keyed", pattern=STAGE_NAME_PATTERN)
    key_by: str = Field(default="key", description="the field whose value is the key")
    operator: OperatorConfig = Field(default_factory=AggregateOperator)
    state: StateSettings = Field(default_factory=StateSettings)
    standby: int = _standby_field()


def _partitions_field() -> Any:
    return Field(
        default=None,
        ge=1,
        le=MAX_PARALLELISM,
        description="output partitions, fixed for the job's life: a key's updates go to "
        "partition `key group % partitions`, and a rescale of the sink moves whole partitions "
        "between its instances; none: the sink's parallelism (the most it can be rescaled to)",
    )


class _Partitions:
    """A sink's output partitions: `partitions`, or its parallelism when not given."""

    parallelism: int
    partitions: int | None

    @property
    def output_partitions(self) -> int:
        return self.partitions if self.partitions is not None else self.parallelism

    def _check_partitions(self) -> None:
        if self.parallelism > self.output_partitions:
            raise ValueError(
                f"sink parallelism {self.parallelism} exceeds its partitions "
                f"({self.output_partitions}): each sink instance writes whole partitions"
            )


class SinkStage(_Partitions, Stage):
    name: str = Field(default="sink", pattern=STAGE_NAME_PATTERN)
    config: SinkConfig = Field(default_factory=LogSink)
    partitions: int | None = _partitions_field()

    @model_validator(mode="after")
    def _fits(self) -> SinkStage:
        self._check_partitions()
        return self


@dataclass(frozen=True)
class Chained:
    """A map, filter or flat_map function run in a sending stage's instances."""

    kind: Literal["map", "filter", "flat_map"]
    function: str

    @classmethod
    def of(cls, transform: Transform) -> Chained:
        """A transform of the older shape's source."""
        if transform.map is not None:
            return cls("map", transform.map)
        return cls("filter", transform.filter or "")


@dataclass(frozen=True)
class Route:
    """Where a sending stage's records go: through `transforms` (run in the sender's
    instances, in order) to `target` (a keyed stage, or the sink); into a join, as its `side`
    (0: its first input, 1: its second)."""

    target: str
    transforms: tuple[Chained, ...]
    side: int | None = None


@dataclass(frozen=True)
class JoinSide:
    """One input of a join stage: the schema of its records and their key field."""

    fields: dict[str, FieldType]
    key_by: str


@dataclass(frozen=True)
class KeyedStep:
    """A keyed stage as the runtime runs it: its settings, the schema of the records it reads,
    the stages whose instances send them (a union when several), and its updates' routes. A
    join's `fields` are `join_input`'s (what its senders wrap each side's records into), and
    its `sides` say what each input's records are."""

    stage: KeyedStage
    fields: dict[str, FieldType]
    inputs: tuple[str, ...]
    outputs: tuple[Route, ...]
    sides: tuple[JoinSide, ...] = ()


@dataclass(frozen=True)
class SourceStep:
    """A source as the runtime runs it: its settings, the schema of the records it makes (an
    ingest source checks its rows against it), and its records' routes."""

    stage: SourceStage
    fields: dict[str, FieldType]
    routes: tuple[Route, ...]


def _check_sources(sources: list[SourceNode]) -> None:
    """Sources either all carry event time or none do: a receiver's watermark is the minimum
    over all its inputs, which a source sending none would leave undefined. Two ingest sources
    cannot listen on one fixed port."""
    ports: dict[int, str] = {}
    for source in sources:
        if isinstance(source.config, IngestSource) and source.config.port:
            other = ports.setdefault(source.config.port, source.name)
            if other != source.name:
                raise ValueError(
                    f"stage {source.name!r} (source): ingest port {source.config.port} is "
                    f"already the port of source {other!r}; give each ingest source its own"
                )
    timed = [s.name for s in sources if s.event_time is not None]
    untimed = [s.name for s in sources if s.event_time is None]
    if timed and untimed:
        raise ValueError(
            f"stage {untimed[0]!r} (source) has no `event_time` while source {timed[0]!r} has: "
            "a job's sources either all carry event time or none do"
        )


GENERATED_FIELDS: dict[str, FieldType] = {"key": "int", "value": "float"}
NEXMARK_FIELDS: dict[str, FieldType] = dict(NEXMARK_SCHEMA)


def made_fields(config: GeneratorSource | IngestSource | NexmarkSource) -> dict[str, FieldType]:
    """The schema of the records a built-in source makes; none for an ingest source, whose
    rows have the schema the job declares."""
    if isinstance(config, GeneratorSource):
        return GENERATED_FIELDS
    if isinstance(config, NexmarkSource):
        return NEXMARK_FIELDS
    return {}


def _record_fields(fields: dict[str, FieldType] | None) -> dict[str, FieldType] | None:
    """A record schema (the job's, a source's, a map's): some fields, none of them reserved."""
    if fields is None:
        return None
    reserved = sorted(set(fields) & RESERVED_FIELDS)
    if reserved:
        raise ValueError(f"field names {reserved} are reserved for record metadata")
    if not fields:
        raise ValueError("a schema needs at least one field")
    return fields


def _map_function(path: str, info: ValidationInfo) -> str:
    return _check_function_path(path, info, 1)


class SourceNode(Stage):
    """A source stage of a graph: its records have the schema `fields`."""

    kind: Literal["source"]
    config: SourceConfig = Field(default_factory=GeneratorSource)
    event_time: EventTimeSettings | None = Field(
        default=None, description="event time and watermarks; none: the source sends none"
    )
    fields: dict[str, FieldType] | None = Field(
        default=None,
        description="the schema of its records: the generator's are {key: int, value: float}; "
        "an ingest source's rows are checked against it (required)",
    )

    _fields = field_validator("fields")(_record_fields)

    @model_validator(mode="after")
    def _schema(self) -> SourceNode:
        made = made_fields(self.config)
        if made:
            if self.fields is not None and self.fields != made:
                raise ValueError(f"a {self.config.kind}'s records are {made}, not {self.fields}")
        elif self.fields is None:
            raise ValueError("an ingest source needs `fields`: the schema of the rows pushed")
        return self

    def record_fields(self) -> dict[str, FieldType]:
        return made_fields(self.config) if self.fields is None else self.fields


class _Downstream(Stage):
    """A stage with inputs: `input` names one, `inputs` several (a union)."""

    input: str | None = Field(default=None, description="the stage it reads")
    inputs: list[str] | None = Field(
        default=None, description="the stages it reads, as one stream (a union)"
    )

    @model_validator(mode="after")
    def _one_way(self) -> _Downstream:
        if self.input is not None and self.inputs is not None:
            raise ValueError("give `input` or `inputs`, not both")
        return self

    def input_names(self) -> tuple[str, ...]:
        return (self.input,) if self.input is not None else tuple(self.inputs or ())


class _Partitioned(_Downstream):
    partitioning: Partitioning | None = Field(
        default=None,
        description="how records reach its instances: forward (instance i to i, chained), "
        "key_by (hash of `key_by`), rebalance (round robin) or broadcast (every instance); "
        "left out: key_by 'key' after a keyed stage, else forward at equal parallelism and "
        "rebalance otherwise",
    )
    key_by: str | None = Field(default=None, description="the field of a key_by partitioning")


class TransformNode(_Partitioned):
    """A stateless stage: map (a record to a record), filter, or flat_map (to a list)."""

    kind: Literal["map", "filter", "flat_map"]
    function: str = Field(description="module:function(record), called per record")
    fields: dict[str, FieldType] | None = Field(
        default=None,
        description="map and flat_map: the schema of the records it emits (left out: the same "
        "as its input's)",
    )

    _check = field_validator("function")(_map_function)
    _fields = field_validator("fields")(_record_fields)

    @model_validator(mode="after")
    def _filter_keeps_schema(self) -> TransformNode:
        if self.kind == "filter" and self.fields is not None:
            raise ValueError("a filter keeps its input's schema: it has no `fields`")
        return self


class KeyedNode(_Downstream):
    """A keyed stage of a graph, partitioned by its own `key_by`."""

    kind: Literal["keyed"]
    key_by: str | list[str] = Field(
        description="the field whose value is the key; a join's: one per input, in the order "
        "of `inputs` (one name: the same field in both)"
    )
    operator: OperatorConfig = Field(default_factory=AggregateOperator)
    state: StateSettings = Field(default_factory=StateSettings)
    standby: int = _standby_field()

    @model_validator(mode="after")
    def _one_key_unless_joined(self) -> KeyedNode:
        if isinstance(self.key_by, list) and not isinstance(self.operator, JoinOperator):
            raise ValueError(
                f"key_by names one field (got {self.key_by}); a list, one per input, is a "
                "join's (operator kind window_join or interval_join)"
            )
        return self

    def join_keys(self) -> tuple[str, ...]:
        """A join's key field per input; () for any other keyed stage."""
        if not isinstance(self.operator, JoinOperator):
            return ()
        if isinstance(self.key_by, str):
            return (self.key_by,) * len(self.input_names())
        return tuple(self.key_by)


class SinkNode(_Partitions, _Partitioned):
    kind: Literal["sink"]
    config: SinkConfig = Field(default_factory=LogSink)
    partitions: int | None = _partitions_field()

    @model_validator(mode="after")
    def _fits(self) -> SinkNode:
        self._check_partitions()
        return self


def _graph_kind(value: Any) -> str | None:
    kind = value.get("kind") if isinstance(value, dict) else getattr(value, "kind", None)
    return _tag("transform" if kind in ("map", "filter", "flat_map") else str(kind))


GraphStage = Annotated[
    Annotated[SourceNode, Tag(_tag("source"))]
    | Annotated[TransformNode, Tag(_tag("transform"))]
    | Annotated[KeyedNode, Tag(_tag("keyed"))]
    | Annotated[SinkNode, Tag(_tag("sink"))],
    Discriminator(
        _graph_kind,
        custom_error_type="unknown_kind",
        custom_error_message="kind must be one of 'source', 'map', 'filter', 'flat_map', "
        "'keyed', 'sink'",
    ),
]


def _keyed_node(stage: KeyedStage | KeyedNode, inputs: tuple[str, ...]) -> Node:
    """A keyed stage as `keyshift.runtime.job_graph` sees it: its built-in aggregate or its
    user's function, and the field either reads; a join's key field per input."""
    op = stage.operator
    if isinstance(op, JoinOperator):
        # A join of the older shape (one input) has its one key: the graph refuses it by name.
        keys = stage.join_keys() if isinstance(stage, KeyedNode) else (stage.key_by,)
        return Node(
            stage.name, "keyed", stage.parallelism, inputs, function=op.function, join_keys=keys
        )
    assert isinstance(stage.key_by, str)  # a list is a join's (KeyedNode checks)
    if isinstance(op, WindowOperator):
        aggregate, field, function = op.aggregate, op.field, op.user_function
    elif isinstance(op, AggregateOperator):
        aggregate, field, function = op.function, op.field, None
    else:
        aggregate, field, function = None, None, op.function
    return Node(
        stage.name,
        "keyed",
        stage.parallelism,
        inputs,
        key_by=stage.key_by,
        aggregate=aggregate,
        aggregate_field=field,
        window=isinstance(op, WindowOperator),
        function=function,
    )


def _node(stage: SourceNode | TransformNode | KeyedNode | SinkNode) -> Node:
    """A graph stage as `keyshift.runtime.job_graph` sees it."""
    if isinstance(stage, SourceNode):
        return Node(stage.name, "source", stage.parallelism, fields=stage.record_fields())
    if isinstance(stage, KeyedNode):
        return _keyed_node(stage, stage.input_names())
    role: Role = "sink" if isinstance(stage, SinkNode) else stage.kind
    return Node(
        stage.name,
        role,
        stage.parallelism,
        stage.input_names(),
        stage.partitioning,
        stage.key_by,
        stage.fields if isinstance(stage, TransformNode) else None,
        function=stage.function if isinstance(stage, TransformNode) else None,
    )


class Batching(_Model):
    max_records: int = Field(default=8192, ge=1, le=1 << 20, description="flush at this size")
    linger_ms: float = Field(default=5.0, ge=0, le=10_000, description="flush after this wait")
    credits: int = Field(
        default=8, ge=1, le=1024, description="batches in flight per channel (bounds memory)"
    )


class CheckpointSettings(_Model):
    """Periodic, aligned, incremental checkpoints of the job's state (see
    keyshift.runtime.checkpointing)."""

    interval: float = Field(default=10.0, gt=0, le=86_400, description="seconds between starts")
    storage: str = Field(
        default="checkpoints",
        min_length=1,
        description="where checkpoints go: a local directory or an fsspec URL (s3://bucket/path)",
    )
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec options, e.g. an S3 endpoint and credentials"
    )
    retain: int = Field(default=3, ge=1, le=1000, description="completed checkpoints kept")
    max_chain: int = Field(
        default=8, ge=1, le=1000, description="delta shards of a key group before a new base"
    )
    timeout: float = Field(default=60.0, gt=0, description="seconds before a checkpoint fails")
    degraded_after: int = Field(
        default=3, ge=1, description="consecutive failed checkpoints that make the job Degraded"
    )


_CHAIN_KEYS = ("source", "keyed", "sink", "fields")


class JobSpec(_Model):
    name: str = Field(pattern=STAGE_NAME_PATTERN)
    max_key_groups: int = Field(default=4096, ge=1, le=1 << 16)
    fields: dict[str, FieldType] = Field(
        default_factory=lambda: dict[str, FieldType](key="int", value="float"),
        description="the record schema after the transforms",
    )
    allow_non_finite: list[str] = Field(
        default_factory=list,
        description="float fields that may hold NaN and infinities (others reject such records)",
    )
    graph: list[GraphStage] | None = Field(
        default=None,
        description="the job as a graph of named stages, each naming its input(s); a job gives "
        "either this or source/keyed/sink/fields, which a graph is lowered onto",
    )
    source: SourceStage = Field(default_factory=SourceStage)
    keyed: KeyedStage = Field(default_factory=KeyedStage)
    sink: SinkStage = Field(default_factory=SinkStage)
    batching: Batching = Field(default_factory=Batching)
    # The autoscaler's settings are the policies' model, which the runtime does not import: it
    # carries them unread, and the hosts load a job as keyshift.operator.autoscaled_job's
    # AutoscaledJob, which parses and checks them.
    autoscaler: Any = Field(
        default=None, description="pick the parallelism by itself; none keeps it as given"
    )
    checkpoints: CheckpointSettings | None = Field(
        default=None, description="periodic checkpoints of the keyed state; none takes none"
    )
    late_records: LateRecordsLog | None = Field(
        default=None,
        description="where records too late for their windows (after the allowed lateness) "
        "are written; none: they are only counted (keyshift_late_records_total)",
    )
    restart: RestartStrategy = Field(
        default_factory=RestartStrategy,
        description="how a job with checkpoints is restarted after a failure: exponential "
        "delay, a bounded number of restarts in a row",
    )
    recovery: Literal["local", "global"] = Field(
        default="local",
        description="how a job with checkpoints recovers from a lost keyed instance: local "
        "starts that instance alone and rewinds the others in place to the latest checkpoint; "
        "global restarts every process from it (what every other loss does)",
    )
    heartbeat_timeout: float = Field(
        default=15.0,
        gt=0,
        le=3600,
        description="seconds without a report from an instance (they report twice a second) "
        "before the coordinator takes it as lost: hung, or on a node that is gone; a process "
        "that dies is noticed at once",
    )

    # Derived at validation: every keyed stage (the first being `keyed`), the source's routes,
    # and the keyed stages feeding the sink.
    _keyed_stages: tuple[KeyedStep, ...] = PrivateAttr(default=())
    _sources: tuple[SourceStep, ...] = PrivateAttr(default=())
    _sinks: tuple[SinkStage, ...] = PrivateAttr(default=())
    _sink_inputs: dict[str, tuple[str, ...]] = PrivateAttr(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _one_shape(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("graph") is not None:
            given = [k for k in _CHAIN_KEYS if k in data]
            if given:
                raise ValueError(
                    f"a job with a `graph` describes its stages and schemas there: leave out "
                    f"{given} (the older shape), or leave out `graph`"
                )
        return data

    @model_serializer(mode="wrap")
    def _dump_one_shape(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A graph job is written as its graph: what it was lowered onto is derived again."""
        data: dict[str, Any] = handler(self)
        if self.graph is not None:
            for key in _CHAIN_KEYS:
                data.pop(key, None)
        elif "graph" in data and data["graph"] is None:
            del data["graph"]
        return data

    def _lower_graph(self, info: ValidationInfo) -> None:
        """Set source/keyed/sink/fields from the graph, which the runtime reads; a model
        validator is the one place a frozen model can still take derived values."""
        assert self.graph is not None
        try:
            chain = lower_to_chain(self.dataflow())
        except GraphError as exc:
            raise ValueError(str(exc)) from None
        stages = {stage.name: stage for stage in self.graph}
        links = {link.keyed.name: link for link in chain.keyed}

        def reads(hop: Hop) -> Schema:
            link = links[hop.target]
            return link.fields if hop.side is None else link.sides[hop.side]

        sources = []
        for source_link in chain.sources:
            source = stages[source_link.source.name]
            assert isinstance(source, SourceNode)
            sources.append(source)
            for hop in source_link.outputs:
                if isinstance(source.config, IngestSource) and dict(reads(hop)) != source.fields:
                    changing = next(t for t in hop.transforms if t.fields is not None)
                    raise ValueError(
                        f"not supported yet: stage {changing.name!r} (map): a map that reshapes "
                        "an ingest source's rows (the runtime checks them against the schema the "
                        "keyed stage reads)"
                    )
        _check_sources(sources)
        # Validated again with the job's context: a model's own checks rerun on its instances,
        # and the user's functions must be checked as the job asks (imported, or by form only).
        context = info.context

        def route(hop: Hop) -> Route:
            # The functions were checked as graph stages, with the job's context.
            chained = []
            for t in hop.transforms:
                assert t.role in ("map", "filter", "flat_map") and t.function is not None
                chained.append(Chained(t.role, t.function))
            return Route(hop.target, tuple(chained), hop.side)

        steps = []
        for link in chain.keyed:
            keyed = stages[link.keyed.name]
            assert isinstance(keyed, KeyedNode)
            joins = keyed.join_keys()
            step = KeyedStage.model_validate(
                {
                    "name": keyed.name,
                    "parallelism": keyed.parallelism,
                    # A join reads its senders' wrapping of each side (join_input).
                    "key_by": KEY_FIELD if joins else keyed.key_by,
                    "operator": keyed.operator,
                    "state": keyed.state,
                    "standby": keyed.standby,
                },
                context=context,
            )
            outputs = tuple(route(hop) for hop in link.outputs)
            sides = tuple(
                JoinSide(dict(fields), key) for fields, key in zip(link.sides, joins, strict=True)
            )
            steps.append(KeyedStep(step, dict(link.fields), link.inputs, outputs, sides))
        source_steps = []
        for source, source_link in zip(sources, chain.sources, strict=True):
            stage = SourceStage.model_validate(
                {
                    "name": source.name,
                    "parallelism": source.parallelism,
                    "config": source.config,
                    # The older shape's one route: its map/filter transforms (a flat_map has
                    # no place there; the runtime reads the routes).
                    "transforms": [
                        {t.role: t.function}
                        for t in source_link.outputs[0].transforms
                        if t.role in ("map", "filter")
                    ],
                    "event_time": source.event_time,
                },
                context=context,
            )
            routes = tuple(route(hop) for hop in source_link.outputs)
            source_steps.append(SourceStep(stage, source.record_fields(), routes))
        values = {
            "source": source_steps[0].stage,
            "keyed": steps[0].stage,
            "fields": dict(chain.fields),
        }
        sinks = []
        for sink_link in chain.sinks:
            sink = stages[sink_link.sink.name]
            assert isinstance(sink, SinkNode)
            sinks.append(
                SinkStage.model_validate(
                    {
                        "name": sink.name,
                        "parallelism": sink.parallelism,
                        "config": sink.config,
                        "partitions": sink.partitions,
                    },
                    context=context,
                )
            )
        _check_sink_paths(sinks)
        values["sink"] = sinks[0]
        for name, value in values.items():
            object.__setattr__(self, name, value)
        self._keyed_stages = tuple(steps)
        self._sources = tuple(source_steps)
        self._sinks = tuple(sinks)
        self._sink_inputs = {link.sink.name: link.inputs for link in chain.sinks}

    def keyed_stages(self) -> tuple[KeyedStep, ...]:
        """Every keyed stage, each after its inputs (one in a job of the older shape)."""
        return self._keyed_stages

    def keyed_step(self, name: str) -> KeyedStep:
        """The keyed stage named `name` as the runtime runs it; KeyError if there is none."""
        for step in self._keyed_stages:
            if step.stage.name == name:
                return step
        raise KeyError(name)

    def source_steps(self) -> tuple[SourceStep, ...]:
        """Every source, in the graph's order (one in a job of the older shape, `source`)."""
        return self._sources

    def source_step(self, name: str) -> SourceStep:
        """The source named `name` as the runtime runs it; KeyError if there is none."""
        for step in self._sources:
            if step.stage.name == name:
                return step
        raise KeyError(name)

    def source_routes(self, name: str | None = None) -> tuple[Route, ...]:
        """Where source `name`'s records go (the first source's when not named): each route
        to a keyed stage."""
        return self._sources[0].routes if name is None else self.source_step(name).routes

    def source_id(self, stage: str, index: int) -> int:
        """The id instance `index` of source `stage` stamps its records with, and keys its
        checkpointed position by: unique across the job's sources, each source's ids in a
        block of MAX_PARALLELISM (a source's parallelism never changes; the first source's
        ids are its indexes)."""
        ordinal = next(i for i, step in enumerate(self._sources) if step.stage.name == stage)
        return ordinal * MAX_PARALLELISM + index

    def source_instance(self, source_id: int) -> tuple[str, int]:
        """The (source stage, index) of a `source_id`."""
        ordinal, index = divmod(source_id, MAX_PARALLELISM)
        return self._sources[ordinal].stage.name, index

    def sinks(self) -> tuple[SinkStage, ...]:
        """Every sink, in the graph's order (the first is `sink`; one in the older shape)."""
        return self._sinks

    def sink_stage(self, name: str) -> SinkStage:
        """The sink named `name`; KeyError if there is none."""
        for sink in self._sinks:
            if sink.name == name:
                return sink
        raise KeyError(name)

    def sink_inputs(self, sink: str | None = None) -> tuple[str, ...]:
        """The keyed stages whose updates sink `sink` (the first sink: `sink`) receives."""
        return self._sink_inputs[self.sink.name if sink is None else sink]

    def dataflow(self) -> Graph:
        """The job's graph, checked: its `graph`, or the older shape normalised into one (the
        source's map/filter transforms become stages named `<source>-<n>`)."""
        if self.graph is not None:
            nodes = [_node(stage) for stage in self.graph]
        else:
            nodes = self._chain_nodes()
        return build_graph(nodes)

    def _chain_nodes(self) -> list[Node]:
        source, keyed, sink = self.source, self.keyed, self.sink
        maps = any(t.map is not None for t in source.transforms)
        made = made_fields(source.config)
        fields = made if made and maps else self.fields
        nodes = [Node(source.name, "source", source.parallelism, fields=fields)]
        for i, t in enumerate(source.transforms, 1):
            role: Role = "map" if t.map is not None else "filter"
            nodes.append(
                Node(
                    f"{source.name}-{i}",
                    role,
                    source.parallelism,
                    (nodes[-1].name,),
                    "forward",
                    fields=self.fields if t.map is not None else None,
                    function=t.map or t.filter,
                )
            )
        nodes.append(_keyed_node(keyed, (nodes[-1].name,)))
        nodes.append(Node(sink.name, "sink", sink.parallelism, (keyed.name,)))
        return nodes

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> JobSpec:
        if self.graph is not None:
            self._lower_graph(info)
        else:
            to_sink = (Route(self.sink.name, ()),)
            source = (self.source.name,)
            self._keyed_stages = (KeyedStep(self.keyed, dict(self.fields), source, to_sink),)
            transforms = tuple(Chained.of(t) for t in self.source.transforms)
            routes = (Route(self.keyed.name, transforms),)
            self._sources = (SourceStep(self.source, dict(self.fields), routes),)
            self._sinks = (self.sink,)
            self._sink_inputs = {self.sink.name: (self.keyed.name,)}
        names = [stage.name for stage in self.stages()]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be distinct, got {names}")
        for step in self._keyed_stages:
            if step.sides and self.source.event_time is None:
                raise ValueError(
                    f"stage {step.stage.name!r}: a join needs event time (its windows and "
                    "intervals are of event time, its state is dropped by the watermark): give "
                    "the source `event_time` settings"
                )
        # A join's key fields were checked per input by the graph (`fields` are its source's).
        if not self._keyed_stages[0].sides:
            if self.keyed.key_by not in self.fields:
                raise ValueError(
                    f"keyed.key_by {self.keyed.key_by!r} is not one of fields {list(self.fields)}"
                )
            if self.fields[self.keyed.key_by] not in ("int", "str"):
                raise ValueError("keyed.key_by must name an 'int' or 'str' field")
        op = self.keyed.operator
        if isinstance(op, WindowOperator) and self.source.event_time is None:
            raise ValueError(
                "keyed.operator: a window needs event time: give the source `event_time` "
                "settings (its watermarks fire the windows)"
            )
        if isinstance(op, AggregateOperator | WindowOperator):
            aggregate = op.function if isinstance(op, AggregateOperator) else op.aggregate
            if aggregate in ("count", None):
                if op.field is not None and op.field not in self.fields:
                    raise ValueError(f"keyed.operator.field {op.field!r} is not a field")
            elif op.field is None:
                raise ValueError(f"keyed.operator.field is required for {aggregate!r}")
            elif self.fields.get(op.field) not in ("int", "float"):
                raise ValueError(f"keyed.operator.field {op.field!r} must be an int or float field")
        # A graph's sources are checked as its stages (`SourceNode`): its `fields` are what its
        # first keyed stage reads, which need not be the first source's records.
        made = made_fields(self.source.config) if self.graph is None else None
        if made and not self.source.transforms and self.fields != made:
            maker = "generator" if made is GENERATED_FIELDS else "nexmark source"
            raise ValueError(
                f"the {maker} makes records {made}; with no transforms to reshape "
                f"them, fields must be exactly that (got {self.fields})"
            )
        self._check_event_time()
        # A field any source's records have (several sources: each checks its own).
        schemas = [self.fields, *(source.fields for source in self._sources)]
        floats = {name for schema in schemas for name, kind in schema.items() if kind == "float"}
        not_floats = [f for f in self.allow_non_finite if f not in floats]
        if not_floats:
            raise ValueError(f"allow_non_finite names {not_floats}, which are not float fields")
        for step in self._keyed_stages:
            if step.stage.parallelism > self.max_key_groups:
                raise ValueError(
                    f"keyed.parallelism of stage {step.stage.name!r} must not exceed max_key_groups"
                )
            op = step.stage.operator
            sinks = {sink.name for sink in self._sinks}
            feeds_keyed = any(route.target not in sinks for route in step.outputs)
            if isinstance(op, WindowOperator) and op.allowed_lateness_ms and feeds_keyed:
                raise ValueError(
                    f"stage {step.stage.name!r}: not supported yet: allowed_lateness_ms on a "
                    "window that feeds another keyed stage (its updated results would count "
                    "there as new records); only a window feeding the sink may have it"
                )
        if self.graph is None:
            try:
                self.dataflow()
            except GraphError as exc:
                raise ValueError(str(exc)) from None
        return self

    def _check_event_time(self) -> None:
        """An event-time field names an int field of the records each source emits (after its
        chained transforms: what each of its routes' keyed stages reads)."""
        for source in self._sources:
            settings = source.stage.event_time
            if settings is None or settings.field is None:
                continue
            for route in source.routes:
                step = self.keyed_step(route.target)
                fields = step.fields if route.side is None else step.sides[route.side].fields
                kind = fields.get(settings.field)
                if kind is None:
                    raise ValueError(
                        f"source.event_time.field {settings.field!r} is not one of the source's "
                        f"fields {list(fields)} (source {source.stage.name!r})"
                    )
                if kind != "int":
                    raise ValueError(
                        f"source.event_time.field {settings.field!r} is a {kind!r} field; an "
                        "event time is an 'int' field of epoch microseconds"
                    )

    _no_reserved = field_validator("fields")(_record_fields)

    def stages(self) -> list[Stage]:
        return [
            *(step.stage for step in self._sources),
            *(step.stage for step in self._keyed_stages),
            *self._sinks,
        ]


def _check_sink_paths(sinks: list[SinkStage]) -> None:
    """Each log sink owns its directory: two sinks writing into one (or one inside the other)
    would mix their partitions, offsets and readers' commits."""
    logs = [(s.name, Path(s.config.path)) for s in sinks if isinstance(s.config, LogSink)]
    for i, (name, path) in enumerate(logs):
        for other, other_path in logs[:i]:
            if path == other_path or path in other_path.parents or other_path in path.parents:
                raise ValueError(
                    f"stage {name!r} (sink): its output log {str(path)!r} and the output log "
                    f"{str(other_path)!r} of sink {other!r} overlap: give each sink its own "
                    "directory"
                )


J = TypeVar("J", bound=JobSpec)


def local_recovery(spec: JobSpec) -> bool:
    """Whether a lost keyed instance of `spec` is recovered locally (keyshift.runtime.
    local_recovery): the job takes checkpoints and asks for it."""
    return spec.checkpoints is not None and spec.recovery == "local"


def _format_errors(exc: ValidationError, origin: str) -> str:
    lines = [f"invalid job {origin}:"]
    for err in exc.errors():
        loc = ".".join(
            str(p) for p in err["loc"] if not str(p).startswith(("function-", _TAG_PREFIX))
        )
        message = err["msg"]
        if err["type"] == "unknown_kind" and isinstance(err["input"], dict):
            message = f"unknown kind {err['input'].get('kind')!r}: {message}"
        lines.append(f"  {loc or '(top level)'}: {message}")
    return "\n".join(lines)


def parse_job(data: Any, origin: str = "definition", resolve_functions: bool = True) -> JobSpec:
    """Validate a job given as plain data; raise JobError naming each bad field and why.
    Without `resolve_functions`, user functions are checked for their form only."""
    return parse_job_as(JobSpec, data, origin, resolve_functions)


def parse_job_as(
    model: type[J], data: Any, origin: str = "definition", resolve_functions: bool = True
) -> J:
    """`parse_job` into `model`, a JobSpec that reads more of the job (a host's)."""
    if not isinstance(data, dict):
        raise JobError(f"invalid job {origin}: the top level must be a mapping")
    try:
        check_data(data)
    except JobFileError as exc:
        raise JobError(f"invalid job {origin}: {exc}") from None
    try:
        return model.model_validate(data, context={"resolve_functions": resolve_functions})
    except ValidationError as exc:
        raise JobError(_format_errors(exc, origin)) from None


def load_job(path: str | Path, resolve_functions: bool = True) -> JobSpec:
    """Read (within the limits of keyshift.runtime.job_file) and validate a YAML job file."""
    return load_job_as(JobSpec, path, resolve_functions)


def load_job_as(model: type[J], path: str | Path, resolve_functions: bool = True) -> J:
    """`load_job` into `model`, a JobSpec that reads more of the job (a host's)."""
    try:
        data = read_job_file(path)
    except JobFileError as exc:
        raise JobError(str(exc)) from None
    return parse_job_as(model, data, f"file {path}", resolve_functions)
