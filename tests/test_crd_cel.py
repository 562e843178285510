"""The CRD's CEL validation rules (`x-kubernetes-validations`), evaluated as the API server
would at `kubectl apply` time, with cel-python: every rule compiles, the example CRs pass every
rule, each bad CR is refused by the rule meant for it (and by the operator's own check, which
must agree, for an API server that does not run the rules), and every rule refuses at least
one of them. No API server runs here, so the evaluator below does what it does for these rules:
walk the generated schema to each rule, bind `self` to every value at that path in the object
(each item of a list, each value of a map) and `oldSelf` to the old object's value on updates,
and evaluate. The API server's CEL cost estimate cannot be computed here; what bounds it (lists
on the way to a rule are bounded) is checked instead."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from celpy.adapter import json_to_cel

from keyshift.operator.crd import VALIDATIONS, crd_manifest
from keyshift.operator.pod_hardening import template_problems
from keyshift.operator.streamingjob import StreamingJob
from tests.conftest import REPO

Path_ = tuple[str, ...]  # property names, "[]" for a list's items, "*" for a map's values
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def schema() -> dict[str, Any]:
    root: dict[str, Any] = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return root


def rules(node: dict[str, Any], path: Path_ = ()) -> Iterator[tuple[Path_, dict[str, Any]]]:
    """Every rule of the schema, with the path of the object it is evaluated on."""
    for rule in node.get(VALIDATIONS, []):
        yield path, rule
    for name, sub in node.get("properties", {}).items():
        yield from rules(sub, (*path, name))
    if isinstance(node.get("additionalProperties"), dict):
        yield from rules(node["additionalProperties"], (*path, "*"))
    if "items" in node:
        yield from rules(node["items"], (*path, "[]"))


def values_at(obj: Any, path: Path_) -> Iterator[tuple[str, Any]]:
    """The values at `path` in `obj` (none where a field is absent), each with where it is."""
    if not path:
        yield "", obj
        return
    step, rest = path[0], path[1:]
    if step == "[]" and isinstance(obj, list):
        for i, item in enumerate(obj):
            for where, value in values_at(item, rest):
                yield f"[{i}]{where}", value
    elif step == "*" and isinstance(obj, dict):
        for key, item in obj.items():
            for where, value in values_at(item, rest):
                yield f".{key}{where}", value
    elif isinstance(obj, dict) and step in obj:
        for where, value in values_at(obj[step], rest):
            yield f".{step}{where}", value


ENV = celpy.Environment()


def evaluate(rule: str, value: Any, old: Any = None) -> bool:
    activation = {"self": json_to_cel(value)}
    if "oldSelf" in rule:
        activation["oldSelf"] = json_to_cel(old)
    result = ENV.program(ENV.compile(rule)).evaluate(activation)
    if isinstance(result, Exception):  # celpy returns evaluation errors as values
        raise AssertionError(f"{rule!r} failed on {value!r}: {result}")
    return bool(result)


def refusals(
    obj: dict[str, Any], old: dict[str, Any] | None = None
) -> list[tuple[str, str, Path_]]:
    """(where, message, the rule's schema path) of every rule the CR breaks; transition rules
    (`oldSelf`) only run on an update of a value that was there before, as the API server runs
    them."""
    found = []
    for path, rule in rules(schema()):
        olds = dict(values_at(old, path)) if old is not None else {}
        for where, value in values_at(obj, path):
            if "oldSelf" in rule["rule"] and where not in olds:
                continue
            if not evaluate(rule["rule"], value, olds.get(where)):
                found.append((where, rule["message"], path))
    return found


def test_every_rule_compiles_and_where_it_sits_is_bounded() -> None:
    found = list(rules(schema()))
    assert len(found) >= 10
    for path, rule in found:
        ENV.compile(rule["rule"])  # raises on a syntax error
        assert rule["message"], rule
        # The API server estimates a rule's cost from how many values it may run on: every
        # list above a rule needs maxItems.
        node = schema()
        for step in path:
            if step == "[]":
                assert "maxItems" in node, (path, rule)
                node = node["items"]
            elif step == "*":
                node = node["additionalProperties"]
            else:
                node = node["properties"][step]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: str(p.relative_to(REPO)))
def test_the_examples_pass_every_rule(path: Path) -> None:
    for obj in yaml.safe_load_all(path.read_text()):  # the CRs among the examples
        if obj and obj.get("kind") == "StreamingJob":
            assert refusals(obj) == []
            assert StreamingJob.model_validate(obj).spec.problems() == []


def base() -> dict[str, Any]:
    obj: dict[str, Any] = yaml.safe_load((REPO / "examples" / "streamingjob.yaml").read_text())
    obj["spec"]["podTemplate"] = {
        "metadata": {"labels": {"team": "a"}},
        "spec": {
            "tolerations": [{"key": "spot", "operator": "Exists"}],
            "securityContext": {"runAsUser": 2000, "runAsNonRoot": True},
            "containers": [
                {"name": "keyshift", "securityContext": {"privileged": False}},
                {"name": "sidecar", "image": "busybox"},
            ],
            "volumes": [{"name": "cache", "emptyDir": {}}],
        },
    }
    return obj


def setting(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A change that sets `path` (dots; a number indexes a list), creating mappings on the way."""

    def change(obj: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = obj
        for name in parents:
            node = node[int(name)] if name.isdigit() else node.setdefault(name, {})
        node[last] = value

    return change


def as_graph(
    parallelism: int, autoscaler: dict[str, Any] | None = None
) -> Callable[[dict[str, Any]], None]:
    """A change that makes the CR's job examples/pages.yaml's graph, its keyed stage
    (per-page) at `parallelism`, under the CR's autoscaler updated with `autoscaler`."""

    def change(obj: dict[str, Any]) -> None:
        job = obj["spec"]["job"]
        graph = yaml.safe_load((REPO / "examples" / "pages.yaml").read_text())["graph"]
        (keyed,) = [stage for stage in graph if stage["kind"] == "keyed"]
        keyed["parallelism"] = parallelism
        for field in ("fields", "source", "keyed", "sink"):
            job.pop(field, None)
        job["graph"] = graph
        job["autoscaler"].update(autoscaler or {})

    return change


POD = "spec.podTemplate.spec"
# name: (change, the rule's message (a part of it), where the API server reports it)
BAD: dict[str, tuple[Callable[[dict[str, Any]], None], str, str]] = {
    "min above max": (
        setting("spec.job.autoscaler.bounds", {"min_parallelism": 5, "max_parallelism": 3}),
        "min_parallelism must not exceed max_parallelism",
        ".spec.job.autoscaler.bounds",
    ),
    "min above the default max": (
        setting("spec.job.autoscaler.bounds", {"min_parallelism": 9}),
        "min_parallelism must not exceed max_parallelism",
        ".spec.job.autoscaler.bounds",
    ),
    "a stage's min above its max": (
        setting(
            "spec.job.autoscaler.stages", {"enrich": {"min_parallelism": 4, "max_parallelism": 2}}
        ),
        "min_parallelism must not exceed max_parallelism",
        ".spec.job.autoscaler.stages.enrich",
    ),
    "parallelism above the bounds": (
        setting("spec.job.keyed.parallelism", 7),
        "keyed.parallelism must be within the autoscaler's bounds",
        ".spec.job",
    ),
    "parallelism below the stage's own bounds": (
        setting("spec.job.autoscaler.stages", {"enrich": {"min_parallelism": 2}}),
        "keyed.parallelism must be within the autoscaler's bounds",
        ".spec.job",
    ),
    "a graph's keyed stage above the bounds": (
        as_graph(7),
        "every keyed stage's parallelism in graph must be within the autoscaler's bounds",
        ".spec.job",
    ),
    "a graph's keyed stage below its own bounds": (
        as_graph(1, {"stages": {"per-page": {"min_parallelism": 2}}}),
        "every keyed stage's parallelism in graph must be within the autoscaler's bounds",
        ".spec.job",
    ),
    "a graph job scaled as the older shape": (
        setting("spec.job.graph", [{"name": "clicks", "kind": "source"}]),
        "scales only a job of the older shape",
        ".spec.job",
    ),
    "privileged": (
        setting(f"{POD}.containers.1.securityContext", {"privileged": True}),
        "may not run privileged containers",
        f".{POD}.containers[1].securityContext",
    ),
    "privileged init container": (
        setting(f"{POD}.initContainers", [{"name": "x", "securityContext": {"privileged": True}}]),
        "may not run privileged containers",
        f".{POD}.initContainers[0].securityContext",
    ),
    "privilege escalation": (
        setting(f"{POD}.containers.0.securityContext", {"allowPrivilegeEscalation": True}),
        "may not allow privilege escalation",
        f".{POD}.containers[0].securityContext",
    ),
    "container as root": (
        setting(f"{POD}.containers.0.securityContext", {"runAsUser": 0}),
        "may not run a container as root",
        f".{POD}.containers[0].securityContext",
    ),
    "container runAsNonRoot false": (
        setting(f"{POD}.containers.1.securityContext", {"runAsNonRoot": False}),
        "may not set runAsNonRoot to false",
        f".{POD}.containers[1].securityContext",
    ),
    "added capabilities": (
        setting(f"{POD}.containers.0.securityContext", {"capabilities": {"add": ["NET_ADMIN"]}}),
        "may not add capabilities",
        f".{POD}.containers[0].securityContext.capabilities",
    ),
    "pod as root": (
        setting(f"{POD}.securityContext.runAsUser", 0),
        "may not run the pod as root",
        f".{POD}.securityContext",
    ),
    "pod runAsNonRoot false": (
        setting(f"{POD}.securityContext.runAsNonRoot", False),
        "may not set runAsNonRoot to false",
        f".{POD}.securityContext",
    ),
    "hostNetwork": (setting(f"{POD}.hostNetwork", True), "hostNetwork", f".{POD}"),
    "hostPID": (setting(f"{POD}.hostPID", True), "hostPID", f".{POD}"),
    "hostIPC": (setting(f"{POD}.hostIPC", True), "hostIPC", f".{POD}"),
    "hostPath volume": (
        setting(f"{POD}.volumes", [{"name": "root", "hostPath": {"path": "/"}}]),
        "may not mount hostPath volumes",
        f".{POD}.volumes[0]",
    ),
    **{
        f"init container: {what}": (
            setting(f"{POD}.initContainers", [{"name": "x", "securityContext": context}]),
            message,
            f".{POD}.initContainers[0].securityContext" + (".capabilities" * ("add" in message)),
        )
        for what, context, message in [
            ("escalation", {"allowPrivilegeEscalation": True}, "privilege escalation"),
            ("root", {"runAsUser": 0}, "as root"),
            ("runAsNonRoot false", {"runAsNonRoot": False}, "runAsNonRoot to false"),
            ("capabilities", {"capabilities": {"add": ["SYS_ADMIN"]}}, "add capabilities"),
        ]
    },
    "service account in the template": (
        setting(f"{POD}.serviceAccountName", "keyshift-operator"),
        "may not name a service account",
        f".{POD}",
    ),
}


def test_the_good_base_passes() -> None:
    assert refusals(base()) == []
    assert StreamingJob.model_validate(base()).spec.problems() == []


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_rule_refuses_the_bad_cr_and_the_operator_agrees(case: str) -> None:
    change, message, where = BAD[case]
    obj = base()
    change(obj)
    found = refusals(obj)
    # (min above max also puts any parallelism outside the bounds: that rule may refuse too)
    mine = [m for w, m, _ in found if w == where and message in m]
    assert len(mine) == 1, found
    # The operator refuses it too, saying the same (or, for the bounds, the models do).
    try:
        problems = StreamingJob.model_validate(obj).spec.problems()
    except ValueError as exc:  # pydantic's ValidationError: the settings' own check
        problems = [str(exc)]
    assert problems, case
    if where.startswith(f".{POD}"):
        pod_problems = template_problems(obj["spec"]["podTemplate"])
        assert [p for p in pod_problems if message in p] == [f"{where.lstrip('.')}: {mine[0]}"]


def test_every_rule_refuses_some_bad_cr() -> None:
    refusing: set[tuple[Path_, str]] = set()
    for change, _, _ in BAD.values():
        obj = base()
        change(obj)
        refusing |= {(path, message) for _, message, path in refusals(obj)}
    assert {(path, rule["message"]) for path, rule in rules(schema())} - refusing == set()


@pytest.mark.parametrize("parallelism", [2, 6])
def test_a_graph_job_within_its_bounds_passes(parallelism: int) -> None:
    """Not judged by the older shape's rule, whose `keyed` a graph job leaves out (its default
    parallelism 1 is below these bounds)."""
    obj = base()
    as_graph(parallelism, {"bounds": {"min_parallelism": 2, "max_parallelism": 6}})(obj)
    assert refusals(obj) == []
    assert StreamingJob.model_validate(obj).spec.problems() == []


def test_rules_hold_on_an_update_that_keeps_a_good_cr_good() -> None:
    old = base()
    new = copy.deepcopy(old)
    new["spec"]["job"]["keyed"]["parallelism"] = 3
    assert refusals(new, old) == []


@pytest.mark.parametrize(
    ("template", "problem"),
    [
        ({"spec": {"securityContext": None}}, "spec.podTemplate.spec.securityContext: Input"),
        ({"spec": {"hostNetwork": "true"}}, "spec.podTemplate.spec.hostNetwork: Input should be"),
        (
            {"spec": {"containers": [{"securityContext": {}}]}},
            "spec.podTemplate.spec.containers[0].name: Field required",
        ),
        (
            {"spec": {"volumes": [{"name": "v", "hostPath": None}]}},
            "spec.podTemplate.spec.volumes[0].hostPath: Input should be",
        ),
    ],
)
def test_the_operator_refuses_what_the_schema_drops_or_refuses(
    template: dict[str, Any], problem: str
) -> None:
    """A null would remove the operator's own setting in the merge, so it is refused (the API
    server drops nulls of fields that are not nullable, and refuses wrong types)."""
    problems = template_problems(template)
    assert len(problems) == 1 and problems[0].startswith(problem), problems
