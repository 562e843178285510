"""Server-side apply as the Kubernetes API server does it, for the test emulator
(tests/kube_emulator.py), which has no kube-apiserver behind it: field ownership per manager
kept in `metadata.managedFields` (FieldsV1), the merge of an applied configuration into the live
object, and the ownership an ordinary write (merge or JSON patch) takes.

What it emulates: an applier owns the fields of its configuration; a field it applied before
and leaves out now is removed, unless another manager owns it too; a field owned by another
manager with a different value is a conflict (409) unless the apply is forced, which takes it
over; an ordinary write takes the fields it changes from whoever owned them. Maps merge by key,
the lists Kubernetes declares as maps merge item by item by their keys (`LIST_KEYS`: containers,
volumes, env, ports, volume mounts, owner references, ...), every other list is atomic. What it
does not: the schema-driven details (sets of scalars, `x-kubernetes-map-type: atomic`, defaults
filled in before the merge), per-version field sets, and an empty map left behind by a removal
is pruned rather than kept when nobody owns it.
"""

from __future__ import annotations

import copy
import datetime
import json
from collections.abc import Iterable, Mapping
from typing import Any

Segment = tuple[str, str]  # ("f", field name) or ("k", the JSON of a list item's key)
FieldPath = tuple[Segment, ...]

APPLY = "Apply"
UPDATE = "Update"
# The lists of the built-in kinds that merge by key (their x-kubernetes-list-map-keys).
LIST_KEYS: Mapping[str, tuple[str, ...]] = {
    "containers": ("name",),
    "initContainers": ("name",),
    "ephemeralContainers": ("name",),
    "volumes": ("name",),
    "env": ("name",),
    "volumeMounts": ("mountPath",),
    "imagePullSecrets": ("name",),
    "ownerReferences": ("uid",),
    "conditions": ("type",),
}
# Fields the API server owns: never part of a manager's set.
_SERVER_METADATA = frozenset(
    {"name", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp",
     "managedFields", "deletionTimestamp", "selfLink"}
)  # fmt: skip
_ITEM = object()  # the value of a list item's own path: it exists


class ApplyConflict(Exception):
    """Fields another manager owns with a different value; the message names them."""


def _item_keys(field: str, item: Mapping[str, Any]) -> tuple[str, ...] | None:
    if field == "ports":  # a container's ports, or a Service's
        return ("containerPort", "protocol") if "containerPort" in item else ("port", "protocol")
    return LIST_KEYS.get(field)


def _key_of(keys: tuple[str, ...], item: Mapping[str, Any]) -> str:
    # Kubernetes defaults a port's protocol to TCP before it keys the item.
    return json.dumps({k: item.get(k, "TCP" if k == "protocol" else None) for k in keys})


def _keyed(field: str, value: Any) -> bool:
    return (
        isinstance(value, list)
        and all(isinstance(i, Mapping) for i in value)
        and bool(value)
        and _item_keys(field, value[0]) is not None
    )


def leaves(obj: Mapping[str, Any]) -> dict[FieldPath, Any]:
    """Every field of an object a manager can own, with its value (`_ITEM` for a list item's
    own path): leaves, atomic lists and empty maps are values; maps and keyed lists are walked.
    apiVersion, kind, status and the server's metadata are not owned."""
    out: dict[FieldPath, Any] = {}
    for field, value in obj.items():
        if field in ("apiVersion", "kind", "status"):
            continue
        if field == "metadata" and isinstance(value, Mapping):
            kept = {k: v for k, v in value.items() if k not in _SERVER_METADATA}
            if kept:
                _walk(kept, (("f", "metadata"),), out)
        else:
            _walk(value, (("f", field),), out)
    return out


def _walk(value: Any, path: FieldPath, out: dict[FieldPath, Any]) -> None:
    field = path[-1][1] if path[-1][0] == "f" else ""
    if isinstance(value, Mapping) and value:
        for name, sub in value.items():
            _walk(sub, (*path, ("f", str(name))), out)
    elif _keyed(field, value):
        for item in value:
            keys = _item_keys(field, item)
            assert keys is not None
            item_path = (*path, ("k", _key_of(keys, item)))
            out[item_path] = _ITEM
            _walk(item, item_path, out)
    else:
        out[path] = value


# -- managedFields ------------------------------------------------------------------------------


def to_fields_v1(paths: Iterable[FieldPath], items: Iterable[FieldPath]) -> dict[str, Any]:
    """A set of field paths as FieldsV1 (nested `f:`/`k:` keys, `.` marking an owned item)."""
    root: dict[str, Any] = {}
    owned_items = set(items)
    for path in paths:
        node = root
        for kind, name in path:
            node = node.setdefault(f"{kind}:{name}", {})
        if path in owned_items:
            node["."] = {}
    return root


def from_fields_v1(tree: Mapping[str, Any], path: FieldPath = ()) -> set[FieldPath]:
    out: set[FieldPath] = set()
    for key, sub in tree.items():
        if key == ".":
            out.add(path)
            continue
        kind, _, name = key.partition(":")
        inner = (*path, (kind, name))
        if sub:
            out |= from_fields_v1(sub, inner)
        else:
            out.add(inner)
    return out


def owners(obj: Mapping[str, Any]) -> dict[tuple[str, str], set[FieldPath]]:
    """(manager, operation) -> the field paths it owns, from the object's managedFields."""
    return {
        (entry["manager"], entry["operation"]): from_fields_v1(entry.get("fieldsV1", {}))
        for entry in obj.get("metadata", {}).get("managedFields", [])
    }


