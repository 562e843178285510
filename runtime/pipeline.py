"""A small Python API that builds a job: the same graph a YAML job file describes.

Users' Python scripts and tests build jobs with it; it produces the same `JobSpec` a YAML file
does: `Pipeline` the older chain shape, `source(...)` steps and `Dataflow` a graph of named
stages (see the graph section below). Each step returns a new value (the old one is unchanged);
`build()` hands the collected data to `keyshift.runtime.job.parse_job`, so every field is
validated in one place, and `to_yaml()` writes a job file that `load_job` reads back to an
equal `JobSpec`.

Functions (map, filter, process, sink) run in other processes, which import them by name: they
are stored as "module:qualname" strings and must be defined at module level in an importable
module.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import yaml

from keyshift.runtime.job import (
    ConstantProfile,
    FieldType,
    JobError,
    JobSpec,
    PointsProfile,
    RampProfile,
    SineProfile,
    StepProfile,
    parse_job,
    resolve_function,
)

UserFunction = Callable[..., Any] | str
"""A module-level function, or its "module:qualname" path."""

Profile = (
    Mapping[str, Any] | ConstantProfile | StepProfile | RampProfile | SineProfile | PointsProfile
)

ORDER = (
    "generator() -> map()/filter() -> fields() -> key_by() -> "
    "count()/sum()/min()/max()/mean()/process() -> sink_log()/sink()"
)

# The position of each kind of step in ORDER; only map()/filter() may repeat.
_SOURCE, _TRANSFORM, _FIELDS, _KEY_BY, _OPERATOR, _SINK = range(6)
_REPEATABLE = {_TRANSFORM}
_ONCE = {
    _SOURCE: "a job has one source",
    _FIELDS: "a job has one record schema",
    _KEY_BY: "a job has one key",
    _OPERATOR: "a job has one keyed operator",
    _SINK: "a job has one sink",
}
_FIX = "define it with `def` at module level in a module the job's processes can import"


def function_path(fn: UserFunction, role: str = "function") -> str:
    """The "module:qualname" under which other processes import `fn`; JobError if there is none.

    A string is returned as it is (`build()` checks that it resolves).
    """
    if isinstance(fn, str):
        return fn
    if not callable(fn):
        raise JobError(
            f"{role}: expected a function or a 'module:function' string, got "
            f"{type(fn).__name__} {fn!r}"
        )
    if inspect.ismethod(fn) and not inspect.isclass(fn.__self__):
        raise JobError(
            f"{role}: {fn!r} is a method bound to an object, which other processes cannot "
            f"import by name; {_FIX}"
        )
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise JobError(f"{role}: {fn!r} has no importable name (module and qualified name); {_FIX}")
    if getattr(fn, "__name__", None) == "<lambda>":
        raise JobError(f"{role}: a lambda cannot be imported by other processes; {_FIX}")
    if "<locals>" in qualname:
        raise JobError(
            f"{role}: {qualname} is defined inside another function, so other processes "
            f"cannot import it; {_FIX}"
        )
    if module == "__main__":
        raise JobError(
            f"{role}: {qualname} is defined in __main__ (the script being run), which other "
            f"processes cannot import; {_FIX} (move it to its own module and import it)"
        )
    path = f"{module}:{qualname}"
    resolved = resolve_function(path)
    if resolved is not fn and resolved != fn:
        raise JobError(
            f"{role}: {path!r} names a different object than the one given (was it "
            f"redefined or replaced after import?); {_FIX}"
        )
    return path


def process_operator(fn: UserFunction, on_timer: UserFunction | None) -> dict[str, Any]:
    """A process operator's definition, with its timer callback if it has one."""
    operator = {"kind": "process", "function": function_path(fn, "process()")}
    if on_timer is not None:
        operator["on_timer"] = function_path(on_timer, "process(on_timer=)")
    return operator


def _given(**values: Any) -> dict[str, Any]:
    """Only the arguments the caller gave: what is left out takes the default of job.py."""
    return {k: v for k, v in values.items() if v is not None}


