"""Tests of the job graph (keyshift.runtime.job_graph through keyshift.runtime.job): graph job
files, the older shape normalised into a graph, schemas along edges, every bad graph refused
before anything starts naming the stage and the reason, and the shapes the runtime cannot run
yet refused with "not supported yet"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import yaml

from keyshift.operator.autoscaled_job import AutoscaledJob
from keyshift.runtime.job import Chained, JobError, Route, load_job, parse_job, parse_job_as
from keyshift.runtime.job_graph import Edge, GraphError, Node, build_graph, keyed_output
from keyshift.runtime.keyed_stage import process_output_schema
from keyshift.runtime.records import ARROW_TYPES, METADATA_FIELDS
from keyshift.runtime.state import aggregate_output_schema
from keyshift.runtime.windows import window_output_schema
from tests.conftest import cli, write_job

REPO = Path(__file__).resolve().parents[1]
MAP = "tests.pipeline_fns:enrich"
KEEP = "tests.pipeline_fns:keep"
TRACK = "tests.job_fns:track"


def stage(
    name: str, kind: str, input: str | list[str] | None = None, **rest: Any
) -> dict[str, Any]:
    data: dict[str, Any] = {"name": name, "kind": kind}
    if isinstance(input, str):
        data["input"] = input
    elif input is not None:
        data["inputs"] = input
    if kind == "source":
        data.setdefault("config", {"kind": "generator"})
    return data | rest


def chain(**changes: dict[str, Any]) -> list[dict[str, Any]]:
    """clicks -> keep (filter) -> per-user (count) -> out, each stage changeable by name."""
    stages = {
        "clicks": stage("clicks", "source", parallelism=2),
        "keep": stage("keep", "filter", "clicks", function=KEEP, parallelism=2),
        "per-user": stage(
            "per-user", "keyed", "keep", key_by="key", operator={"function": "count"}
        ),
        "out": stage("out", "sink", "per-user", config={"kind": "log", "path": "out/g"}),
    }
    for name, change in changes.items():
        stages[name] = stages[name] | change
    return list(stages.values())


def graph_job(stages: list[dict[str, Any]], **top: Any) -> dict[str, Any]:
    return {"name": "g", "graph": stages} | top


def refused(data: dict[str, Any]) -> str:
    with pytest.raises(JobError) as err:
        parse_job(data)
    return str(err.value)


# -- what a good graph becomes -------------------------------------------------------------------


def test_a_chain_graph_runs_as_the_same_job_as_the_older_shape() -> None:
    spec = parse_job(graph_job(chain()))
    older = parse_job(
        {
            "name": "g",
            "source": {"name": "clicks", "parallelism": 2, "transforms": [{"filter": KEEP}]},
            "keyed": {"name": "per-user", "key_by": "key", "operator": {"function": "count"}},
            "sink": {"name": "out", "config": {"path": "out/g"}},
        }
    )
    assert (spec.source, spec.keyed, spec.sink, spec.fields) == (
        older.source,
        older.keyed,
        older.sink,
        older.fields,
    )
    assert [s.name for s in spec.stages()] == ["clicks", "per-user", "out"]


def test_edges_and_schemas_propagate_along_the_graph() -> None:
    stages = chain(
        keep={"kind": "map", "function": MAP, "fields": {"user": "int", "amount": "float"}}
    )
    stages[2] |= {"key_by": "user", "operator": {"function": "sum", "field": "amount"}}
    graph = parse_job(graph_job(stages)).dataflow()
    assert graph.edges == (
        Edge("clicks", "keep", "forward"),
        Edge("keep", "per-user", "key_by", "user"),
        Edge("per-user", "out", "key_by", "key"),
    )
    assert graph.schemas["keep"] == {"user": "int", "amount": "float"}
    assert graph.schemas["out"] == {"key": "int", "value": "float", "n": "int", "version": "int"}


def test_a_graph_job_round_trips_as_its_graph(tmp_path: Path) -> None:
    spec = parse_job(graph_job(chain()))
    dumped = spec.model_dump(mode="json", exclude_none=True)
    assert "graph" in dumped and not {"source", "keyed", "sink", "fields"} & set(dumped)
    assert parse_job(dumped) == spec
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump(dumped))
    assert load_job(path) == spec


@pytest.mark.parametrize("example", ["clicks.yaml", "autoscale.yaml"])
def test_every_older_job_file_is_normalised_into_a_graph(example: str) -> None:
    spec = load_job(REPO / "examples" / example)
    graph = spec.dataflow()
    assert [n.role for n in graph.of_role("source", "keyed", "sink")] == [
        "source",
        "keyed",
        "sink",
    ]
    assert graph.edges[-1] == Edge(spec.keyed.name, spec.sink.name, "key_by", "key")
    assert "graph" not in spec.model_dump(mode="json")


def test_the_older_shapes_transforms_become_chained_stages() -> None:
    spec = parse_job(
        {
            "name": "t",
            "fields": {"user": "int", "amount": "float", "big": "bool"},
            "source": {"transforms": [{"filter": KEEP}, {"map": MAP}]},
            "keyed": {"key_by": "user"},
        }
    )
    graph = spec.dataflow()
    assert [(n.name, n.role) for n in graph.nodes] == [
        ("source", "source"),
        ("source-1", "filter"),
        ("source-2", "map"),
        ("keyed", "keyed"),
        ("sink", "sink"),
    ]
    assert graph.schemas["source-1"] == {"key": "int", "value": "float"}
    assert [e.partitioning for e in graph.edges] == ["forward", "forward", "key_by", "key_by"]


@pytest.mark.parametrize(
    ("function", "window"), [("count", False), ("sum", False), (None, False), ("count", True),
                             ("max", True)]
)  # fmt: skip
def test_keyed_output_fields_are_the_columns_the_keyed_stage_emits(
    function: str | None, window: bool
) -> None:
    if function is None:
        arrow = process_output_schema(pa.string())
    elif window:
        arrow = window_output_schema(function, pa.string())
    else:
        arrow = aggregate_output_schema(function, pa.string())
    columns = {f.name: f.type for f in arrow if f.name not in METADATA_FIELDS}
    columns.pop("_group")
    fields = keyed_output("str", function, window)
    assert {name: ARROW_TYPES[kind] for name, kind in fields.items()} == columns


# -- bad graphs: refused before anything starts, naming the stage -------------------------------

BAD_GRAPHS: dict[str, tuple[list[dict[str, Any]], str]] = {
    "cycle": (
        [
            stage("clicks", "source"),
            stage("a", "map", ["clicks", "b"], function=MAP),
            stage("b", "filter", "a", function=KEEP),
            stage("k", "keyed", "b", key_by="key"),
            stage("out", "sink", "k"),
        ],
        "stages a -> b -> a form a cycle",
    ),
    "unknown input": (
        chain(out={"input": "nowhere"}),
        "'out' (sink): input 'nowhere' is not a stage",
    ),
    "key_by on a missing field": (
        chain(**{"per-user": {"key_by": "user"}}),
        "'per-user' (keyed): key_by 'user' is not a field of its input",
    ),
    "a keyed stage whose input lacks its key": (
        [
            stage("clicks", "source"),
            stage("counts", "keyed", "clicks", key_by="key"),
            stage("by-value", "keyed", "counts", key_by="region"),
            stage("out", "sink", "by-value"),
        ],
        "'by-value' (keyed): key_by 'region' is not a field of its input (fields: ['key', "
        "'value', 'n', 'version'])",
    ),
    "key on a float": (
        chain(**{"per-user": {"key_by": "value"}}),
        "'per-user' (keyed): key_by 'value' must be an int or str field",
    ),
    "two stages with one name": (
        [*chain(), stage("keep", "sink", "per-user")],
        "two stages are named 'keep'",
    ),
    "a sink with no input": (
        [*chain(), stage("lost", "sink")],
        "stage 'lost' (sink) has no input",
    ),
    "a stage with no input": (
        chain(keep={"input": None}),
        "stage 'keep' (filter) has no input",
    ),
    "a stage nobody reads": (
        [*chain(), stage("idle", "filter", "clicks", function=KEEP, parallelism=2)],
        "stage 'idle' (filter) has no output",
    ),
    "reading a sink": (
        [*chain(), stage("after", "sink", "out")],
        "'after' (sink): input 'out' is a sink, which has no output",
    ),
    "an input named twice": (
        chain(out={"input": None, "inputs": ["per-user", "per-user"]}),
        "stage 'out' (sink) names an input twice",
    ),
    "no sink": (chain()[:3], "stage 'per-user' (keyed) has no output"),
    "a union of different schemas": (
        [
            stage("clicks", "source"),
            stage("wide", "map", "clicks", function=MAP, fields={"user": "int"}),
            stage("both", "filter", ["clicks", "wide"], function=KEEP),
            stage("k", "keyed", "both", key_by="key"),
            stage("out", "sink", "k"),
        ],
        "'both' (filter): its inputs have different schemas",
    ),
    "forward across parallelism": (
        chain(keep={"parallelism": 3, "partitioning": "forward"}),
        "'keep' (filter): a forward edge from 'clicks' needs equal parallelism",
    ),
    "key_by partitioning without a field": (
        chain(out={"partitioning": "key_by"}),
        "'out' (sink): partitioning key_by needs a `key_by` field",
    ),
    "key_by partitioning on a missing field": (
        chain(out={"key_by": "user"}),
        "'out' (sink): key_by 'user' is not a field of its input",
    ),
    "a key_by field on a rebalance edge": (
        chain(out={"partitioning": "rebalance", "key_by": "key"}),
        "'out' (sink): key_by 'key' needs partitioning key_by, not 'rebalance'",
    ),
    "a keyed stage partitioned otherwise": (
        chain(**{"per-user": {"partitioning": "rebalance"}}),
        "graph.2.partitioning: Extra inputs are not permitted",
    ),
    "an aggregate of a missing field": (
        chain(**{"per-user": {"operator": {"function": "sum", "field": "amount"}}}),
        "'per-user' (keyed): aggregate field 'amount' must be int or float",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_GRAPHS))
def test_a_bad_graph_is_refused_naming_the_stage(case: str) -> None:
    stages, reason = BAD_GRAPHS[case]
    assert reason in refused(graph_job(stages))


BAD_STAGES: dict[str, tuple[dict[str, Any], str]] = {
    "input and inputs": (
        {"out": {"inputs": ["per-user"]}},
        "graph.3: Value error, give `input` or `inputs`, not both",
    ),
    "a filter with fields": (
        {"keep": {"fields": {"key": "int"}}},
        "a filter keeps its input's schema",
    ),
    "an ingest source without fields": (
        {"clicks": {"config": {"kind": "ingest"}}},
        "an ingest source needs `fields`",
    ),
    "a generator with other fields": (
        {"clicks": {"fields": {"user": "str"}}},
        "a generator's records are",
    ),
    "an unknown kind": ({"keep": {"kind": "join"}}, "unknown kind 'join'"),
    "a source with a reserved field": (
        {"clicks": {"config": {"kind": "ingest"}, "fields": {"seq": "int"}}},
        "graph.0.fields: Value error, field names ['seq'] are reserved for record metadata",
    ),
    "a map emitting no fields": (
        {"keep": {"kind": "map", "fields": {}}},
        "graph.1.fields: Value error, a schema needs at least one field",
    ),
    "a bad stage name": ({"keep": {"name": "Keep!"}}, "graph.1.name"),
    "a function that does not import": (
        {"keep": {"function": "tests.nowhere:fn"}},
        "cannot import module 'tests.nowhere'",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_STAGES))
def test_a_bad_stage_is_refused_with_its_place_in_the_graph(case: str) -> None:
    changes, reason = BAD_STAGES[case]
    assert reason in refused(graph_job(chain(**changes)))


@pytest.mark.parametrize("key", ["source", "keyed", "sink", "fields"])
def test_a_graph_and_the_older_shape_together_are_refused(key: str) -> None:
    message = refused(graph_job(chain(), **{key: {}}))
    assert f"leave out ['{key}']" in message


def test_a_cycle_without_a_way_in_is_still_named() -> None:
    with pytest.raises(GraphError, match="form a cycle"):
        build_graph(
            [
                Node("s", "source", fields={"key": "int"}),
                Node("out", "sink", inputs=("s",)),
                Node("a", "map", inputs=("b",)),
                Node("b", "map", inputs=("a",)),
            ]
        )


# -- shapes the runtime does not execute yet ----------------------------------------------------

NOT_YET: dict[str, tuple[list[dict[str, Any]], str]] = {
    "two ways from one stage into a keyed stage": (
        [
            stage("clicks", "source"),
            stage("evens", "filter", "clicks", function=KEEP),
            stage("odds", "filter", "clicks", function=KEEP),
            stage("k", "keyed", ["evens", "odds"], key_by="key"),
            stage("out", "sink", "k"),
        ],
        "stage 'k' (keyed): two ways from 'clicks' into one keyed stage",
    ),
    "fan-out from a map": (
        [
            stage("clicks", "source"),
            stage("keep", "filter", "clicks", function=KEEP),
            stage("a", "keyed", "keep", key_by="key"),
            stage("b", "keyed", "keep", key_by="key"),
            stage("out", "sink", ["a", "b"]),
        ],
        "stage 'b' (keyed): fan-out from 'keep'",
    ),
    "a union into a map": (
        [
            stage("clicks", "source"),
            stage("a", "keyed", "clicks", key_by="key"),
            stage("b", "keyed", "clicks", key_by="key"),
            stage("both", "filter", ["a", "b"], function=KEEP),
            stage("c", "keyed", "both", key_by="key"),
            stage("out", "sink", "c"),
        ],
        "stage 'both' (filter): a union into a map or filter stage",
    ),
    "a rebalance edge between keyed stages": (
        [
            *chain()[:3],
            stage("tidy", "filter", "per-user", function=KEEP, partitioning="rebalance"),
            stage("again", "keyed", "tidy", key_by="key"),
            stage("out", "sink", "again"),
        ],
        "stage 'tidy' (filter): a rebalance edge from 'per-user' (map and filter stages run "
        "chained into a keyed stage's instances",
    ),
    "two sinks": (
        [*chain(), stage("copy", "sink", "per-user")],
        "stage 'copy' (sink): the runtime runs one sink per job so far",
    ),
    "a rebalance edge before the keyed stage": (
        chain(keep={"partitioning": "rebalance"}),
        "stage 'keep' (filter): a rebalance edge from 'clicks'",
    ),
    "a flat_map before the sink": (
        [
            *chain()[:3],
            stage("more", "flat_map", "per-user", function=KEEP),
            stage("out", "sink", "more", key_by="key"),
        ],
        "stage 'more' (flat_map): a flat_map between the keyed stage 'per-user' and the sink",
    ),
    "a map reshaping the updates before the sink": (
        [
            *chain()[:3],
            stage("wide", "map", "per-user", function=MAP, fields={"user": "int"}),
            stage("out", "sink", "wide", key_by="user"),
        ],
        "stage 'wide' (map): a map that reshapes the updates of the keyed stage 'per-user'",
    ),
    "a filter before the sink on a forward edge": (
        [
            *chain()[:3],
            stage("tidy", "filter", "per-user", function=KEEP),
            stage("out", "sink", "tidy", partitioning="forward"),
        ],
        "stage 'out' (sink): a forward edge from 'tidy' (sinks receive each key's updates",
    ),
    "a broadcast to the sink": (
        chain(out={"partitioning": "broadcast"}),
        "stage 'out' (sink): a broadcast edge from 'per-user'",
    ),
    "no keyed stage": (
        [stage("clicks", "source"), stage("out", "sink", "clicks")],
        "stage 'out' (sink): a job without a keyed stage",
    ),
    "a map reshaping ingest rows": (
        [
            stage(
                "rows", "source", config={"kind": "ingest"}, fields={"key": "int", "value": "float"}
            ),
            stage("wide", "map", "rows", function=MAP, fields={"user": "int", "amount": "float"}),
            stage("k", "keyed", "wide", key_by="user"),
            stage("out", "sink", "k"),
        ],
        "stage 'wide' (map): a map that reshapes an ingest source's rows",
    ),
}


@pytest.mark.parametrize("case", sorted(NOT_YET))
def test_a_shape_the_runtime_cannot_run_yet_is_refused_naming_the_stage(case: str) -> None:
    stages, reason = NOT_YET[case]
    message = refused(graph_job(stages))
    assert "not supported yet: " + reason in message, message


def keyed_line() -> list[dict[str, Any]]:
    """clicks -> per-user (track) -> region (map, chained) -> per-region (count) -> out."""
    return [
        stage("clicks", "source", parallelism=2),
        stage(
            "per-user",
            "keyed",
            "clicks",
            key_by="key",
            operator={"kind": "process", "function": TRACK},
        ),
        stage(
            "region",
            "map",
            "per-user",
            function="tests.pipeline_fns:region",
            fields={"key": "int", "value": "str"},
        ),
        stage("per-region", "keyed", "region", key_by="key", parallelism=3),
        stage(
            "top", "keyed", "per-region", key_by="value", operator={"function": "max", "field": "n"}
        ),
        stage("out", "sink", "top"),
    ]


def test_keyed_stages_in_a_line_run_with_the_maps_between_them_chained() -> None:
    spec = parse_job(graph_job(keyed_line()))
    steps = spec.keyed_stages()
    assert [s.stage.name for s in steps] == ["per-user", "per-region", "top"]
    assert [[r.target for r in s.outputs] for s in steps] == [["per-region"], ["top"], ["out"]]
    assert [s.inputs for s in steps] == [("clicks",), ("per-user",), ("per-region",)]
    assert steps[0].outputs[0].transforms == (Chained("map", "tests.pipeline_fns:region"),)
    assert steps[1].fields == {"key": "int", "value": "str"}
    assert steps[2].fields == {"key": "int", "value": "int", "n": "int", "version": "int"}
    assert steps[1].stage.parallelism == 3 and steps[2].stage.key_by == "value"
    assert spec.keyed == steps[0].stage
    assert [s.name for s in spec.stages()] == ["clicks", "per-user", "per-region", "top", "out"]
    again = parse_job(spec.model_dump(mode="json"))
    assert again.keyed_stages() == steps


def test_maps_and_filters_before_the_sink_run_chained_into_the_keyed_stage() -> None:
    spec = parse_job(
        graph_job(
            [
                *chain()[:3],
                stage("tidy", "filter", "per-user", function=KEEP),
                stage("same", "map", "tidy", function=MAP),
                stage("out", "sink", "same"),
            ]
        )
    )
    (step,) = spec.keyed_stages()
    assert step.outputs == (Route("out", (Chained("filter", KEEP), Chained("map", MAP))),)
    assert spec.sink_inputs() == ("per-user",)


def test_an_older_job_is_a_chain_of_one_keyed_stage() -> None:
    spec = load_job(REPO / "examples" / "clicks.yaml")
    (step,) = spec.keyed_stages()
    assert step.stage == spec.keyed and step.inputs == (spec.source.name,)
    assert step.outputs == (Route(spec.sink.name, ()),) and step.fields == spec.fields
    chained = tuple(Chained.of(t) for t in spec.source.transforms)
    assert spec.source_routes() == (Route(spec.keyed.name, chained),)
    assert spec.sink_inputs() == (spec.keyed.name,)


def fan_out_and_in() -> list[dict[str, Any]]:
    """clicks -> per-user, and clicks -> keep (filter) -> per-key; both -> totals (a union)
    and -> out; totals -> out too."""
    track = {"kind": "process", "function": TRACK}
    return [
        stage("clicks", "source"),
        stage("per-user", "keyed", "clicks", key_by="key", operator=track),
        stage("keep", "filter", "clicks", function=KEEP),
        stage("per-key", "keyed", "keep", key_by="key", operator=track),
        stage("totals", "keyed", ["per-user", "per-key"], key_by="key", operator=track),
        stage("out", "sink", ["per-user", "per-key", "totals"]),
    ]


def test_fan_out_and_unions_between_keyed_stages_are_lowered_onto_routes() -> None:
    spec = parse_job(graph_job(fan_out_and_in()))
    assert [r.target for r in spec.source_routes()] == ["per-user", "per-key"]
    assert spec.source_routes()[1].transforms == (Chained("filter", KEEP),)
    totals = spec.keyed_step("totals")
    assert totals.inputs == ("per-user", "per-key")
    assert [r.target for r in spec.keyed_step("per-user").outputs] == ["totals", "out"]
    assert set(spec.sink_inputs()) == {"per-user", "per-key", "totals"}


def test_a_keyed_stage_wider_than_its_key_groups_is_refused_by_name() -> None:
    message = refused(graph_job(keyed_line(), max_key_groups=2))
    assert "keyed.parallelism of stage 'per-region' must not exceed max_key_groups" in message


@pytest.mark.live
def test_keyshift_run_refuses_a_bad_graph_with_exit_2_before_starting(tmp_path: Path) -> None:
    path = write_job(tmp_path, graph_job(chain(out={"input": "nowhere"})))
    with cli(["run", str(path)]) as proc:
        output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, output
    assert "stage 'out' (sink): input 'nowhere' is not a stage of the job" in output


def test_a_graph_of_functions_elsewhere_is_checked_by_form_only() -> None:
    """The Kubernetes operator validates jobs whose functions live in the job's image."""
    stages = [
        stage("clicks", "source"),
        stage("wide", "map", "clicks", function="image.fns:wide"),
        stage("k", "keyed", "wide", key_by="key", operator={"kind": "process", "function": "a:b"}),
        stage("out", "sink", "k", config={"kind": "function", "function": "image.fns:write"}),
    ]
    spec = parse_job(graph_job(stages), resolve_functions=False)
    assert spec.source.transforms[0].map == "image.fns:wide"
    with pytest.raises(JobError, match=r"cannot import module 'image\.fns'"):
        parse_job(graph_job(stages))
    stages[1]["function"] = "no-colon"
    with pytest.raises(JobError, match="not of the form 'module:function'"):
        parse_job(graph_job(stages), resolve_functions=False)


def test_the_autoscaler_scales_process_stages_not_chained_ones() -> None:
    with pytest.raises(JobError) as err:
        parse_job_as(AutoscaledJob, graph_job(chain(), autoscaler={"stages": {"keep": {}}}))
    message = str(err.value)
    assert "autoscaler.stages names ['keep'], which are not stages" in message
    assert "map and filter stages run in their source's processes" in message
