"""The test emulator's server-side apply (tests/server_side_apply.py behind tests/kube_emulator.py),
over HTTP as the operator uses it: the operator's tests rely on it behaving as the API server's
does, so its rules are checked here one by one, bad requests included."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import kmock
import pytest
import pytest_asyncio

from tests.kube_emulator import Emulator, register_resources, stored

pytestmark = [
    pytest.mark.asyncio,
    pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning"),
]

NS = "jobs"
URL = f"/api/v1/namespaces/{NS}/configmaps/settings"
DEPLOYMENT_URL = f"/apis/apps/v1/namespaces/{NS}/deployments/web"
APPLY = {"Content-Type": "application/apply-patch+yaml"}
MERGE = {"Content-Type": "application/merge-patch+json"}


@pytest_asyncio.fixture
async def emu() -> AsyncIterator[Emulator]:
    async with Emulator() as handler, kmock.Server(handler):
        register_resources(handler)
        yield handler


def config_map(**data: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "settings", "namespace": NS},
        "data": data,
    }


async def apply(
    emu: Emulator, body: Any, manager: str | None = "op", force: bool = True, url: str = URL
) -> Any:
    params = {"fieldManager": manager} if manager else {}
    if force:
        params["force"] = "true"
    return await emu.patch(url, params=params, json=body, headers=APPLY)


def live(resource: str = "v1/configmaps", name: str = "settings") -> Any:
    return lambda emu: stored(emu, resource, NS, name) or {}


def managers(obj: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(e["manager"], e["operation"]): e["fieldsV1"] for e in obj["metadata"]["managedFields"]}


async def test_apply_creates_then_removes_what_the_applier_leaves_out(emu: Emulator) -> None:
    reply = await apply(emu, config_map(a="1", b="2"))
    assert reply.status in (200, 201), await reply.text()
    obj = live()(emu)
    assert obj["data"] == {"a": "1", "b": "2"} and obj["metadata"]["uid"]
    assert managers(obj) == {("op", "Apply"): {"f:data": {"f:a": {}, "f:b": {}}}}
    assert (await apply(emu, config_map(a="1"))).status == 200
    assert live()(emu)["data"] == {"a": "1"}


async def test_fields_of_other_writers_are_kept_and_an_update_takes_what_it_changes(
    emu: Emulator,
) -> None:
    await apply(emu, config_map(a="1", b="2"))
    # An ordinary write (kopf's, kubectl edit's) owns what it changed, under its manager.
    reply = await emu.patch(URL, params={"fieldManager": "editor"},
                            json={"data": {"b": "3", "c": "4"}}, headers=MERGE)  # fmt: skip
    assert reply.status == 200, await reply.text()
    assert managers(live()(emu))[("editor", "Update")] == {"f:data": {"f:b": {}, "f:c": {}}}
    # The applier no longer owns b, so leaving it out keeps the editor's value; c was never its.
    await apply(emu, config_map(a="1"))
    assert live()(emu)["data"] == {"a": "1", "b": "3", "c": "4"}


async def test_a_conflict_is_refused_unless_forced(emu: Emulator) -> None:
    await apply(emu, config_map(a="1"))
    reply = await apply(emu, config_map(a="2"), manager="other", force=False)
    assert reply.status == 409
    message = (await reply.json())["message"]
    assert message == 'Apply failed with 1 conflict: conflict with "op": .data.a', message
    assert live()(emu)["data"] == {"a": "1"}  # nothing changed
    # The same value is no conflict: both own it, and the first leaving it out keeps it.
    assert (await apply(emu, config_map(a="1"), manager="other", force=False)).status == 200
    await apply(emu, config_map())
    assert live()(emu)["data"] == {"a": "1"}
    # Forced, the applier takes the field over.
    assert (await apply(emu, config_map(a="5"), manager="third")).status == 200
    assert live()(emu)["data"] == {"a": "5"}
    assert "f:a" not in managers(live()(emu)).get(("other", "Apply"), {}).get("f:data", {})


async def test_bad_applies_are_refused_and_change_nothing(emu: Emulator) -> None:
    await apply(emu, config_map(a="1"))
    before = live()(emu)
    reply = await apply(emu, config_map(a="2"), manager=None)
    assert reply.status == 422 and "fieldManager is required" in (await reply.json())["message"]
    other = {**config_map(a="2"), "metadata": {"name": "elsewhere", "namespace": NS}}
    assert (await apply(emu, other)).status == 400
    assert live()(emu) == before


def deployment(containers: list[dict[str, Any]], **pod: Any) -> dict[str, Any]:
    labels = {"app": "web"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web", "namespace": NS},
        "spec": {
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {"containers": containers, **pod}},
        },
    }


async def test_keyed_lists_merge_by_key_and_lose_only_the_appliers_items(emu: Emulator) -> None:
    main = {"name": "main", "image": "web:1", "args": ["--a", "--b"]}
    sidecar = {"name": "sidecar", "image": "proxy:1"}
    body = deployment([main, sidecar], nodeSelector={"disk": "ssd"})
    assert (await apply(emu, body, url=DEPLOYMENT_URL)).status in (200, 201)
    # Another manager adds a container of its own (a webhook's, say) and an annotation.
    injected = deployment([{"name": "injected", "image": "agent:1"}])
    injected["spec"]["template"]["metadata"]["annotations"] = {"agent": "on"}
    del injected["spec"]["selector"]
    reply = await apply(emu, injected, manager="webhook", url=DEPLOYMENT_URL)
    assert reply.status == 200, await reply.text()
    # The operator drops its sidecar, an argument and the node selector.
    body = deployment([{**main, "args": ["--a"]}])
    assert (await apply(emu, body, url=DEPLOYMENT_URL)).status == 200
    template = live("apps/v1/deployments", "web")(emu)["spec"]["template"]
    assert [c["name"] for c in template["spec"]["containers"]] == ["main", "injected"]
    assert template["spec"]["containers"][0]["args"] == ["--a"]  # an atomic list
    assert "nodeSelector" not in template["spec"]
    assert template["metadata"]["annotations"] == {"agent": "on"}
