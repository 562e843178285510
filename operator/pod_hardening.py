"""What a StreamingJob's `podTemplate` may not do: undo the pod hardening of its children.

Every pod the operator makes runs as a non-root user, without privilege escalation, without
capabilities and without any of the host's namespaces or files (`k8s_children`). A podTemplate
is merged into those pods, so without limits anyone allowed to create a StreamingJob could run
privileged pods, as root, on the host's network, reading the node's disk. The models here
declare the parts of a pod template that can undo that, each with its rules, and each rule is
checked twice from the one definition:

- by the API server at `kubectl apply` time: `keyshift.operator.crd` embeds `PodTemplate`'s
  schema at `spec.podTemplate` (open: every other field is kept as written) and each rule's
  `cel` becomes an `x-kubernetes-validations` entry of its object;
- by the operator (`template_problems`, called through `StreamingJobSpec.problems`), for an API
  server that does not evaluate CEL or a CRD installed without the rules: the same rule's
  `refuses` on the parsed template, and the job is refused (Degraded, an Event) before any child
  exists.

Lists the rules reach are bounded (maxItems, maxLength) to keep the rules' CEL cost estimate
within the API server's budget.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError

USER_ID = 10001  # the user every keyshift pod runs as (k8s_children)
MAX_CONTAINERS = 32
MAX_VOLUMES = 128
MAX_CAPABILITIES = 64
MAX_CAPABILITY_NAME = 64


@dataclass(frozen=True)
class Rule:
    """One thing a pod template may not do: `cel` holds (is true) on an object the API server
    accepts, `refuses` is true of an object (as written, once its types are checked) the
    operator refuses; `message` says why."""

    cel: str
    message: str
    refuses: Callable[[Mapping[str, Any]], bool]


def _off(field: str, message: str) -> Rule:
    """A flag that may be left out or false, never true."""
    return Rule(f"!has(self.{field}) || !self.{field}", message, lambda o: o.get(field) is True)


def _not_root(message: str) -> Rule:
    return Rule(
        "!has(self.runAsUser) || self.runAsUser != 0", message, lambda o: o.get("runAsUser") == 0
    )


def _non_root_kept(message: str) -> Rule:
    return Rule(
        "!has(self.runAsNonRoot) || self.runAsNonRoot",
        message,
        lambda o: o.get("runAsNonRoot") is False,
    )


def _rules_schema(schema: dict[str, Any], model: type[BaseModel]) -> None:
    rules: tuple[Rule, ...] = getattr(model, "rules", ())
    if rules:
        schema["x-kubernetes-validations"] = [{"rule": r.cel, "message": r.message} for r in rules]


class _Open(BaseModel):
    """Part of a pod template: the fields declared here are typed and checked, every other
    field is kept as the user wrote it (the API server validates it in the Pod). None of them
    is nullable, since a null would remove the operator's own setting in the merge; defaults
    only document what an absent field means (the rules read the object as written)."""

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra=_rules_schema)
    rules: ClassVar[tuple[Rule, ...]] = ()


class Capabilities(_Open):
    add: list[Annotated[str, Field(max_length=MAX_CAPABILITY_NAME)]] = Field(
        default_factory=list, max_length=MAX_CAPABILITIES
    )
    rules = (
        Rule(
            "!has(self.add) || size(self.add) == 0",
            "podTemplate may not add capabilities (ours drop ALL)",
            lambda o: bool(o.get("add")),
        ),
    )


class ContainerSecurity(_Open):
    privileged: bool = False
    allowPrivilegeEscalation: bool = False
    runAsUser: int = Field(default=USER_ID, ge=0)
    runAsNonRoot: bool = True
    capabilities: Capabilities = Field(default_factory=Capabilities)
    rules = (
        _off("privileged", "podTemplate may not run privileged containers"),
        _off("allowPrivilegeEscalation", "podTemplate may not allow privilege escalation"),
        _not_root("podTemplate may not run a container as root (runAsUser 0)"),
        _non_root_kept("podTemplate may not set runAsNonRoot to false"),
    )


class Container(_Open):
    name: str = Field(max_length=63)
    securityContext: ContainerSecurity = Field(default_factory=ContainerSecurity)


class Volume(_Open):
    name: str = Field(max_length=63)
    hostPath: dict[str, Any] = Field(default_factory=dict)
    rules = (
        Rule(
            "!has(self.hostPath)",
            "podTemplate may not mount hostPath volumes (the node's files)",
            lambda o: "hostPath" in o,
        ),
    )


class PodSecurity(_Open):
    runAsUser: int = Field(default=USER_ID, ge=0)
    runAsNonRoot: bool = True
    rules = (
        _not_root("podTemplate may not run the pod as root (runAsUser 0)"),
        _non_root_kept("podTemplate may not set runAsNonRoot to false"),
    )


class PodSpec(_Open):
    hostNetwork: bool = False
    hostPID: bool = False
    hostIPC: bool = False
    serviceAccountName: str = ""
    serviceAccount: str = ""
    securityContext: PodSecurity = Field(default_factory=PodSecurity)
    containers: list[Container] = Field(default_factory=list, max_length=MAX_CONTAINERS)
    initContainers: list[Container] = Field(default_factory=list, max_length=MAX_CONTAINERS)
    volumes: list[Volume] = Field(default_factory=list, max_length=MAX_VOLUMES)
    rules = (
        _off("hostNetwork", "podTemplate may not use the host's network (hostNetwork)"),
        _off("hostPID", "podTemplate may not use the host's process namespace (hostPID)"),
        _off("hostIPC", "podTemplate may not use the host's IPC namespace (hostIPC)"),
        Rule(
            "!has(self.serviceAccountName) && !has(self.serviceAccount)",
            "podTemplate may not name a service account: set spec.serviceAccountName",
            lambda o: "serviceAccountName" in o or "serviceAccount" in o,
        ),
    )


class PodTemplate(_Open):
    """The part of a PodTemplateSpec a StreamingJob may merge into its pods (labels,
    annotations, tolerations, sidecars, ...), without undoing their hardening."""

    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: PodSpec = Field(default_factory=PodSpec)


def _refused(model: type[_Open], value: Mapping[str, Any], where: str) -> list[str]:
    """The rules of `model` and of the models of its fields that `value` (valid) breaks."""
    found = [f"{where}: {rule.message}" for rule in model.rules if rule.refuses(value)]
    for name, field in model.model_fields.items():
        inner, many = _model_of(field.annotation)
        if inner is None or name not in value:
            continue
        items = value[name] if many else [value[name]]
        for i, item in enumerate(items):
            found += _refused(inner, item, f"{where}.{name}[{i}]" if many else f"{where}.{name}")
    return found


def _model_of(annotation: Any) -> tuple[type[_Open] | None, bool]:
    """The part model a field holds, and whether it holds a list of them."""
    if isinstance(annotation, type) and issubclass(annotation, _Open):
        return annotation, False
    args = get_args(annotation)
    if get_origin(annotation) is list and args and isinstance(args[0], type):
        return (args[0], True) if issubclass(args[0], _Open) else (None, False)
    return None, False


def _path(loc: tuple[int | str, ...]) -> str:
    """A validation error's location as the rules' paths read: `.spec.containers[0].name`."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)


def template_problems(template: Mapping[str, Any], where: str = "spec.podTemplate") -> list[str]:
    """Why the operator refuses this pod template, one message per problem (empty when it
    keeps the hardening): wrongly typed fields, then every rule it breaks, with its path."""
    try:
        PodTemplate.model_validate(dict(template))
    except ValidationError as exc:
        return [f"{where}{_path(e['loc'])}: {e['msg']}" for e in exc.errors()]
    return _refused(PodTemplate, template, where)