def _profile_data(profile: Profile | None) -> Any:
    if profile is None or isinstance(profile, Mapping):
        return None if profile is None else dict(profile)
    return profile.model_dump()


@dataclass(frozen=True)
class _Draft:
    """What the steps so far have said; plain data in the shape of a job file."""

    top: Mapping[str, Any]
    level: int = -1
    last_step: str = ""
    source: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    transforms: tuple[Mapping[str, str], ...] = ()
    fields: Mapping[str, str] | None = None
    key_by: str | None = None
    keyed: Mapping[str, Any] | None = None
    sink: Mapping[str, Any] | None = None
    batching: Mapping[str, Any] | None = None
    autoscaler: Mapping[str, Any] | None = None


class Pipeline:
    """A job under construction; steps go in the order of `ORDER`, then `build()`.

    Arguments left out (or None) take the defaults a job file would get.
    """

    __slots__ = ("_draft",)

    def __init__(self, name: str, *, max_key_groups: int | None = None) -> None:
        self._draft = _Draft(top=_given(name=name, max_key_groups=max_key_groups))

    @classmethod
    def _of(cls, draft: _Draft) -> Pipeline:
        pipeline = cls.__new__(cls)
        pipeline._draft = draft
        return pipeline

    def _step(self, level: int, step: str, **changes: Any) -> Pipeline:
        d = self._draft
        if level < d.level:
            raise JobError(
                f"{step}() cannot come after {d.last_step}(): the steps go in the order {ORDER}"
            )
        if level == d.level and level not in _REPEATABLE:
            raise JobError(f"{step}() cannot come after {d.last_step}(): {_ONCE[level]}")
        return Pipeline._of(replace(d, level=level, last_step=step, **changes))

    # -- source ------------------------------------------------------------------------------

    def generator(
        self,
        *,
        keys: int | None = None,
        distribution: Literal["uniform", "zipf", "sequential"] | None = None,
        zipf_exponent: float | None = None,
        seed: int | None = None,
        profile: Profile | None = None,
        total: int | None = None,
        parallelism: int | None = None,
        name: str | None = None,
    ) -> Pipeline:
        """Generated records {key: int, value: float}; no profile = as fast as the job takes.

        Optional: a job without a source step uses a generator with the defaults.
        """
        config = {"kind": "generator"} | _given(
            keys=keys,
            distribution=distribution,
            zipf_exponent=zipf_exponent,
            seed=seed,
            profile=_profile_data(profile),
            total=total,
        )
        stage = _given(name=name, parallelism=parallelism) | {"config": config}
        return self._step(_SOURCE, "generator", source=stage)

    # -- stateless transforms (chained into the source stage) --------------------------------

    def map(self, fn: UserFunction) -> Pipeline:
        """`fn(record: dict) -> dict`, run on every record in the source stage."""
        transform = {"map": function_path(fn, "map()")}
        return self._step(_TRANSFORM, "map", transforms=(*self._draft.transforms, transform))

    def filter(self, fn: UserFunction) -> Pipeline:
        """`fn(record: dict) -> bool`; records for which it is false are dropped."""
        transform = {"filter": function_path(fn, "filter()")}
        return self._step(_TRANSFORM, "filter", transforms=(*self._draft.transforms, transform))

    def fields(
        self, schema: Mapping[str, FieldType] | None = None, /, **fields: FieldType
    ) -> Pipeline:
        """The record schema after the transforms, as a mapping and/or keywords.

        Needed after a map(), which can change the records' shape; otherwise optional.
        """
        merged = dict(schema or {}) | fields
        return self._step(_FIELDS, "fields", fields=merged)

    # -- keyed stage ---------------------------------------------------------------------------

    def key_by(self, field: str) -> Pipeline:
        """The field whose value is the key (an int or str field)."""
        d = self._draft
        if d.level < _FIELDS and any("map" in t for t in d.transforms):
            raise JobError(
                "key_by() after map() needs the record schema first: a map can change the "
                "records' shape, so declare it with fields(name='int', ...) before key_by()"
            )
        return self._step(_KEY_BY, "key_by", key_by=field)

    def _operator(
        self, step: str, operator: dict[str, Any], parallelism: int | None, name: str | None
    ) -> Pipeline:
        if self._draft.key_by is None:
            raise JobError(f"{step}() needs a key: call key_by(field) before it")
        stage = _given(name=name, parallelism=parallelism) | {"operator": operator}
        return self._step(_OPERATOR, step, keyed=stage)

    def count(self, *, parallelism: int | None = None, name: str | None = None) -> Pipeline:
        """A running count of records per key."""
        return self._operator(
            "count", {"kind": "aggregate", "function": "count"}, parallelism, name
        )

    def sum(
        self, field: str, *, parallelism: int | None = None, name: str | None = None
    ) -> Pipeline:
        """A running sum of a numeric field per key."""
        return self._aggregate("sum", field, parallelism, name)

    def min(
        self, field: str, *, parallelism: int | None = None, name: str | None = None
    ) -> Pipeline:
        """The running minimum of a numeric field per key."""
        return self._aggregate("min", field, parallelism, name)

    def max(
        self, field: str, *, parallelism: int | None = None, name: str | None = None
    ) -> Pipeline:
        """The running maximum of a numeric field per key."""
        return self._aggregate("max", field, parallelism, name)

    def mean(
        self, field: str, *, parallelism: int | None = None, name: str | None = None
    ) -> Pipeline:
        """The running mean of a numeric field per key."""
        return self._aggregate("mean", field, parallelism, name)

    def _aggregate(
        self, function: str, field: str, parallelism: int | None, name: str | None
    ) -> Pipeline:
        operator = {"kind": "aggregate", "function": function, "field": field}
        return self._operator(function, operator, parallelism, name)

    def process(
        self,
        fn: UserFunction,
        *,
        on_timer: UserFunction | None = None,
        parallelism: int | None = None,
        name: str | None = None,
    ) -> Pipeline:
        """`fn(state, record) -> (state, output or None)` per record; state None deletes it.
        With `on_timer`, `fn(state, record, timers)` may register timers for the record's key,
        and `on_timer(state, key, timestamp, kind, timers)` is called when each is due."""
        return self._operator("process", process_operator(fn, on_timer), parallelism, name)

    # -- sink -------------------------------------------------------------------------------

    def _sink(
        self, step: str, config: dict[str, Any], parallelism: int | None, name: str | None
    ) -> Pipeline:
        if self._draft.keyed is None:
            raise JobError(
                f"{step}() needs a keyed operator before it: call key_by(field) and then one "
                "of count()/sum()/min()/max()/mean()/process()"
            )
        stage = _given(name=name, parallelism=parallelism) | {"config": config}
        return self._step(_SINK, step, sink=stage)

    def sink_log(
        self,
        path: str | None = None,
        *,
        format: Literal["jsonl", "parquet", "none"] | None = None,
        segment_records: int | None = None,
        parallelism: int | None = None,
        name: str | None = None,
    ) -> Pipeline:
        """The ordered output log in directory `path`.

        Optional: a job without a sink step writes a log with the defaults.
        """
        config = {"kind": "log"} | _given(path=path, format=format, segment_records=segment_records)
        return self._sink("sink_log", config, parallelism, name)

    def sink(
        self, fn: UserFunction, *, parallelism: int | None = None, name: str | None = None
    ) -> Pipeline:
        """`fn(batch: pyarrow.RecordBatch)` called with every batch of updates."""
        config = {"kind": "function", "function": function_path(fn, "sink()")}
        return self._sink("sink", config, parallelism, name)

    # -- job-wide settings (any time, once) -------------------------------------------------

    def batching(
        self,
        *,
        max_records: int | None = None,
        linger_ms: float | None = None,
        credits: int | None = None,
    ) -> Pipeline:
        """How records are grouped into batches between stages, and batches in flight."""
        if self._draft.batching is not None:
            raise JobError("batching() was already called: a job has one batching setting")
        given = _given(max_records=max_records, linger_ms=linger_ms, credits=credits)
        return Pipeline._of(replace(self._draft, batching=given))

    def autoscale(self, **settings: Any) -> Pipeline:
        """Let the job pick its parallelism; keyword arguments are the autoscaler settings
        (keyshift.policies.settings.AutoscalerSettings; the README lists them), checked when a
        host loads the job (`keyshift run`, the operator): the runtime carries them unread."""
        if self._draft.autoscaler is not None:
            raise JobError("autoscale() was already called: a job has one autoscaler")
        return Pipeline._of(replace(self._draft, autoscaler=dict(settings)))

    # -- results ------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The job as plain data, in the shape of a job file (not yet validated)."""
        d = self._draft
        if d.keyed is None:
            operators = "count()/sum()/min()/max()/mean()/process()"
            if d.key_by is not None:
                raise JobError(f"key_by({d.key_by!r}) needs a keyed operator after it: {operators}")
            raise JobError(
                f"the job has no keyed operator: call key_by(field) and then one of {operators}"
            )
        data: dict[str, Any] = dict(d.top)
        if d.fields is not None:
            data["fields"] = dict(d.fields)
        source = dict(d.source)
        if d.transforms:
            source["transforms"] = [dict(t) for t in d.transforms]
        if source:
            data["source"] = source
        data["keyed"] = {**d.keyed, "key_by": d.key_by}
        if d.sink is not None:
            data["sink"] = dict(d.sink)
        if d.batching is not None:
            data["batching"] = dict(d.batching)
        if d.autoscaler is not None:
            data["autoscaler"] = dict(d.autoscaler)
        return data

    def build(self) -> JobSpec:
        """The validated job; JobError naming each bad field and why."""
        return parse_job(self.to_dict(), origin=f"pipeline {self._draft.top.get('name')!r}")

    def to_yaml(self) -> str:
        """A job file for this pipeline, holding what the steps set (defaults left out)."""
        data = self.build().model_dump(mode="json", exclude_unset=True)
        return yaml.safe_dump(data, sort_keys=False)


