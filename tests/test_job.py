"""Tests of keyshift.runtime.job: loading a YAML job file, defaults, and every class of bad input.

Every invalid job must raise `JobError` (never a bare pydantic, YAML, OS or import error) with a
message that names the offending field and says why.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from keyshift.runtime.job import (
    AggregateOperator,
    ConstantProfile,
    FunctionSink,
    GeneratorSource,
    IngestSource,
    JobError,
    JobSpec,
    LogSink,
    PointsProfile,
    ProcessOperator,
    RampProfile,
    SineProfile,
    StepProfile,
    load_job,
    parse_job,
    resolve_function,
)
from keyshift.runtime.records import RESERVED_FIELDS

REPO = Path(__file__).resolve().parents[1]

FULL_YAML = """\
name: sessions-2
max_key_groups: 512
fields: {user: str, amount: float, clicks: int, mobile: bool}
source:
  name: gen
  parallelism: 3
  config:
    kind: generator
    keys: 5000
    distribution: zipf
    zipf_exponent: 1.5
    seed: 42
    total: 1000000
    profile: {kind: ramp, rate: 100, to: 5000, over: 30}
  transforms:
    - map: copy:copy
    - filter: builtins:bool
keyed:
  name: totals
  parallelism: 4
  key_by: user
  operator: {kind: aggregate, function: sum, field: amount}
sink:
  name: out
  parallelism: 2
  config: {kind: log, path: out/sessions, format: parquet, segment_records: 5000}
