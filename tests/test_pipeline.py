"""Tests of the Python job API (keyshift.runtime.pipeline): it builds what a YAML file does."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from keyshift.operator.autoscaled_job import AutoscaledJob
from keyshift.runtime.job import (
    JobError,
    JobSpec,
    StepProfile,
    load_job,
    load_job_as,
    parse_job,
    parse_job_as,
)
from keyshift.runtime.pipeline import Dataflow, Pipeline, function_path, source
from tests import pipeline_fns as fns

REPO = Path(__file__).resolve().parent.parent
FNS = "tests.pipeline_fns"


def from_yaml(tmp_path: Path, text: str) -> JobSpec:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return load_job(path)


def count_pipeline() -> Pipeline:
    return (
        Pipeline("clicks", max_key_groups=1024)
        .generator(keys=5000, distribution="zipf", zipf_exponent=1.2, seed=7, parallelism=2)
        .key_by("key")
        .count(parallelism=3, name="counts")
        .sink_log("out/counts", format="parquet", segment_records=500)
        .batching(max_records=1024, linger_ms=2, credits=4)
    )


COUNT_YAML = """
name: clicks
max_key_groups: 1024
source:
  parallelism: 2
  config: {kind: generator, keys: 5000, distribution: zipf, zipf_exponent: 1.2, seed: 7}
keyed:
  name: counts
  parallelism: 3
  key_by: key
  operator: {function: count}
sink:
  config: {path: out/counts, format: parquet, segment_records: 500}
batching: {max_records: 1024, linger_ms: 2, credits: 4}
"""


def sum_pipeline() -> Pipeline:
    return (
        Pipeline("spend")
        .generator(
            profile={"kind": "ramp", "rate": 100, "to": 1000, "over": 30}, total=50_000, seed=1
        )
        .filter(fns.keep)
        .map(fns.enrich)
        .fields(user="int", amount="float", big="bool")
        .key_by("user")
        .sum("amount", parallelism=2)
        .sink_log("out/spend")
    )


SUM_YAML = f"""
name: spend
fields: {{user: int, amount: float, big: bool}}
source:
  config:
    profile: {{kind: ramp, rate: 100, to: 1000, over: 30}}
    total: 50000
    seed: 1
  transforms:
    - filter: {FNS}:keep
    - map: {FNS}:enrich
keyed:
  parallelism: 2
  key_by: user
  operator: {{kind: aggregate, function: sum, field: amount}}
sink:
  config: {{kind: log, path: out/spend}}
"""


def process_pipeline() -> Pipeline:
    return (
        Pipeline("totals")
        .generator(keys=100, profile=StepProfile(kind="step", rate=10, to=20, at=5))
        .key_by("key")
        .process(fns.running_total, name="totals-by-key")
    )


PROCESS_YAML = f"""
name: totals
source:
  config: {{keys: 100, profile: {{kind: step, rate: 10, to: 20, at: 5}}}}
keyed:
  name: totals-by-key
  operator: {{kind: process, function: "{FNS}:running_total"}}