# -- graphs ------------------------------------------------------------------------------------
#
# The same API for a job of many stages: a `Stream` is the output of one stage (or of several,
# after `union`), and each step adds a stage that reads it. Each step returns a new `Stream`;
# `Dataflow(name, *sinks)` collects every stage the sinks read from into the job's `graph`.

Partition = Literal["forward", "rebalance", "broadcast"]


@dataclass(frozen=True)
class Stream:
    """What a stage (or a union of stages) emits; the steps below add the stages that read it.

    Stages left unnamed are named `<step>-<n>`, n counting the stages before them; branches
    that are joined again must not reuse a name, so name the stages of such branches."""

    stages: tuple[Mapping[str, Any], ...]
    heads: tuple[str, ...]
    partitioning: Partition | None = None

    def _add(self, step: str, stage: Mapping[str, Any], name: str | None) -> Stream:
        named = {"name": name or f"{step.replace('_', '-')}-{len(self.stages) + 1}"} | dict(stage)
        inputs: dict[str, Any] = (
            {"input": self.heads[0]} if len(self.heads) == 1 else {"inputs": list(self.heads)}
        )
        if self.partitioning is not None and stage.get("kind") != "keyed":
            inputs["partitioning"] = self.partitioning
        return Stream(_merge(self.stages, ({**named, **inputs},)), (named["name"],))

    def _repartition(self, partitioning: Partition) -> Stream:
        return replace(self, partitioning=partitioning)

    def forward(self) -> Stream:
        """The next stage's instance i reads this stage's instance i (equal parallelism)."""
        return self._repartition("forward")

    def rebalance(self) -> Stream:
        """The next stage's instances get the records round robin."""
        return self._repartition("rebalance")

    def broadcast(self) -> Stream:
        """Every instance of the next stage gets every record."""
        return self._repartition("broadcast")

    def union(self, *others: Stream) -> Stream:
        """One stream of this one's records and the others'; they must have one schema."""
        stages = self.stages
        for other in others:
            stages = _merge(stages, other.stages)
        heads = tuple(dict.fromkeys(h for s in (self, *others) for h in s.heads))
        return Stream(stages, heads)

    def _stateless(
        self,
        kind: str,
        fn: UserFunction,
        fields: Mapping[str, FieldType] | None,
        name: str | None,
        parallelism: int | None,
    ) -> Stream:
        stage = {"kind": kind, "function": function_path(fn, f"{kind}()")} | _given(
            fields=None if fields is None else dict(fields), parallelism=parallelism
        )
        return self._add(kind, stage, name)

    def map(
        self,
        fn: UserFunction,
        *,
        fields: Mapping[str, FieldType] | None = None,
        name: str | None = None,
        parallelism: int | None = None,
    ) -> Stream:
        """`fn(record) -> record`; `fields` is the schema it emits (left out: unchanged)."""
        return self._stateless("map", fn, fields, name, parallelism)

    def filter(
        self, fn: UserFunction, *, name: str | None = None, parallelism: int | None = None
    ) -> Stream:
        """`fn(record) -> bool`; records for which it is false are dropped."""
        return self._stateless("filter", fn, None, name, parallelism)

    def flat_map(
        self,
        fn: UserFunction,
        *,
        fields: Mapping[str, FieldType] | None = None,
        name: str | None = None,
        parallelism: int | None = None,
    ) -> Stream:
        """`fn(record) -> list of records`; `fields` is the schema it emits."""
        return self._stateless("flat_map", fn, fields, name, parallelism)

    def key_by(self, field: str) -> KeyedStream:
        """The next stage is keyed by `field` (an int or str field of these records)."""
        return KeyedStream(self, field)

    def sink_log(
        self,
        path: str | None = None,
        *,
        format: Literal["jsonl", "parquet", "none"] | None = None,
        segment_records: int | None = None,
        parallelism: int | None = None,
        partitions: int | None = None,
        name: str | None = None,
    ) -> Stream:
        """An ordered output log in directory `path` (each sink of a job in its own), in
        `partitions` partitions (left out: its parallelism). A stream may feed several sinks:
        call this (or `sink`) once per sink, name each, and give them all to `Dataflow`."""
        config = {"kind": "log"} | _given(path=path, format=format, segment_records=segment_records)
        return self._sink(config, parallelism, partitions, name)

    def sink(
        self,
        fn: UserFunction,
        *,
        parallelism: int | None = None,
        partitions: int | None = None,
        name: str | None = None,
    ) -> Stream:
        """`fn(batch: pyarrow.RecordBatch)` called with every batch this stage receives."""
        config = {"kind": "function", "function": function_path(fn, "sink()")}
        return self._sink(config, parallelism, partitions, name)

    def _sink(
        self,
        config: Mapping[str, Any],
        parallelism: int | None,
        partitions: int | None,
        name: str | None,
    ) -> Stream:
        stage = {"kind": "sink", "config": dict(config)} | _given(
            parallelism=parallelism, partitions=partitions
        )
        return self._add("sink", stage, name)


