"""A job of several sources as a model (no processes): each source its own stage with its own
kind, schema, parallelism and routes (and a root of the autoscaler's graph), a job-wide source
id per source instance, the Python
API's several `source(...)` and `union`, and the bad graphs refused before anything starts,
naming the stage. The jobs run in tests/test_multi_source.py."""

from __future__ import annotations

from typing import Any

import pytest

from keyshift.operator.scaling_metrics import job_graph
from keyshift.runtime.coordinator import Coordinator
from keyshift.runtime.job import MAX_PARALLELISM, FieldType, IngestSource, JobError, parse_job
from keyshift.runtime.pipeline import Dataflow, source
from keyshift.runtime.protocol import RescaleRequest
from keyshift.runtime.transport import ControlError

ROWS: dict[str, FieldType] = {"user": "int", "amount": "float"}


def job(*sources: dict[str, Any], inputs: list[str] | None = None) -> dict[str, Any]:
    """`sources` unioned into a count per `key` -> out."""
    names = [s["name"] for s in sources]
    return {
        "name": "many",
        "graph": [
            *({"kind": "source", **s} for s in sources),
            {"name": "k", "kind": "keyed", "inputs": inputs or names, "key_by": "key"},
            {"name": "out", "kind": "sink", "input": "k"},
        ],
    }


def generator(name: str, parallelism: int = 1, **rest: Any) -> dict[str, Any]:
    return {"name": name, "parallelism": parallelism, "config": {"kind": "generator"}} | rest


def ingest(name: str, port: int = 0, **rest: Any) -> dict[str, Any]:
    config = {"kind": "ingest", "port": port}
    return {"name": name, "config": config, "fields": {"key": "int", "value": "float"}} | rest


def refused(data: dict[str, Any]) -> str:
    with pytest.raises(JobError) as err:
        parse_job(data)
    return str(err.value)


def test_each_source_is_its_own_stage_with_its_config_schema_and_routes() -> None:
    spec = parse_job(job(generator("clicks", 2), ingest("rows", 7000)))
    steps = {step.stage.name: step for step in spec.source_steps()}
    assert list(steps) == ["clicks", "rows"]
    assert steps["clicks"].stage.parallelism == 2
    assert isinstance(steps["rows"].stage.config, IngestSource)
    assert steps["rows"].fields == {"key": "int", "value": "float"}
    assert [r.target for r in spec.source_routes("rows")] == ["k"]
    assert spec.keyed_step("k").inputs == ("clicks", "rows")
    assert [s.name for s in spec.stages()] == ["clicks", "rows", "k", "out"]
    # The autoscaler's graph starts at every source (DS2 sums their rates into `k`).
    assert job_graph(spec) == [
        ("clicks", ()),
        ("rows", ()),
        ("k", ("clicks", "rows")),
        ("out", ("k",)),
    ]
    # The first source is `source`, and its routes the default.
    assert spec.source.name == "clicks" and spec.source_routes() == spec.source_routes("clicks")


def test_source_ids_are_unique_across_sources_and_the_first_sources_are_its_indexes() -> None:
    spec = parse_job(job(generator("a", 3), generator("b", 2), generator("c")))
    ids = {
        (step.stage.name, i): spec.source_id(step.stage.name, i)
        for step in spec.source_steps()
        for i in range(step.stage.parallelism)
    }
    assert len(set(ids.values())) == len(ids)
    assert [ids[("a", i)] for i in range(3)] == [0, 1, 2]
    assert ids[("b", 1)] == MAX_PARALLELISM + 1
    for where, source_id in ids.items():
        assert spec.source_instance(source_id) == where


BAD: dict[str, tuple[dict[str, Any], str]] = {
    "a union of sources of different schemas": (
        job(generator("clicks"), ingest("rows", fields=ROWS)),
        "stage 'k' (keyed): its inputs have different schemas ('clicks' has",
    ),
    "two ingest sources on one port": (
        job(ingest("a", 7000), ingest("b", 7000)),
        "stage 'b' (source): ingest port 7000 is already the port of source 'a'",
    ),
    "a source without event time beside one with it": (
        job(generator("a", event_time={"max_out_of_orderness_ms": 5}), generator("b")),
        "stage 'b' (source) has no `event_time` while source 'a' has",
    ),
    "two sources of one name": (
        job(generator("a"), generator("a"), inputs=["a"]),
        "two stages are named 'a'",
    ),
    "a source that nobody reads": (
        job(generator("a"), generator("b"), inputs=["a"]),
        "stage 'b' (source) has no output",
    ),
    "an event-time field one source lacks": (
        job(
            generator("a", event_time={"field": "key"}),
            generator("b", event_time={"field": "value"}),
        ),
        "source.event_time.field 'value' is a 'float' field",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_graph_of_sources_is_refused_naming_the_stage(case: str) -> None:
    data, reason = BAD[case]
    message = refused(data)
    assert reason in message, message


def test_allow_non_finite_may_name_a_float_field_of_any_source() -> None:
    rows = ingest("rows", fields={"key": "int", "amount": "float"})
    data = job(generator("clicks"), rows, inputs=["clicks"])
    data["graph"].insert(2, {"name": "k2", "kind": "keyed", "input": "rows", "key_by": "key"})
    data["graph"][-1]["inputs"] = ["k", "k2"]
    del data["graph"][-1]["input"]
    assert parse_job(data | {"allow_non_finite": ["amount"]}).allow_non_finite == ["amount"]
    assert "which are not float fields" in refused(data | {"allow_non_finite": ["key"]})


def test_two_ingest_sources_may_both_pick_a_free_port() -> None:
    spec = parse_job(job(ingest("a"), ingest("b")))
    assert [s.stage.name for s in spec.source_steps()] == ["a", "b"]


def test_the_python_api_unions_several_sources() -> None:
    clicks = source("clicks", {"kind": "generator", "seed": 1}, parallelism=2)
    views = source("views", {"kind": "generator", "seed": 2})
    counts = clicks.union(views).key_by("key").count(name="k")
    spec = Dataflow("many", counts.sink_log(name="out")).build()
    assert spec == parse_job(
        job(
            generator("clicks", 2) | {"config": {"kind": "generator", "seed": 1}},
            generator("views") | {"config": {"kind": "generator", "seed": 2}},
        )
    )
    rows = source("rows", {"kind": "ingest"}, fields=ROWS)
    with pytest.raises(JobError, match="its inputs have different schemas"):
        Dataflow("bad", clicks.union(rows).key_by("key").count(name="k").sink_log()).build()


def test_a_rescale_of_any_source_is_refused_naming_it() -> None:
    spec = parse_job(job(generator("clicks", 2), generator("views")))
    coordinator = Coordinator(spec, 30.0)
    for name in ("clicks", "views"):
        with pytest.raises(ControlError, match=f"stage '{name}' is a source"):
            coordinator.rescale(RescaleRequest(stage=name, parallelism=3))