"""


def function_sink_pipeline() -> Pipeline:
    return (
        Pipeline("collect")
        .key_by("key")
        .mean("value", name="means")
        .sink(f"{FNS}:collect", parallelism=2, name="out")
    )


FUNCTION_SINK_YAML = f"""
name: collect
keyed: {{name: means, operator: {{function: mean, field: value}}}}
sink: {{name: out, parallelism: 2, config: {{kind: function, function: "{FNS}:collect"}}}}
"""

SHAPES: list[tuple[Callable[[], Pipeline], str]] = [
    (count_pipeline, COUNT_YAML),
    (sum_pipeline, SUM_YAML),
    (process_pipeline, PROCESS_YAML),
    (function_sink_pipeline, FUNCTION_SINK_YAML),
]
SHAPE_IDS = ["generator-count", "map-filter-sum", "process", "function-sink"]


@pytest.mark.parametrize(("make", "text"), SHAPES, ids=SHAPE_IDS)
def test_builds_what_the_yaml_file_loads(
    tmp_path: Path, make: Callable[[], Pipeline], text: str
) -> None:
    built = make().build()
    assert built == from_yaml(tmp_path, text)
    assert built == parse_job(make().to_dict())


@pytest.mark.parametrize(("make", "text"), SHAPES, ids=SHAPE_IDS)
def test_to_yaml_round_trips(tmp_path: Path, make: Callable[[], Pipeline], text: str) -> None:
    written = make().to_yaml()
    assert from_yaml(tmp_path, written) == make().build()


def test_to_yaml_leaves_out_what_the_steps_left_out() -> None:
    written = yaml.safe_load(Pipeline("a").key_by("key").count().to_yaml())
    assert written == {
        "name": "a",
        "keyed": {"key_by": "key", "operator": {"kind": "aggregate", "function": "count"}},
    }


def test_functions_are_stored_by_import_path() -> None:
    spec = sum_pipeline().build()
    assert [t.filter or t.map for t in spec.source.transforms] == [
        f"{FNS}:keep",
        f"{FNS}:enrich",
    ]
    assert function_path(fns.running_total) == f"{FNS}:running_total"
    assert function_path("some.module:fn") == "some.module:fn"  # strings as they are


def test_steps_leave_the_pipeline_they_extend_unchanged() -> None:
    base = Pipeline("a").key_by("key")
    counted = base.count()
    summed = base.sum("value")
    assert counted.build().keyed.operator != summed.build().keyed.operator
    with pytest.raises(JobError, match="needs a keyed operator"):
        base.build()


def test_left_out_steps_take_the_job_file_defaults(tmp_path: Path) -> None:
    assert Pipeline("a").key_by("key").count().build() == from_yaml(tmp_path, "name: a\n")


def test_example_script_builds_examples_clicks_yaml() -> None:
    path = REPO / "examples" / "clicks_pipeline.py"
    module_spec = importlib.util.spec_from_file_location("clicks_pipeline", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    expected = load_job(REPO / "examples" / "clicks.yaml")
    assert module.clicks().build() == expected

    run = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, check=True, timeout=60
    )
    assert parse_job(yaml.safe_load(run.stdout)) == expected


# -- functions that other processes could not import ------------------------------------------


def nested_function() -> Callable[[dict[str, Any]], bool]:
    def inner(record: dict[str, Any]) -> bool:
        return True

    return inner


def main_function(record: dict[str, Any]) -> bool:
    return True


main_function.__module__ = "__main__"


@pytest.mark.parametrize(
    ("fn", "why"),
    [
        (lambda record: True, "a lambda cannot be imported"),
        (nested_function(), "defined inside another function"),
        (main_function, "defined in __main__"),
        (fns.NOT_A_FUNCTION, "expected a function or a 'module:function' string, got int"),
        (fns.Enricher().enrich, "method bound to an object"),
    ],
    ids=["lambda", "nested", "main", "not-callable", "bound-method"],
)
def test_unimportable_functions_are_refused(fn: Any, why: str) -> None:
    base = Pipeline("a")
    for step in (
        base.map,
        base.filter,
        base.key_by("key").process,
        base.key_by("key").count().sink,
    ):
        with pytest.raises(JobError, match=why) as info:
            step(fn)
        if callable(fn):
            assert "define it with `def` at module level in a module" in str(info.value)


def test_a_bad_function_string_fails_at_build() -> None:
    pipeline = Pipeline("a").filter("tests.pipeline_fns:missing").key_by("key").count()
    with pytest.raises(JobError, match="has no attribute 'missing'"):
        pipeline.build()
    with pytest.raises(JobError, match="not of the form 'module:function'"):
        Pipeline("a").key_by("key").process("no_colon").build()


# -- steps out of order --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("steps", "why"),
    [
        (lambda p: p.count(), r"count\(\) needs a key: call key_by\(field\)"),
        (lambda p: p.fields(key="int").sum("value"), r"sum\(\) needs a key"),
        (lambda p: p.key_by("key").count().sum("value"), "one keyed operator"),
        (lambda p: p.key_by("key").key_by("key"), "one key"),
        (lambda p: p.key_by("key").count().max("value"), "one keyed operator"),
        (lambda p: p.key_by("key").sink_log("out"), r"sink_log\(\) needs a keyed operator"),
        (lambda p: p.sink(fns.collect), r"sink\(\) needs a keyed operator"),
        (lambda p: p.key_by("key").count().sink_log().sink_log(), "one sink"),
        (lambda p: p.filter(fns.keep).generator(), r"generator\(\) cannot come after filter"),
        (lambda p: p.generator().generator(), "one source"),
        (lambda p: p.key_by("key").count().map(fns.enrich), r"map\(\) cannot come after count"),
        (lambda p: p.fields(key="int").filter(fns.keep), r"filter\(\) cannot come after fields"),
        (lambda p: p.key_by("key").fields(key="int"), r"fields\(\) cannot come after key_by"),
        (lambda p: p.map(fns.enrich).key_by("user"), r"declare it with fields\(.*before key_by"),
        (lambda p: p.batching().batching(), "one batching setting"),
        (lambda p: p.autoscale().autoscale(), "one autoscaler"),
        (lambda p: p.build(), r"no keyed operator: call key_by\(field\) and then one of"),
        (lambda p: p.key_by("key").build(), r"key_by\('key'\) needs a keyed operator after it"),
    ],
)
def test_steps_out_of_order_are_refused(steps: Callable[[Pipeline], Any], why: str) -> None:
    with pytest.raises(JobError, match=why):
        steps(Pipeline("a"))


def test_steps_in_order_show_the_order_when_refused() -> None:
    with pytest.raises(JobError, match=r"generator\(\) -> map\(\)/filter\(\) -> fields\(\)"):
        Pipeline("a").key_by("key").generator()


# -- validation is job.py's -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pipeline", "why"),
    [
        (Pipeline("Bad Name").key_by("key").count(), "name: String should match pattern"),
        (Pipeline("a").key_by("key").count(parallelism=0), "keyed.parallelism"),
        (Pipeline("a").key_by("nope").count(), "keyed.key_by 'nope' is not one of fields"),
        (Pipeline("a").key_by("key").sum("missing"), "keyed.operator.field 'missing'"),
        (Pipeline("a").fields(user="int").key_by("user").count(), "fields must be exactly"),
        (Pipeline("a").fields(event_time="int").key_by("key").count(), "reserved"),
        (Pipeline("a").generator(profile={"kind": "step", "rate": 1}).key_by("key").count(), "to"),
        (Pipeline("a", max_key_groups=2).key_by("key").count(parallelism=4), "max_key_groups"),
    ],
)
def test_invalid_jobs_fail_with_job_py_messages(pipeline: Pipeline, why: str) -> None:
    with pytest.raises(JobError, match=why) as info:
        pipeline.build()
    assert str(info.value).startswith("invalid job pipeline '")
    with pytest.raises(JobError):
        pipeline.to_yaml()


def test_fields_accepts_a_mapping_for_names_that_are_not_identifiers() -> None:
    spec = (
        Pipeline("a")
        .map(fns.enrich)
        .fields({"user": "int"}, amount="float", big="bool")
        .key_by("user")
        .count()
        .build()
    )
    assert spec.fields == {"user": "int", "amount": "float", "big": "bool"}


def test_autoscale_sets_the_autoscaler_settings() -> None:
    """The runtime carries them as given; a host reads them as AutoscalerSettings."""
    pipeline = Pipeline("a").key_by("key").count().autoscale(policy="threshold", dry_run=True)
    assert pipeline.build().autoscaler == {"policy": "threshold", "dry_run": True}
    hosted = parse_job_as(AutoscaledJob, pipeline.to_dict())
    assert hosted.autoscaler is not None
    assert (hosted.autoscaler.policy, hosted.autoscaler.dry_run) == ("threshold", True)
    assert Pipeline("a").key_by("key").count().build().autoscaler is None


# -- graphs: source(...) steps and Dataflow ------------------------------------------------------


def test_graph_steps_build_what_a_graph_job_file_says(tmp_path: Path) -> None:
    clicks = source("clicks", {"kind": "generator", "keys": 500}, parallelism=2)
    counts = (
        clicks.filter(fns.keep, parallelism=2).key_by("key").count(name="counts", parallelism=3)
    )
    built = Dataflow("g", counts.sink_log("out/g", name="out"), max_key_groups=512).build()
    text = f"""\