def _merge(
    ours: tuple[Mapping[str, Any], ...], theirs: tuple[Mapping[str, Any], ...]
) -> tuple[Mapping[str, Any], ...]:
    """Both branches' stages, each once; JobError for two different stages of one name."""
    merged = {s["name"]: s for s in ours}
    for stage in theirs:
        known = merged.setdefault(stage["name"], stage)
        if known != stage and known.get("kind") == stage.get("kind") == "sink":
            raise JobError(
                f"two different sinks are named {stage['name']!r}: name each sink of a stream "
                "that feeds several (name=...)"
            )
        if known != stage:
            raise JobError(
                f"two different stages are named {stage['name']!r}: name the stages of "
                "branches that are joined again (name=...)"
            )
    return tuple(merged.values())


@dataclass(frozen=True)
class KeyedStream:
    """A stream about to enter a keyed stage: one of the operators below makes the stage
    (each takes `standby`: idle pre-started instances a scale-out takes first)."""

    stream: Stream
    key: str

    def _keyed(
        self,
        step: str,
        operator: Mapping[str, Any],
        name: str | None,
        parallelism: int | None,
        state: Mapping[str, Any] | None,
        standby: int | None,
    ) -> Stream:
        stage = {"kind": "keyed", "key_by": self.key, "operator": dict(operator)} | _given(
            parallelism=parallelism, state=None if state is None else dict(state), standby=standby
        )
        return self.stream._add(step, stage, name)

    def count(
        self,
        *,
        name: str | None = None,
        parallelism: int | None = None,
        state: Mapping[str, Any] | None = None,
        standby: int | None = None,
    ) -> Stream:
        """A running count of records per key."""
        return self._keyed(
            "count", {"kind": "aggregate", "function": "count"}, name, parallelism, state, standby
        )

    def aggregate(
        self,
        function: Literal["count", "sum", "min", "max", "mean"],
        field: str | None = None,
        *,
        name: str | None = None,
        parallelism: int | None = None,
        state: Mapping[str, Any] | None = None,
        standby: int | None = None,
    ) -> Stream:
        """A running count/sum/min/max/mean of `field` per key."""
        operator = {"kind": "aggregate", "function": function} | _given(field=field)
        return self._keyed(function, operator, name, parallelism, state, standby)

    def process(
        self,
        fn: UserFunction,
        *,
        on_timer: UserFunction | None = None,
        name: str | None = None,
        parallelism: int | None = None,
        state: Mapping[str, Any] | None = None,
        standby: int | None = None,
    ) -> Stream:
        """`fn(state, record) -> (state, output or None)` per record; with `on_timer`, timers
        as `Pipeline.process` has them."""
        operator = process_operator(fn, on_timer)
        return self._keyed("process", operator, name, parallelism, state, standby)

    def window(
        self,
        window: Mapping[str, Any],
        function: Literal["count", "sum", "min", "max", "mean"] | None = None,
        field: str | None = None,
        *,
        reduce: UserFunction | None = None,
        process: UserFunction | None = None,
        name: str | None = None,
        parallelism: int | None = None,
        state: Mapping[str, Any] | None = None,
        standby: int | None = None,
        allowed_lateness_ms: float | None = None,
    ) -> Stream:
        """A count (the default)/sum/min/max/mean of `field` per key and event-time window
        (`window` as a job file's: `{"kind": "tumbling", "size_ms": ...}`, `{"kind":
        "sliding", "size_ms": ..., "slide_ms": ...}` or `{"kind": "session", "gap_ms": ...}`),
        each result sent once the watermark passes the window's end; the source needs
        `event_time` settings. Instead of an
        aggregate, `reduce(accumulator, record) -> accumulator` folds each record into its
        window, or `process(records) -> result` is called with the window's records when it
        fires (with `field`, they get that field's values instead of whole records). With
        `allowed_lateness_ms`, a late record within it sends the window's updated result;
        later ones go to the Dataflow's `late_records` log (`Dataflow(..., late_records=
        {"path": ...})`)."""
        operator = {"kind": "window", "window": dict(window)} | _given(
            function=function,
            field=field,
            reduce=None if reduce is None else function_path(reduce, "window(reduce=...)"),
            process=None if process is None else function_path(process, "window(process=...)"),
            allowed_lateness_ms=allowed_lateness_ms,
        )
        return self._keyed("window", operator, name, parallelism, state, standby)

    def _join(
        self,
        step: str,
        other: KeyedStream,
        operator: Mapping[str, Any],
        function: UserFunction | None,
        name: str | None,
        parallelism: int | None,
        state: Mapping[str, Any] | None,
    ) -> Stream:
        if not isinstance(other, KeyedStream):
            raise JobError(
                f"{step}() joins another keyed stream: call it with other.key_by(field), got "
                f"{type(other).__name__}"
            )
        heads = (*self.stream.heads, *other.stream.heads)
        if len(heads) != 2:
            raise JobError(
                f"{step}() joins two streams of one stage each; a union on a side ({list(heads)}) "
                "is not supported yet"
            )
        if function is not None:
            operator = {**operator, "function": function_path(function, f"{step}(function=)")}
        stages = _merge(self.stream.stages, other.stream.stages)
        named = {
            "name": name or f"{step.replace('_', '-')}-{len(stages) + 1}",
            "kind": "keyed",
            "inputs": list(heads),
            "key_by": [self.key, other.key],
            "operator": dict(operator),
        } | _given(parallelism=parallelism, state=None if state is None else dict(state))
        return Stream(_merge(stages, (named,)), (named["name"],))

    def window_join(
        self,
        other: KeyedStream,
        size_ms: float,
        function: UserFunction | None = None,
        *,
        name: str | None = None,
        parallelism: int | None = None,
        state: Mapping[str, Any] | None = None,
    ) -> Stream:
        """This stream's records (left) joined with `other`'s (right) on equal keys in the same
        tumbling event-time window of `size_ms`; each pair is sent once the watermark passes
        the window's end, as `function(left, right)`'s value (none: [left, right]; a None
        value: no output). The source needs `event_time` settings."""
        operator = {"kind": "window_join", "window": {"kind": "tumbling", "size_ms": size_ms}}
        return self._join("window_join", other, operator, function, name, parallelism, state)

    def interval_join(
        self,
        other: KeyedStream,
        lower_ms: float,
        upper_ms: float,
        function: UserFunction | None = None,
        *,
        name: str | None = None,
        parallelism: int | None = None,
        state: Mapping[str, Any] | None = None,
    ) -> Stream:
        """This stream's records (left) joined with `other`'s (right) on equal keys when
        left.ts + lower_ms <= right.ts <= left.ts + upper_ms; each pair is sent when its
        second record arrives, as `function(left, right)`'s value (as `window_join`)."""
        operator = {"kind": "interval_join", "lower_ms": lower_ms, "upper_ms": upper_ms}
        return self._join("interval_join", other, operator, function, name, parallelism, state)