batching: {max_records: 1024, linger_ms: 2.5, credits: 16}
"""


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def error_of(data: Any) -> str:
    with pytest.raises(JobError) as info:
        parse_job(data)
    return str(info.value)


def job(**overrides: Any) -> dict[str, Any]:
    return {"name": "j", **overrides}


# ------------------------------------------------------------------------------------------
# Valid jobs


def test_full_yaml_loads_with_every_value(tmp_path: Path) -> None:
    spec = load_job(write(tmp_path, FULL_YAML))
    assert isinstance(spec, JobSpec)
    assert spec.name == "sessions-2"
    assert spec.max_key_groups == 512
    assert spec.fields == {"user": "str", "amount": "float", "clicks": "int", "mobile": "bool"}
    assert list(spec.fields) == ["user", "amount", "clicks", "mobile"]  # order is kept

    assert spec.source.name == "gen" and spec.source.parallelism == 3
    config = spec.source.config
    assert isinstance(config, GeneratorSource)
    assert (config.keys, config.distribution, config.zipf_exponent) == (5000, "zipf", 1.5)
    assert (config.seed, config.total) == (42, 1_000_000)
    assert config.profile == RampProfile(kind="ramp", rate=100, to=5000, over=30)
    assert [(t.map, t.filter) for t in spec.source.transforms] == [
        ("copy:copy", None),
        (None, "builtins:bool"),
    ]

    assert spec.keyed.name == "totals" and spec.keyed.parallelism == 4
    assert spec.keyed.key_by == "user"
    assert spec.keyed.operator == AggregateOperator(function="sum", field="amount")

    assert spec.sink.name == "out" and spec.sink.parallelism == 2
    assert spec.sink.config == LogSink(path="out/sessions", format="parquet", segment_records=5000)

    assert (spec.batching.max_records, spec.batching.linger_ms, spec.batching.credits) == (
        1024,
        2.5,
        16,
    )
    assert [s.name for s in spec.stages()] == ["gen", "totals", "out"]


def test_process_operator_function_sink_and_ingest_source(tmp_path: Path) -> None:
    text = """\
    name: proc
    fields: {session: str, value: float}
    source: {config: {kind: ingest, port: 7000}}
    keyed: {key_by: session, operator: {kind: process, function: "os.path:join"}}
    sink: {config: {kind: function, function: "builtins:print"}}
    """
    spec = load_job(write(tmp_path, text))
    assert spec.source.config == IngestSource(kind="ingest", port=7000)
    assert spec.keyed.operator == ProcessOperator(kind="process", function="os.path:join")
    assert spec.sink.config == FunctionSink(kind="function", function="builtins:print")


def test_example_job_in_repository_is_valid() -> None:
    spec = load_job(REPO / "examples" / "clicks.yaml")
    assert spec.name == "clicks"
    assert spec.keyed.parallelism == 2
    assert spec.source.config.kind == "generator"


def test_defaults() -> None:
    spec = parse_job({"name": "minimal"})
    assert spec.max_key_groups == 4096
    assert spec.fields == {"key": "int", "value": "float"}

    assert (spec.source.name, spec.source.parallelism, spec.source.transforms) == ("source", 1, [])
    config = spec.source.config
    assert isinstance(config, GeneratorSource)
    assert config.profile is None
    assert (config.keys, config.distribution, config.zipf_exponent) == (10_000, "uniform", 1.0)
    assert (config.seed, config.total) == (0, None)

    assert (spec.keyed.name, spec.keyed.parallelism, spec.keyed.key_by) == ("keyed", 1, "key")
    assert spec.keyed.operator == AggregateOperator(kind="aggregate", function="count", field=None)

    assert (spec.sink.name, spec.sink.parallelism) == ("sink", 1)
    assert isinstance(spec.sink.config, LogSink)
    assert (spec.sink.config.path, spec.sink.config.format) == ("out", "jsonl")
    assert spec.sink.config.segment_records == 100_000

    assert (spec.batching.max_records, spec.batching.linger_ms, spec.batching.credits) == (
        8192,
        5.0,
        8,
    )


def test_kind_may_be_left_out_for_the_most_common_kind() -> None:
    spec = parse_job(
        job(
            source={"config": {"keys": 7, "profile": {"rate": 50}}},
            keyed={"operator": {"function": "max", "field": "value"}},
            sink={"config": {"path": "elsewhere"}},
        )
    )
    assert isinstance(spec.source.config, GeneratorSource) and spec.source.config.keys == 7
    assert spec.source.config.profile == ConstantProfile(rate=50)
    assert spec.keyed.operator == AggregateOperator(function="max", field="value")
    assert spec.sink.config == LogSink(path="elsewhere")


@pytest.mark.parametrize(
    ("profile", "expected"),
    [
        ({"kind": "constant", "rate": 10}, ConstantProfile(rate=10)),
        ({"rate": 0}, ConstantProfile(rate=0)),
        (
            {"kind": "step", "rate": 1, "to": 9, "at": 5},
            StepProfile(kind="step", rate=1, to=9, at=5),
        ),
        (
            {"kind": "ramp", "rate": 9, "to": 1, "over": 2.5},
            RampProfile(kind="ramp", rate=9, to=1, over=2.5),
        ),
        (
            {"kind": "sine", "rate": 10, "amplitude": 10, "period": 60},
            SineProfile(kind="sine", rate=10, amplitude=10, period=60),
        ),
        (
            {"kind": "points", "points": [[0, 5], [10, 0], [20.5, 7]]},
            PointsProfile(kind="points", points=[(0, 5), (10, 0), (20.5, 7)]),
        ),
    ],
)
def test_each_load_profile(profile: dict[str, Any], expected: Any) -> None:
    spec = parse_job(job(source={"config": {"kind": "generator", "profile": profile}}))
    assert isinstance(spec.source.config, GeneratorSource)
    assert spec.source.config.profile == expected
    assert type(spec.source.config.profile) is type(expected)


def test_fields_other_than_generated_are_fine_with_transforms_or_ingest() -> None:
    with_transforms = parse_job(
        job(
            fields={"k": "str", "v": "int"},
            source={"transforms": [{"map": "copy:copy"}]},
            keyed={"key_by": "k", "operator": {"function": "mean", "field": "v"}},
        )
    )
    assert with_transforms.fields == {"k": "str", "v": "int"}
    ingest = parse_job(
        job(fields={"k": "int"}, source={"config": {"kind": "ingest"}}, keyed={"key_by": "k"})
    )
    assert ingest.keyed.key_by == "k"


def test_keyed_parallelism_may_equal_max_key_groups() -> None:
    spec = parse_job(job(max_key_groups=8, keyed={"parallelism": 8}))
    assert spec.keyed.parallelism == spec.max_key_groups == 8


def test_resolve_function_follows_dotted_qualnames() -> None:
    import collections
    import os.path

    assert resolve_function("os.path:join") is os.path.join
    assert resolve_function("collections:OrderedDict.fromkeys") == (
        collections.OrderedDict.fromkeys
    )


# ------------------------------------------------------------------------------------------
# Invalid jobs: each names the field path and the reason


@pytest.mark.parametrize(
    ("data", "must_contain"),
    [
        (job(bogus=1), ["bogus", "extra inputs are not permitted"]),
        (job(keyed={"parallelism": 1, "paralelism": 2}), ["keyed.paralelism", "extra inputs"]),
        (
            job(batching={"max_records": 10, "linger": 1}),
            ["batching.linger", "extra inputs"],
        ),
        ({}, ["name", "field required"]),
        (job(keyed={"parallelism": "many"}), ["keyed.parallelism", "valid integer"]),
        (job(fields=["key", "value"]), ["fields", "valid dictionary"]),
        (job(source=5), ["source", "valid dictionary"]),
        (job(batching={"linger_ms": "soon"}), ["batching.linger_ms", "valid number"]),
        (job(fields={"key": "decimal", "value": "float"}), ["fields.key", "'int'"]),
        (job(keyed={"parallelism": 0}), ["keyed.parallelism", "greater than or equal to 1"]),
        (job(source={"parallelism": 0}), ["source.parallelism", "greater than or equal to 1"]),
        (job(sink={"parallelism": 257}), ["sink.parallelism", "less than or equal to 256"]),
        (
            job(sink={"parallelism": 3, "partitions": 2}),
            ["sink", "sink parallelism 3 exceeds its partitions (2)"],
        ),
        (job(sink={"partitions": 0}), ["sink.partitions", "greater than or equal to 1"]),
        (job(max_key_groups=0), ["max_key_groups", "greater than or equal to 1"]),
        (job(batching={"credits": 0}), ["batching.credits", "greater than or equal to 1"]),
        (job(name="Bad_Name"), ["name", "should match pattern"]),
        (job(keyed={"name": "Totals"}), ["keyed.name", "should match pattern"]),
        (job(sink={"name": "1sink"}), ["sink.name", "should match pattern"]),
        (job(source={"name": "x" * 41}), ["source.name", "should match pattern"]),
        (
            job(keyed={"name": "source"}),
            ["stage names must be distinct", "['source', 'source', 'sink']"],
        ),
        (
            job(source={"name": "a"}, keyed={"name": "b"}, sink={"name": "a"}),
            ["stage names must be distinct", "['a', 'b', 'a']"],
        ),
        (job(keyed={"key_by": "user"}), ["keyed.key_by", "'user'", "not one of fields"]),
        (job(keyed={"key_by": "value"}), ["keyed.key_by", "'int' or 'str'"]),
        (
            job(keyed={"operator": {"function": "sum"}}),
            ["keyed.operator.field", "required for 'sum'"],
        ),
        (
            job(keyed={"operator": {"function": "mean"}}),
            ["keyed.operator.field", "required for 'mean'"],
        ),
        (
            job(keyed={"operator": {"function": "count", "field": "nope"}}),
            ["keyed.operator.field", "'nope'", "not a field"],
        ),
        (
            job(keyed={"operator": {"function": "median", "field": "value"}}),
            ["keyed.operator", "function", "'count', 'sum', 'min', 'max' or 'mean'"],
        ),
        (
            job(keyed={"operator": {"kind": "join"}}),
            ["keyed.operator", "unknown kind 'join'", "'aggregate', 'process', 'window'"],
        ),
        (
            job(
                fields={"key": "str", "name": "str", "value": "float"},
                source={"config": {"kind": "ingest"}},
                keyed={"operator": {"function": "sum", "field": "name"}},
            ),
            ["keyed.operator.field", "'name'", "must be an int or float field"],
        ),
        (
            job(
                fields={"key": "int", "ok": "bool"},
                source={"config": {"kind": "ingest"}},
                keyed={"operator": {"function": "min", "field": "ok"}},
            ),
            ["keyed.operator.field", "'ok'", "must be an int or float field"],
        ),
        (
            job(source={"transforms": [{"map": "copy:copy", "filter": "builtins:bool"}]}),
            ["source.transforms.0", "exactly one of 'map' or 'filter'"],
        ),
        (
            job(source={"transforms": [{"map": "copy:copy"}, {}]}),
            ["source.transforms.1", "exactly one of 'map' or 'filter'"],
        ),
        (job(fields={}), ["fields", "at least one field"]),
        (
            job(fields={"k": "int", "value": "float"}, keyed={"key_by": "k"}),
            ["fields", "generator makes records", "no transforms"],
        ),
        (
            job(fields={"key": "int"}),
            ["fields", "generator makes records", "no transforms"],
        ),
        (
            job(max_key_groups=4, keyed={"parallelism": 8}),
            ["keyed.parallelism", "must not exceed max_key_groups"],
        ),
        (
            job(source={"config": {"profile": {"kind": "sine", "rate": 5, "amplitude": 6}}}),
            ["source.config", "profile", "period", "field required"],
        ),
        (
            job(
                source={
                    "config": {"profile": {"kind": "sine", "rate": 5, "amplitude": 6, "period": 1}}
                }
            ),
            ["source.config", "profile", "amplitude must not exceed rate"],
        ),
        (
            job(
                source={
                    "config": {"profile": {"kind": "points", "points": [[0, 1], [5, 2], [3, 1]]}}
                }
            ),
            ["source.config", "profile", "points", "strictly increasing"],
        ),
        (
            job(source={"config": {"profile": {"kind": "points", "points": [[1, 1], [1, 2]]}}}),
            ["source.config", "profile", "points", "strictly increasing"],
        ),
        (
            job(source={"config": {"profile": {"kind": "points", "points": [[0, -1]]}}}),
            ["source.config", "profile", "points", ">= 0"],
        ),
        (
            job(source={"config": {"profile": {"kind": "points", "points": []}}}),
            ["source.config", "profile", "points", "at least 1"],
        ),
        (
            job(source={"config": {"profile": {"kind": "ramp", "rate": 1, "to": 2, "over": 0}}}),
            ["source.config", "profile", "over", "greater than 0"],
        ),
        (
            job(source={"config": {"profile": {"kind": "step", "rate": -1, "to": 2, "at": 1}}}),
            ["source.config", "profile", "rate", "greater than or equal to 0"],
        ),
        (
            job(source={"config": {"profile": {"kind": "burst", "rate": 1}}}),
            ["source.config", "profile", "unknown kind 'burst'", "'constant'"],
        ),
        (
            job(source={"config": {"distribution": "normal"}}),
            ["source.config", "distribution", "'uniform', 'zipf' or 'sequential'"],
        ),
        (
            job(source={"config": {"keys": 0}}),
            ["source.config", "keys", "greater than or equal to 1"],
        ),
        (
            job(source={"config": {"kind": "ingest", "port": 70000}}),
            ["source.config", "port", "less than or equal to 65535"],
        ),
        (
            job(sink={"config": {"format": "csv"}}),
            ["sink.config", "format", "'jsonl', 'parquet' or 'none'"],
        ),
    ],
)
def test_invalid_job_names_field_and_reason(data: dict[str, Any], must_contain: list[str]) -> None:
    message = error_of(data)
    assert message.startswith("invalid job definition:")
    for part in must_contain:
        assert part.lower() in message.lower(), f"{part!r} not in {message!r}"


@pytest.mark.parametrize("name", sorted(RESERVED_FIELDS))
def test_reserved_field_names_are_rejected(name: str) -> None:
    message = error_of(job(fields={"key": "int", "value": "float", name: "int"}))
    assert "fields" in message and "reserved for record metadata" in message
    assert repr(name) in message


def test_reserved_names_cover_the_record_metadata() -> None:
    assert {"event_time", "ingest_time", "source", "seq", "_group"} <= RESERVED_FIELDS


BAD_FUNCTIONS = [
    ("nosuchmodule_ks:f", ["cannot import module 'nosuchmodule_ks'"]),
    ("os:nosuchfn", ["module 'os' has no attribute 'nosuchfn'"]),
    ("os.path:join.nosuch", ["has no attribute 'join.nosuch'"]),
    ("no-colon", ["'no-colon' is not of the form 'module:function'"]),
    (":f", ["not of the form 'module:function'"]),
    ("os:", ["not of the form 'module:function'"]),
    ("os:sep", ["'os:sep' is not callable"]),
]


def _function_placements(path: str) -> list[tuple[dict[str, Any], str]]:
    """Every place a job names a function, and the field path its error must mention."""
    return [
        (job(source={"transforms": [{"map": path}]}), "source.transforms.0"),
        (
            job(source={"transforms": [{"filter": "builtins:bool"}, {"filter": path}]}),
            "source.transforms.1",
        ),
        (job(keyed={"operator": {"kind": "process", "function": path}}), "keyed.operator"),
        (job(sink={"config": {"kind": "function", "function": path}}), "sink.config"),
    ]


@pytest.mark.parametrize(("path", "reasons"), BAD_FUNCTIONS)
def test_function_that_does_not_resolve(path: str, reasons: list[str]) -> None:
    with pytest.raises(JobError) as info:
        resolve_function(path)
    for reason in reasons:
        assert reason in str(info.value)
    for data, field_path in _function_placements(path):
        message = error_of(data)
        assert field_path in message, message
        for reason in reasons:
            assert reason in message, message


@pytest.mark.parametrize("module", ["relative", "syntax", "raises"])
def test_function_whose_module_fails_to_import_gives_job_error(
    module: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "ks_test_badsyntax.py").write_text("def f(:\n")
    (tmp_path / "ks_test_raises.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = {
        "relative": ".relative_mod:f",
        "syntax": "ks_test_badsyntax:f",
        "raises": "ks_test_raises:f",
    }[module]
    message = error_of(job(source={"transforms": [{"map": path}]}))
    assert "source.transforms.0" in message


# ------------------------------------------------------------------------------------------
# Invalid files


def test_bad_yaml_syntax(tmp_path: Path) -> None:
    path = write(tmp_path, "name: j\nkeyed: {parallelism: [1, 2}\n")
    with pytest.raises(JobError, match="is not valid YAML") as info:
        load_job(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(JobError, match="cannot read job file") as info:
        load_job(path)
    assert str(path) in str(info.value)
    assert "No such file" in str(info.value)


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(JobError, match="cannot read job file"):
        load_job(tmp_path)


@pytest.mark.parametrize("text", ["- name: j\n- name: k\n", "just a string\n", "42\n", ""])
def test_top_level_not_a_mapping(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(JobError, match="the top level must be a mapping") as info:
        load_job(path)
    assert f"file {path}" in str(info.value)


def test_file_errors_name_the_file_and_field(tmp_path: Path) -> None:
    path = write(tmp_path, "name: j\nkeyed: {parallelism: 0}\n")
    with pytest.raises(JobError) as info:
        load_job(path)
    message = str(info.value)
    assert message.startswith(f"invalid job file {path}:")
    assert "keyed.parallelism" in message


def test_every_error_is_listed(tmp_path: Path) -> None:
    path = write(tmp_path, "name: j\nkeyed: {parallelism: 0}\nsink: {parallelism: -3}\nextra: 1\n")
    with pytest.raises(JobError) as info:
        load_job(path)
    message = str(info.value)
    for part in ("keyed.parallelism", "sink.parallelism", "extra"):
        assert part in message


def test_job_error_is_a_value_error() -> None:
    assert issubclass(JobError, ValueError)


def test_non_utf8_file_gives_job_error(tmp_path: Path) -> None:
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\xff\xfe\x00name: j\n")
    with pytest.raises(JobError):
        load_job(path)


def test_error_path_matches_the_job_file_layout() -> None:
    message = error_of(
        job(
            source={"config": {"profile": {"kind": "sine", "rate": 1, "amplitude": 2, "period": 1}}}
        )
    )
    assert "  source.config.profile: " in message
    message = error_of(job(sink={"config": {"kind": "function", "function": "no-colon"}}))
    assert "  sink.config.function: " in message