name: g
max_key_groups: 512
graph:
  - {{name: clicks, kind: source, parallelism: 2, config: {{kind: generator, keys: 500}}}}
  - {{name: filter-2, kind: filter, input: clicks, function: "{FNS}:keep", parallelism: 2}}
  - {{name: counts, kind: keyed, input: filter-2, key_by: key, parallelism: 3}}
  - {{name: out, kind: sink, input: counts, config: {{kind: log, path: out/g}}}}
"""
    assert built.model_dump() == from_yaml(tmp_path, text).model_dump()
    assert built.dataflow().inputs_of("filter-2")[0].partitioning == "forward"


def test_graph_steps_round_trip_through_a_job_file(tmp_path: Path) -> None:
    job = Dataflow(
        "g",
        source("clicks")
        .map(fns.enrich, fields={"user": "int", "amount": "float", "big": "bool"})
        .key_by("user")
        .aggregate("sum", "amount", name="totals")
        .sink(fns.collect, name="out"),
        batching={"max_records": 512},
    )
    assert from_yaml(tmp_path, job.to_yaml()) == job.build()


def test_union_and_partitioning_steps_shape_the_edges() -> None:
    clicks = source("clicks")
    kept = clicks.filter(fns.keep, name="kept")
    both = clicks.union(kept).rebalance().map(fns.enrich, name="mixed", parallelism=2)
    data = Dataflow("g", both.key_by("key").count(name="k").sink_log(name="out")).to_dict()
    mixed = next(s for s in data["graph"] if s["name"] == "mixed")
    assert mixed["inputs"] == ["clicks", "kept"] and mixed["partitioning"] == "rebalance"
    assert [s["name"] for s in data["graph"]] == ["clicks", "kept", "mixed", "k", "out"]
    # Two keyed stages and a union are a graph the runtime does not run yet: refused by name.
    with pytest.raises(JobError, match="not supported yet: stage 'mixed'"):
        Dataflow("g", both.key_by("key").count(name="k").sink_log(name="out")).build()


def test_a_stream_feeds_several_sinks_each_named() -> None:
    counts = source("clicks").key_by("key").count(name="counts")
    job = Dataflow(
        "g",
        counts.sink_log("out/a", name="a", partitions=4, parallelism=2),
        counts.sink(fns.collect, name="b"),
    ).build()
    assert [(s.name, s.output_partitions) for s in job.sinks()] == [("a", 4), ("b", 1)]
    assert [r.target for r in job.keyed_step("counts").outputs] == ["a", "b"]
    with pytest.raises(JobError, match="two different sinks are named 'sink-3'"):
        Dataflow("g", counts.sink_log("out/a"), counts.sink_log("out/b"))
    with pytest.raises(JobError, match="stage 'b' \\(sink\\): its output log 'out/a'"):
        Dataflow(
            "g", counts.sink_log("out/a", name="a"), counts.sink_log("out/a", name="b")
        ).build()


def test_branches_joined_again_must_not_reuse_a_name() -> None:
    clicks = source("clicks")
    one = clicks.filter(fns.keep)
    other = clicks.map(fns.enrich)
    with pytest.raises(JobError, match="two different stages are named 'filter-2'"):
        one.union(other.filter(fns.keep, name="filter-2"))


def test_a_dataflow_needs_a_sink_and_importable_functions() -> None:
    with pytest.raises(JobError, match="at least one stream"):
        Dataflow("g")
    with pytest.raises(JobError, match="lambda"):
        source("clicks").map(lambda r: r)
    with pytest.raises(JobError, match="stage 'counts' \\(keyed\\) has no output"):
        Dataflow("g", source("clicks").key_by("key").count(name="counts")).build()
    with pytest.raises(JobError, match="key_by 'user' is not a field of its input"):
        Dataflow("g", source("clicks").key_by("user").count().sink_log()).build()


@pytest.mark.parametrize(
    ("pipeline", "why"),
    [
        (Pipeline("a", max_key_groups=4).key_by("key").count().autoscale(), "max_key_groups (4)"),
        (Pipeline("a").key_by("key").count().autoscale(interval=0), "autoscaler.interval"),
        (Pipeline("a").key_by("key").count().autoscale(stages={"x": {}}), "names ['x']"),
        (Pipeline("a").key_by("key").count().autoscale(policy="hpa"), "autoscaler.policy"),
    ],
)
def test_bad_autoscaler_settings_fail_where_a_host_loads_the_job(
    tmp_path: Path, pipeline: Pipeline, why: str
) -> None:
    """`keyshift run` loads the job file this way before it starts anything; the message is
    the same as every other job error's."""
    path = tmp_path / "job.yaml"
    path.write_text(pipeline.to_yaml())
    with pytest.raises(JobError, match=re.escape(why)) as info:
        load_job_as(AutoscaledJob, path)
    assert str(info.value).startswith(f"invalid job file {path}:")
