"""A Kubernetes API for the operator's tests: kmock's emulator over real HTTP, plus what a real
API server does that kopf relies on, and the operator running in-process.

kmock stores bodies verbatim and merges every patch into the whole object. `Emulator` adds:
resourceVersion (kopf's finalizer patch tests it), uid and creationTimestamp (owner
references), generation (bumped on spec changes), names for `generateName` (kopf's Events),
status-subresource semantics, a Scale object for the scale subresource (mapped to the keyed
stage's parallelism, as our CRD says), and validation: StreamingJobs against the generated CRD
schema, built-in kinds with kubernetes-validate. Server-side apply (a PATCH of
`application/apply-patch+yaml` with a `fieldManager`) works as the API server's does for what
tests/server_side_apply.py emulates: per-manager managedFields, fields an applier leaves out
removed unless another manager owns them, conflicts (409) unless forced, creation through apply;
an ordinary write (kopf's merge patches, a test's) takes ownership of the fields it changes (on
objects that have managedFields; the manager is the `fieldManager` parameter, else the client's
User-Agent product, as the API server names it). It does not garbage-collect owned objects,
honour label selectors, fill in defaults, nor evaluate the CRD's CEL rules
(tests/test_crd_cel.py evaluates them). `OperatorThread` runs kopf in a thread with its own
event loop (kopf cancels every task in its loop when it stops, so it must not share the
emulator's). Used by tests/test_k8s_operator.py.
"""

from __future__ import annotations

import asyncio
import datetime
import itertools
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import jsonpatch
import jsonschema
import kmock
import kopf
import kubernetes_validate
import yaml

from keyshift.operator.crd import crd_manifest
from keyshift.operator.streamingjob import GROUP, PLURAL, VERSION
from tests import server_side_apply as ssa

CR = f"{GROUP}/{VERSION}/{PLURAL}"
CR_API = f"/apis/{GROUP}/{VERSION}"
VALIDATED_KINDS = {
    "ConfigMap",
    "StatefulSet",
    "Service",
    "Deployment",
    "NetworkPolicy",
    "PodDisruptionBudget",
}
APPLY_PATCH = "application/apply-patch+yaml"


def _jsonschema(node: Any) -> Any:
    """The CRD's OpenAPI v3.0 schema as JSON Schema (draft 7): `nullable` becomes a null type,
    boolean exclusive bounds become numeric ones."""
    if isinstance(node, dict):
        out = {k: _jsonschema(v) for k, v in node.items() if not k.startswith("x-kubernetes")}
        for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
            if out.get(exclusive) is True:
                out[exclusive] = out.pop(bound)
        if out.pop("nullable", False) and "type" in out:
            out["type"] = [out["type"], "null"]
            if "enum" in out:
                out["enum"] = [*out["enum"], None]
        return out
    if isinstance(node, list):
        return [_jsonschema(v) for v in node]
    return node


