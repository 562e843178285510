"""Reads a YAML job file into plain data, within limits that keep a hostile or broken file from
exhausting the reader: its size, the nesting depth, the size of the data once aliases are
expanded (a few hundred bytes of aliases can stand for gigabytes: "billion laughs"), and
duplicate keys (which YAML would resolve silently to the last one).

Called by `keyshift.runtime.job.load_job` (the CLI, the coordinator) and by the Spark log
reader, which reads a job file for its schema; every error is a JobFileError naming the file
and, where there is one, the line. `check_data` holds job data from elsewhere (a StreamingJob's
spec, a registration reply, the Python API) to the same depth and size limits; `parse_job`
calls it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

MAX_BYTES = 1 << 20
"""Job files are a few kilobytes; a megabyte leaves room for long `points` profiles."""

MAX_DEPTH = 32
"""Nesting of mappings and sequences, aliases expanded; a job file needs about 6."""

MAX_NODES = 100_000
"""Values in the file once aliases are expanded (a scalar, a list or a mapping counts one)."""

_MERGE_TAG = "tag:yaml.org,2002:merge"


class JobFileError(ValueError):
    """A job file that cannot be read, or exceeds a limit; the message says which."""


class _Loader(yaml.SafeLoader):
    """SafeLoader that stops composing past MAX_DEPTH, before Python's recursion limit, and
    refuses duplicate keys and documents whose expanded size exceeds the limits."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None,
                    None,
                    f"nesting deeper than {MAX_DEPTH} levels",
                    self.peek_event().start_mark,  # type: ignore[no-untyped-call]
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_document(self, node: Node) -> Any:
        _check_expanded(node)
        return super().construct_document(node)

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[tuple[str, str], Node] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, ScalarNode) or key_node.tag == _MERGE_TAG:
                continue  # merged keys may be overridden; that is what `<<` is for
            key = (key_node.tag, key_node.value)
            first = seen.setdefault(key, key_node)
            if first is not key_node:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping",
                    node.start_mark,
                    f"found duplicate key {key_node.value!r} (first on line "
                    f"{first.start_mark.line + 1})",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep)


def _check_expanded(root: Node) -> None:
    """Refuse a document whose aliases expand past MAX_NODES values or MAX_DEPTH levels.
    Iterative, and each distinct node is visited once, so the check itself stays cheap."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    stack: list[tuple[Node, bool]] = [(root, False)]
    on_path: set[int] = set()
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        children = _children(node)
        if children_done:
            on_path.discard(key)
            size[key] = 1 + sum(size[id(c)] for c in children)
            depth[key] = 1 + max((depth[id(c)] for c in children), default=0)
            if size[key] > MAX_NODES:
                raise yaml.composer.ComposerError(
                    None, None, f"more than {MAX_NODES:,} values once aliases are expanded",
                    node.start_mark,
                )  # fmt: skip
            if depth[key] > MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nesting deeper than {MAX_DEPTH} levels once aliases are "
                    "expanded", node.start_mark,
                )  # fmt: skip
            continue
        if key in size:
            continue
        if key in on_path:
            raise yaml.composer.ComposerError(
                None, None, "an alias refers to a node that contains it", node.start_mark
            )
        on_path.add(key)
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in size)


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def check_data(data: Any) -> None:
    """JobFileError if plain data (dicts, lists, scalars) nests deeper than MAX_DEPTH or holds
    more than MAX_NODES values; iterative, and it stops at the first limit it passes."""
    count = 0
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise JobFileError(f"more than {MAX_NODES:,} values")
        if depth > MAX_DEPTH:
            raise JobFileError(f"nesting deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for pair in value.items() for v in pair)
        elif isinstance(value, list | tuple):
            stack.extend((v, depth + 1) for v in value)


def read_job_file(path: str | Path) -> Any:
    """The job file's YAML as plain data; JobFileError if it cannot be read or breaks a limit."""
    p = Path(path)
    try:
        with p.open("rb") as file:
            raw = file.read(MAX_BYTES + 1)
    except OSError as exc:
        raise JobFileError(f"cannot read job file {p}: {exc.strerror}") from None
    if len(raw) > MAX_BYTES:
        raise JobFileError(
            f"job file {p} is larger than {MAX_BYTES:,} bytes; job files are a few kilobytes"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise JobFileError(
            f"job file {p} is not UTF-8 text: {exc.reason} at byte {exc.start}"
        ) from None
    loader = _Loader(text)
    loader.name = str(p)  # error marks name the file
    try:
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        raise JobFileError(f"job file {p} is not valid YAML: {exc}") from None
    finally:
        loader.dispose()