def managed_fields(
    owned: Mapping[tuple[str, str], set[FieldPath]], api_version: str
) -> list[dict[str, Any]]:
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return [
        {
            "manager": manager,
            "operation": operation,
            "apiVersion": api_version,
            "time": now,
            "fieldsType": "FieldsV1",
            "fieldsV1": to_fields_v1(paths, [p for p in paths if p and p[-1][0] == "k"]),
        }
        for (manager, operation), paths in owned.items()
        if paths
    ]


# -- apply and update ---------------------------------------------------------------------------


def _find(node: Any, segment: Segment, field: str) -> tuple[Any, Any] | None:
    """(container, index or key) of `segment` in `node`, or None when it is not there."""
    kind, name = segment
    if kind == "f":
        return (node, name) if isinstance(node, dict) and name in node else None
    if isinstance(node, list):
        for i, item in enumerate(node):
            keys = _item_keys(field, item) if isinstance(item, Mapping) else None
            if keys is not None and _key_of(keys, item) == name:
                return node, i
    return None


def _is_item_key(path: FieldPath) -> bool:
    """A key field of a list item (it goes only with its item)."""
    return (
        len(path) > 1
        and path[-2][0] == "k"
        and path[-1][0] == "f"
        and path[-1][1] in json.loads(path[-2][1])
    )


def _remove(obj: dict[str, Any], path: FieldPath) -> None:
    """Remove the field at `path`, then any map or list it leaves empty."""
    trail: list[tuple[Any, Any]] = []
    node: Any = obj
    field = ""
    for segment in path:
        found = _find(node, segment, field)
        if found is None:
            return
        trail.append(found)
        container, where = found
        node = container[where]
        field = segment[1] if segment[0] == "f" else field
    for container, where in reversed(trail):
        del container[where]
        if container or container is obj:
            break


def _merge(live: Any, config: Any, field: str = "") -> Any:
    if isinstance(live, dict) and isinstance(config, Mapping):
        out = dict(live)
        for name, value in config.items():
            out[name] = _merge(live.get(name), value, str(name))
        return out
    if isinstance(live, list) and _keyed(field, config):
        merged = list(live)
        for item in config:
            keys = _item_keys(field, item)
            assert keys is not None
            found = _find(merged, ("k", _key_of(keys, item)), field)
            if found is None:
                merged.append(copy.deepcopy(item))
            else:
                merged[found[1]] = _merge(merged[found[1]], item, field)
        return merged
    return copy.deepcopy(config)


def apply(
    live: Mapping[str, Any] | None, config: Mapping[str, Any], manager: str, force: bool
) -> dict[str, Any]:
    """The object after `manager` applies `config` to `live` (None: it is created), with its
    managedFields; raises ApplyConflict for fields others own with other values, unless
    `force`."""
    applied = leaves(config)
    if live is None:
        obj = copy.deepcopy(dict(config))
        obj.setdefault("metadata", {})["managedFields"] = managed_fields(
            {(manager, APPLY): set(applied)}, str(config.get("apiVersion", ""))
        )
        return obj
    owned = owners(live)
    current = leaves(live)
    conflicts = sorted(
        (other, path)
        for (other, operation), paths in owned.items()
        if other != manager
        for path in paths & set(applied)
        if applied[path] is not _ITEM and current.get(path, applied[path]) != applied[path]
    )
    if conflicts and not force:
        names = ", ".join(f'"{m}": .{".".join(s[1] for s in p)}' for m, p in conflicts)
        count = f"{len(conflicts)} conflict{'s' * (len(conflicts) > 1)}"
        raise ApplyConflict(f"Apply failed with {count}: conflict with {names}")
    for other, path in conflicts:
        for (name, _), paths in owned.items():
            if name == other:
                paths.discard(path)
    before = owned.pop((manager, APPLY), set())
    kept_by_others = set().union(*owned.values()) if owned else set()
    obj = copy.deepcopy(dict(live))
    removed: list[FieldPath] = []
    for path in sorted(before - set(applied), key=len):  # a whole item before its fields
        if any(path[: len(r)] == r for r in removed) or _is_item_key(path):
            continue
        if not any(p[: len(path)] == path for p in kept_by_others):
            _remove(obj, path)
            removed.append(path)
    obj = _merge(obj, {k: v for k, v in config.items() if k != "status"})
    owned[(manager, APPLY)] = set(applied)
    obj["metadata"]["managedFields"] = managed_fields(owned, str(obj.get("apiVersion", "")))
    return obj


def updated(old: Mapping[str, Any], new: Mapping[str, Any], manager: str) -> list[dict[str, Any]]:
    """The managedFields after an ordinary write by `manager` turned `old` into `new`: it owns
    the fields it changed, taken from whoever owned them; removed fields are nobody's."""
    before, after = leaves(old), leaves(new)
    changed = {
        path
        for path, value in after.items()
        if path not in before or (value is not _ITEM and before[path] != value)
    }
    gone = set(before) - set(after)
    owned = owners(old)
    for paths in owned.values():
        paths -= changed | gone
    owned[(manager, UPDATE)] = owned.get((manager, UPDATE), set()) | changed
    return managed_fields(owned, str(new.get("apiVersion", "")))