CR_SCHEMA = _jsonschema(crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


class Emulator(kmock.KubernetesEmulator):
    _versions = itertools.count(1)

    def _has_status(self, resource: kmock.resource) -> bool:
        return resource in self.resources and "status" in self.resources[resource].subresources

    def _validate(self, resource: kmock.resource, body: dict[str, Any]) -> None:
        try:
            if resource == kmock.resource(CR):
                jsonschema.Draft7Validator(CR_SCHEMA).validate(body)
            elif body.get("kind") in VALIDATED_KINDS:
                kubernetes_validate.validate(body, "1.30", strict=True)
        except jsonschema.ValidationError as exc:
            raise kmock.KubernetesError(status=422, reason="Invalid", message=exc.message) from exc

    async def _handle(self, request: kmock.Request) -> Any:
        if request.action == kmock.action.UPDATE and _content_type(request) == APPLY_PATCH:
            self._server_side_apply(request)
        if request.resource is not None and request.action == kmock.action.CREATE:
            if isinstance(request.data, dict):
                self._amend_create(request.resource, request.namespace, request.data)
        elif (
            request.resource is not None and request.name and request.action == kmock.action.UPDATE
        ):
            key = (request.resource, request.namespace, request.name)
            if key in self.objects and not self.objects[key].deleted:
                self._amend_patch(request, self.objects[key].raw)
        return await super()._handle(request)

    def _amend_create(
        self, resource: kmock.resource, namespace: str | None, body: dict[str, Any]
    ) -> None:
        meta = body.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if namespace and not meta.get("namespace"):
            meta["namespace"] = namespace
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=_now(), generation=1,
                    resourceVersion=str(next(self._versions)))  # fmt: skip
        if self._has_status(resource):
            body.pop("status", None)
        self._validate(resource, body)

    def _server_side_apply(self, request: kmock.Request) -> None:
        """Turn the apply into the create or the JSON patch that has its effect, for kmock to
        store. In place: kmock finds a request's reactions by its identity, so a copy would
        match none (the request is frozen, hence object.__setattr__)."""
        manager = request.params.get("fieldManager")
        if not manager:
            raise kmock.KubernetesError(
                status=422, reason="Invalid", message="fieldManager is required for apply patch"
            )
        config = request.data if isinstance(request.data, dict) else yaml.safe_load(request.text)
        if (
            request.resource is None
            or not request.name
            or not isinstance(config, dict)
            or config.get("metadata", {}).get("name") != request.name
        ):
            raise kmock.KubernetesError(
                status=400, reason="BadRequest", message="an applied object names itself"
            )
        key = (request.resource, request.namespace, request.name)
        exists = key in self.objects and not self.objects[key].deleted
        live = self.objects[key].raw if exists else None
        try:
            new = ssa.apply(live, config, manager, _flag(request.params.get("force")))
        except ssa.ApplyConflict as exc:
            raise kmock.KubernetesError(status=409, reason="Conflict", message=str(exc)) from exc
        if live is None:
            object.__setattr__(request, "action", kmock.action.CREATE)
            object.__setattr__(request, "data", new)
        else:
            object.__setattr__(request, "data", jsonpatch.make_patch(live, new).patch)

    def _amend_patch(self, request: kmock.Request, old: dict[str, Any]) -> None:
        data, sub, resource = request.data, request.subresource, request.resource
        assert resource is not None  # the caller patches named resources only
        if sub == "scale" and isinstance(data, dict):
            # The scale subresource of our CRD maps .spec.replicas to the keyed parallelism.
            replicas = data.get("spec", {}).get("replicas")
            data.clear()
            data["spec"] = {"job": {"keyed": {"parallelism": replicas}}}
            sub = None
        if self._has_status(resource) and sub in (None, "status"):
            if isinstance(data, dict):
                kept = {k: v for k, v in data.items() if (k == "status") == (sub == "status")}
                data.clear()
                data.update(kept)
            elif isinstance(data, list):
                data[:] = [
                    op for op in data
                    if op.get("op") == "test"
                    or _is_status(op.get("path", "")) == (sub == "status")
                ]  # fmt: skip
        if isinstance(data, dict):
            extra: dict[str, Any] = {"resourceVersion": str(next(self._versions))}
            if "spec" in data and sub != "status":
                extra["generation"] = old.get("metadata", {}).get("generation", 0) + 1
            data.setdefault("metadata", {}).update(extra)
        elif isinstance(data, list):
            touches_spec = any(op.get("path", "").startswith("/spec") for op in data)
            data.append({"op": "add", "path": "/metadata/resourceVersion",
                         "value": str(next(self._versions))})  # fmt: skip
            if touches_spec and sub != "status":
                generation = old.get("metadata", {}).get("generation", 0) + 1
                data.append({"op": "add", "path": "/metadata/generation", "value": generation})
        else:
            return
        new = kmock.Object(old)
        try:
            new.patch(data)
        except jsonpatch.JsonPatchException as exc:
            raise kmock.KubernetesError(status=422, reason="Invalid", message=str(exc)) from exc
        self._validate(resource, new.raw)
        if "managedFields" in old.get("metadata", {}) and _content_type(request) != APPLY_PATCH:
            manager = request.params.get("fieldManager") or _user_agent(request)
            fields = ssa.updated(old, new.raw, manager)
            if isinstance(data, dict):
                data["metadata"]["managedFields"] = fields
            else:
                data.append({"op": "add", "path": "/metadata/managedFields", "value": fields})