def source(
    name: str,
    config: Mapping[str, Any] | None = None,
    *,
    fields: Mapping[str, FieldType] | None = None,
    parallelism: int | None = None,
    event_time: Mapping[str, Any] | None = None,
) -> Stream:
    """A source stage: `config` as in a job file (`{"kind": "generator", ...}` by default,
    `{"kind": "nexmark", ...}`, or `{"kind": "ingest", ...}` with the rows' `fields`);
    `event_time` as a job file's (`field`, `max_out_of_orderness_ms`, `idle_timeout_ms`)."""
    stage = {"name": name, "kind": "source"} | _given(
        config=None if config is None else dict(config),
        fields=None if fields is None else dict(fields),
        parallelism=parallelism,
        event_time=None if event_time is None else dict(event_time),
    )
    return Stream((stage,), (name,))


class Dataflow:
    """A job of many stages: every stage the given sinks read from (one or more sinks, from
    one stream or several), and the job-wide settings as a job file has them
    (`max_key_groups`, `batching`, `autoscaler`, `checkpoints`, ...)."""

    __slots__ = ("_data",)

    def __init__(self, name: str, *sinks: Stream, **settings: Any) -> None:
        if not sinks:
            raise JobError("a Dataflow needs at least one stream ending in a sink")
        stages: tuple[Mapping[str, Any], ...] = ()
        for stream in sinks:
            stages = _merge(stages, stream.stages)
        given = {k: v for k, v in settings.items() if v is not None}
        self._data = {"name": name} | given | {"graph": [dict(s) for s in stages]}

    def to_dict(self) -> dict[str, Any]:
        """The job as plain data, in the shape of a job file (not yet validated)."""
        return {k: (list(v) if k == "graph" else v) for k, v in self._data.items()}

    def build(self) -> JobSpec:
        """The validated job; JobError naming each bad stage or field and why."""
        return parse_job(self.to_dict(), origin=f"dataflow {self._data['name']!r}")

    def to_yaml(self) -> str:
        """A job file for this job, holding what the steps set (defaults left out)."""
        data = self.build().model_dump(mode="json", exclude_unset=True)
        return yaml.safe_dump(data, sort_keys=False)