def _content_type(request: kmock.Request) -> str:
    headers = {k.lower(): v for k, v in request.headers.items()}
    return str(headers.get("content-type", "")).split(";")[0].strip()


def _flag(value: str | None) -> bool:
    """A boolean query parameter as the API server parses it (Go's strconv.ParseBool)."""
    return value in ("1", "t", "T", "true", "TRUE", "True")


def _user_agent(request: kmock.Request) -> str:
    headers = {k.lower(): v for k, v in request.headers.items()}
    return str(headers.get("user-agent", "unknown")).split("/")[0]


def _is_status(path: str) -> bool:
    return path == "/status" or path.startswith("/status/")


def register_resources(emu: Emulator) -> None:
    emu.resources.load_bundled()
    emu.resources[CR] = kmock.ResourceInfo(
        kind="StreamingJob",
        singular="streamingjob",
        namespaced=True,
        subresources={"status", "scale"},
        verbs={"get", "list", "watch", "create", "patch", "delete"},
    )
    emu["get", kmock.resource(CR), kmock.subresource("scale")] << (
        lambda req: _scale_of(emu, req.namespace, req.name)
    )


def _scale_of(emu: Emulator, namespace: str, name: str) -> dict[str, Any]:
    obj = stored(emu, CR, namespace, name)
    if obj is None:
        raise kmock.KubernetesObjectNotFoundError()
    return {
        "apiVersion": "autoscaling/v1",
        "kind": "Scale",
        "metadata": {k: obj["metadata"][k] for k in ("name", "namespace", "uid")},
        "spec": {"replicas": obj["spec"]["job"].get("keyed", {}).get("parallelism", 1)},
        "status": {"replicas": obj.get("status", {}).get("parallelism", 0)},
    }


def stored(emu: Emulator, resource: str, namespace: str | None, name: str) -> dict[str, Any] | None:
    key = (kmock.resource(resource), namespace, name)
    if key not in emu.objects or emu.objects[key].deleted:
        return None
    raw: dict[str, Any] = emu.objects[key].raw
    return raw


def listed(emu: Emulator, resource: str, namespace: str | None = None) -> list[dict[str, Any]]:
    wanted = kmock.resource(resource)
    return [
        obj.raw
        for (res, ns, _), obj in list(emu.objects.items())
        if res == wanted and (namespace is None or ns == namespace) and not obj.deleted
    ]


async def eventually(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll (without blocking the loop that serves the emulator) until truthy."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.05)


def test_settings() -> kopf.OperatorSettings:
    settings = kopf.OperatorSettings()
    settings.peering.standalone = True
    settings.scanning.disabled = True
    settings.process.ultimate_exiting_timeout = None  # never SIGKILL the test process
    settings.watching.reconnect_backoff = 0.1
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    return settings


class OperatorThread:
    """kopf.operator() in its own thread and event loop; stopped by a flag, then cancelled
    (kopf 1.45 can wait 5 s for a timer re-spawned during shutdown)."""

    def __init__(self, registry: kopf.OperatorRegistry) -> None:
        self.registry = registry
        self.settings = test_settings()
        self.stop_flag = threading.Event()
        self.ready_flag = threading.Event()
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self.thread = threading.Thread(target=self._run, name="kopf", daemon=True)

    async def _main(self) -> None:
        self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
        await kopf.operator(
            registry=self.registry, settings=self.settings, clusterwide=True, standalone=True,
            stop_flag=self.stop_flag, ready_flag=self.ready_flag,
        )  # fmt: skip

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except asyncio.CancelledError:
            pass
        except BaseException as exc:
            self.error = exc

    async def start(self, timeout: float = 15.0) -> None:
        self.thread.start()
        await eventually(self.ready_flag.is_set, timeout, "the operator to start")

    async def stop(self) -> None:
        self.stop_flag.set()
        deadline = time.monotonic() + 0.5
        while self.thread.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.thread.is_alive() and self._loop is not None and self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        await eventually(lambda: not self.thread.is_alive(), 15, "the operator to stop")
        self.settings.execution.executor.shutdown(wait=True)
        if self.error is not None:
            raise self.error
