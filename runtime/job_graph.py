"""The job as a dataflow graph: named stages, the edges between them with their partitioning,
and the record schema along every edge.

`keyshift.runtime.job` validates every job through it: a job file's `graph` (and a job of the
older source/keyed/sink shape, normalised into one) becomes `Node`s, `build_graph` refuses a
bad graph naming the stage and the reason, and `lower_to_chain` maps a graph onto the shape
the runtime executes today (one or more sources, keyed stages with fan-out and unions between
them, one sink; the map/filter stages on an edge chained into its sender's instances), refusing
any other shape with "not supported yet". A join stage (a keyed stage of two inputs,
`join_keys` one key field per input) reads each input with its own schema: its senders wrap
every record into `join_input`'s schema (the key, which side, the record as JSON), so both ways
into it, even from one sender, travel as one stream. The module is pure: no I/O, no imports of
the job's pydantic models (they import it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

FieldType = Literal["int", "float", "str", "bool"]
Schema = Mapping[str, FieldType]
Role = Literal["source", "map", "filter", "flat_map", "keyed", "sink"]
Partitioning = Literal["forward", "key_by", "rebalance", "broadcast"]
PARTITIONINGS: tuple[Partitioning, ...] = ("forward", "key_by", "rebalance", "broadcast")
KEY_TYPES = ("int", "str")

# The record fields a keyed stage emits (record metadata, which every record carries, left
# out): the columns of `keyshift.runtime.state.aggregate_output_schema`,
# `keyshift.runtime.windows.window_output_schema` and
# `keyshift.runtime.keyed_stage.process_output_schema`, which tests/test_job_graph.py compares.
KEY_FIELD = "key"
# What a join stage reads: each side's records, wrapped by their senders into one schema.
JOIN_SIDE, JOIN_RECORD = "side", "record"


def join_input(key_type: FieldType) -> dict[str, FieldType]:
    """The records a join stage reads: the key, the side (0: its first input, 1: its second)
    and the side's record as JSON (`keyshift.runtime.joins`)."""
    return {KEY_FIELD: key_type, JOIN_SIDE: "int", JOIN_RECORD: "str"}


def keyed_output(
    key_type: FieldType, aggregate: str | None, window: bool = False
) -> dict[str, FieldType]:
    """What a keyed stage sends downstream: one update per changed key, or one result per key
    and window when it fires (a user's function's as JSON text, as a process function's)."""
    if aggregate is None and not window:
        return {KEY_FIELD: key_type, "value": "str"}
    value: FieldType = "str" if aggregate is None else "int" if aggregate == "count" else "float"
    bounds: dict[str, FieldType] = {"window_start": "int", "window_end": "int"} if window else {}
    return {KEY_FIELD: key_type, **bounds, "value": value, "n": "int", "version": "int"}


class GraphError(ValueError):
    """A graph that cannot run; the message names the stage and the reason."""


@dataclass(frozen=True)
class Node:
    """One stage as the graph sees it.

    `fields` is a source's record schema, or the output schema of a map or flat_map (none: the
    same as its input). `partitioning` is how records reach this stage on each of its input
    edges; a keyed stage is always partitioned by its `key_by`, other stages by `key_by` only
    when `partitioning` says so. `aggregate` names a keyed stage's aggregate function (none
    for a process function), `aggregate_field` the field it reads; `window`: the aggregate is
    per event-time window (with no aggregate: `function` computes each window's result).
    `join_keys`: a join stage's key field in each of its inputs (in their order).
    """

    name: str
    role: Role
    parallelism: int = 1
    inputs: tuple[str, ...] = ()
    partitioning: Partitioning | None = None
    key_by: str | None = None
    fields: Schema | None = None
    aggregate: str | None = None
    aggregate_field: str | None = None
    window: bool = False
    function: str | None = None
    join_keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class Edge:
    """Records flowing from one stage to another, and how they pick the receiving instance."""

    source: str
    target: str
    partitioning: Partitioning
    key_by: str | None = None


@dataclass(frozen=True)
class Graph:
    """A checked graph: stages in topological order, edges, each stage's output schema (a
    sink's is the schema it receives)."""

    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]
    schemas: Mapping[str, Schema]

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def of_role(self, *roles: Role) -> list[Node]:
        return [n for n in self.nodes if n.role in roles]

    def inputs_of(self, name: str) -> list[Edge]:
        return [e for e in self.edges if e.target == name]

    def outputs_of(self, name: str) -> list[Edge]:
        return [e for e in self.edges if e.source == name]


def _stage(node: Node) -> str:
    return f"stage {node.name!r} ({node.role})"


def _check_names(nodes: Sequence[Node]) -> dict[str, Node]:
    by_name: dict[str, Node] = {}
    for node in nodes:
        if node.name in by_name:
            raise GraphError(f"two stages are named {node.name!r}: stage names must be distinct")
        by_name[node.name] = node
    return by_name


def _check_inputs(by_name: Mapping[str, Node]) -> None:
    for node in by_name.values():
        if node.role == "source":
            if node.inputs:
                raise GraphError(f"{_stage(node)}: a source has no input")
            continue
        if not node.inputs:
            raise GraphError(f"{_stage(node)} has no input: give it `input` or `inputs`")
        if len(set(node.inputs)) != len(node.inputs):
            raise GraphError(f"{_stage(node)} names an input twice: {list(node.inputs)}")
        for name in node.inputs:
            upstream = by_name.get(name)
            if upstream is None:
                raise GraphError(f"{_stage(node)}: input {name!r} is not a stage of the job")
            if upstream.role == "sink":
                raise GraphError(f"{_stage(node)}: input {name!r} is a sink, which has no output")
    consumed = {name for node in by_name.values() for name in node.inputs}
    for node in by_name.values():
        if node.role != "sink" and node.name not in consumed:
            raise GraphError(f"{_stage(node)} has no output: no stage names it as its input")
    if not any(n.role == "source" for n in by_name.values()):
        raise GraphError("the graph has no source stage")
    if not any(n.role == "sink" for n in by_name.values()):
        raise GraphError("the graph has no sink stage")


def _topological(by_name: Mapping[str, Node]) -> list[Node]:
    """The stages, every one after its inputs; GraphError naming a cycle if there is one."""
    order: list[Node] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: placed

    def visit(node: Node, path: list[str]) -> None:
        if state.get(node.name) == 2:
            return
        if state.get(node.name) == 1:
            cycle = [*path[path.index(node.name) :], node.name]
            raise GraphError(f"stages {' -> '.join(cycle)} form a cycle")
        state[node.name] = 1
        for name in node.inputs:
            visit(by_name[name], [*path, node.name])
        state[node.name] = 2
        order.append(node)

    for node in by_name.values():
        visit(node, [])
    return order


def _input_schema(node: Node, schemas: Mapping[str, Schema]) -> Schema:
    first = schemas[node.inputs[0]]
    for name in node.inputs[1:]:
        if dict(schemas[name]) != dict(first):
            raise GraphError(
                f"{_stage(node)}: its inputs have different schemas ({node.inputs[0]!r} has "
                f"{dict(first)}, {name!r} has {dict(schemas[name])}): a union needs one schema"
            )
    return first


def _key_type(node: Node, key: str, schema: Schema) -> FieldType:
    """The type of the field `node` is partitioned by; GraphError unless it can be a key."""
    if key not in schema:
        raise GraphError(
            f"{_stage(node)}: key_by {key!r} is not a field of its input (fields: {list(schema)})"
        )
    kind = schema[key]
    if kind not in KEY_TYPES:
        raise GraphError(f"{_stage(node)}: key_by {key!r} must be an int or str field")
    return kind


def _join_schema(node: Node, schemas: Mapping[str, Schema]) -> Schema:
    """A join's output; GraphError unless it has two inputs, each with its key field, of one
    key type."""
    if len(node.inputs) != 2:
        raise GraphError(
            f"{_stage(node)}: a join reads two inputs (`inputs: [left, right]`), "
            f"got {len(node.inputs)}: {list(node.inputs)}"
        )
    if len(node.join_keys) != len(node.inputs):
        raise GraphError(
            f"{_stage(node)}: key_by names one key field per input, got {list(node.join_keys)}"
        )
    types = []
    for name, key in zip(node.inputs, node.join_keys, strict=True):
        schema = schemas[name]
        if key not in schema:
            raise GraphError(
                f"{_stage(node)}: key_by {key!r} is not a field of its input {name!r} "
                f"(fields: {list(schema)})"
            )
        types.append(_key_type(node, key, schema))
    if types[0] != types[1]:
        left, right = node.inputs
        raise GraphError(
            f"{_stage(node)}: its keys have different types ({left!r}.{node.join_keys[0]} is "
            f"{types[0]}, {right!r}.{node.join_keys[1]} is {types[1]}): a join matches keys of "
            "one type"
        )
    return keyed_output(types[0], None)


def _keyed_schema(node: Node, schema: Schema) -> Schema:
    assert node.key_by is not None  # every keyed Node has its key
    key_type = _key_type(node, node.key_by, schema)
    function, field = node.aggregate, node.aggregate_field
    if function == "count" or function is None:
        if field is not None and field not in schema:
            raise GraphError(
                f"{_stage(node)}: field {field!r} is not a field of its input "
                f"(fields: {list(schema)})"
            )
    elif function is not None:
        if field is None:
            raise GraphError(f"{_stage(node)}: the aggregate {function!r} needs a field")
        if schema.get(field) not in ("int", "float"):
            raise GraphError(f"{_stage(node)}: aggregate field {field!r} must be int or float")
    return keyed_output(key_type, function, node.window)


def _output_schema(node: Node, schemas: Mapping[str, Schema]) -> Schema:
    if node.role == "source":
        if node.fields is None:
            raise GraphError(f"{_stage(node)} needs `fields`: the schema of its records")
        return node.fields
    if node.join_keys:
        return _join_schema(node, schemas)
    schema = _input_schema(node, schemas)
    if node.role == "keyed":
        return _keyed_schema(node, schema)
    if node.role in ("map", "flat_map") and node.fields is not None:
        return node.fields
    return schema


def _edges(node: Node, by_name: Mapping[str, Node], schemas: Mapping[str, Schema]) -> list[Edge]:
    """The edges into `node`; a non-keyed stage left unsaid gets `key_by` of the key after a
    keyed stage, and a sink after any stage whose records have a key (a key keeps its
    partition, as a sink needs), else `forward` where the
    parallelism is equal (chaining) and `rebalance` where it is not."""
    if node.role == "keyed":
        if node.partitioning not in (None, "key_by"):
            raise GraphError(
                f"{_stage(node)}: a keyed stage is partitioned by its key_by, "
                f"not {node.partitioning!r}"
            )
        keys = node.join_keys or (node.key_by,) * len(node.inputs)
        return [Edge(n, node.name, "key_by", k) for n, k in zip(node.inputs, keys, strict=True)]
    schema = _input_schema(node, schemas)
    edges = []
    for name in node.inputs:
        upstream = by_name[name]
        partitioning = node.partitioning
        key = node.key_by
        if partitioning is None:
            keeps_keys = upstream.role == "keyed" or (node.role == "sink" and KEY_FIELD in schema)
            if keeps_keys and key is None:
                partitioning, key = "key_by", KEY_FIELD
            elif key is not None:
                partitioning = "key_by"
            else:
                same = upstream.parallelism == node.parallelism
                partitioning = "forward" if same else "rebalance"
        if partitioning == "key_by":
            if key is None:
                raise GraphError(f"{_stage(node)}: partitioning key_by needs a `key_by` field")
            _key_type(node, key, schema)
        elif key is not None:
            raise GraphError(
                f"{_stage(node)}: key_by {key!r} needs partitioning key_by, not {partitioning!r}"
            )
        if partitioning == "forward" and upstream.parallelism != node.parallelism:
            raise GraphError(
                f"{_stage(node)}: a forward edge from {name!r} needs equal parallelism ({name!r} "
                f"has {upstream.parallelism}, {node.name!r} has {node.parallelism}); use rebalance"
            )
        edges.append(Edge(name, node.name, partitioning, key if partitioning == "key_by" else None))
    return edges


def build_graph(nodes: Sequence[Node]) -> Graph:
    """Check a graph and propagate schemas along its edges; GraphError naming the stage."""
    by_name = _check_names(nodes)
    _check_inputs(by_name)
    order = _topological(by_name)
    schemas: dict[str, Schema] = {}
    edges: list[Edge] = []
    for node in order:
        schemas[node.name] = _output_schema(node, schemas)
        if node.inputs:
            edges += _edges(node, by_name, schemas)
    return Graph(tuple(order), tuple(edges), schemas)


@dataclass(frozen=True)
class Hop:
    """An edge as the runtime runs it: records go from a sending stage (the source or a keyed
    stage) through `transforms` (map/filter, chained into the sender's instances) to `target`
    (a keyed stage, or the sink); into a join, `side` says which of its inputs the edge is."""

    target: str
    transforms: tuple[Node, ...]
    side: int | None = None


@dataclass(frozen=True)
class KeyedLink:
    """One keyed stage as the runtime runs it: it reads records of schema `fields` from the
    instances of its `inputs` (the source, keyed stages: a union when several), and its
    updates take each of its `outputs`. A join's `sides` are its inputs' schemas (`fields`
    is then `join_input`'s)."""

    keyed: Node
    fields: Schema
    inputs: tuple[str, ...]
    outputs: tuple[Hop, ...]
    sides: tuple[Schema, ...] = ()


@dataclass(frozen=True)
class SourceLink:
    """One source as the runtime runs it: its records take each of its `outputs`."""

    source: Node
    outputs: tuple[Hop, ...]


@dataclass(frozen=True)
class Chain:
    """The shapes the runtime executes today: one or more sources (in the graph's order),
    keyed stages (in topological order) with fan-out and unions between them, and one sink
    receiving the updates of the keyed stages in `sink_inputs`, each key in the partition of
    its key group. `fields` is the schema the first keyed stage reads (of a join: the first
    source's records)."""

    sources: tuple[SourceLink, ...]
    keyed: tuple[KeyedLink, ...]
    sink: Node
    sink_inputs: tuple[str, ...]
    fields: Schema


def _not_yet(node: Node, reason: str) -> GraphError:
    return GraphError(f"not supported yet: {_stage(node)}: {reason}")


def _only(graph: Graph, role: Role, what: str) -> Node:
    found = graph.of_role(role)
    if len(found) > 1:
        raise _not_yet(found[1], f"the runtime runs one {what} per job so far")
    return found[0]


def _hop(graph: Graph, edge: Edge, after_keyed: bool) -> tuple[Hop, Edge]:
    """The map/filter stages from `edge` on, chained into its sender's instances, up to the
    keyed stage or sink they reach; and the edge that reaches it. After a source they take
    forward edges; after a keyed stage also its default key_by of the key, under which they
    run in the keyed instances that own each key (a stateless stage's output does not depend
    on where it runs)."""
    transforms: list[Node] = []
    while True:
        after = graph.node(edge.target)
        if after.role in ("keyed", "sink"):
            return Hop(after.name, tuple(transforms)), edge
        chains = edge.partitioning == "forward" or (
            after_keyed and edge.partitioning == "key_by" and edge.key_by == KEY_FIELD
        )
        if not chains:
            where = "a keyed stage's" if after_keyed else "the source"
            raise _not_yet(
                after,
                f"a {edge.partitioning} edge from {edge.source!r} (map and filter stages run "
                f"chained into {where} instances: forward edges only)",
            )
        if len(after.inputs) > 1:
            raise _not_yet(after, "a union into a map or filter stage")
        outs = graph.outputs_of(after.name)
        if len(outs) > 1:
            raise _not_yet(graph.node(outs[1].target), f"fan-out from {after.name!r}")
        transforms.append(after)
        edge = outs[0]


def _check_before_sink(hop: Hop, keyed: Node) -> None:
    """Maps and filters run on a keyed stage's updates on their way to the sink, in its
    instances; the sink's output log keeps the updates' schema, so a map must not reshape
    them, and a flat_map (several updates out of one) is not supported yet."""
    for t in hop.transforms:
        if t.role == "flat_map":
            raise _not_yet(t, f"a flat_map between the keyed stage {keyed.name!r} and the sink")
        if t.fields is not None:
            raise _not_yet(
                t,
                f"a map that reshapes the updates of the keyed stage {keyed.name!r} before the "
                "sink (the sink's output log holds the keyed stage's update schema)",
            )


def lower_to_chain(graph: Graph) -> Chain:
    """The graph as the runtime runs it; GraphError "not supported yet" naming the first stage
    the runtime cannot execute as the graph says."""
    sources = graph.of_role("source")
    if not graph.of_role("keyed"):
        raise _not_yet(graph.of_role("sink")[0], "a job without a keyed stage")
    sink = _only(graph, "sink", "sink")
    hops: dict[str, list[Hop]] = {}
    senders: dict[str, list[str]] = {}
    for sender in [*sources, *graph.of_role("keyed")]:
        for edge in graph.outputs_of(sender.name):
            hop, last = _hop(graph, edge, after_keyed=sender.role == "keyed")
            target = graph.node(hop.target)
            if target.join_keys:
                hop = Hop(hop.target, hop.transforms, target.inputs.index(last.source))
            if target.role == "sink":
                if sender.role != "keyed":
                    raise _not_yet(target, "a sink fed by a stage that is not keyed")
                _check_before_sink(hop, sender)
                if last.partitioning != "key_by" or last.key_by != KEY_FIELD:
                    raise _not_yet(
                        sink,
                        f"a {last.partitioning} edge from {last.source!r} (sinks receive each "
                        f"key's updates in the partition of its key group: key_by {KEY_FIELD!r})",
                    )
            hops.setdefault(sender.name, []).append(hop)
            senders.setdefault(hop.target, []).append(sender.name)
    links = []
    for keyed in graph.of_role("keyed"):
        inputs = senders[keyed.name]
        outputs = tuple(hops[keyed.name])
        if keyed.join_keys:
            # Both ways from one sender go on its one stream to each instance (its router
            # wraps each side's records): its barriers, markers and watermarks count once.
            sides = tuple(graph.schemas[name] for name in keyed.inputs)
            key_type = sides[0][keyed.join_keys[0]]
            fields: Schema = join_input(key_type)
            unique = tuple(dict.fromkeys(inputs))
            links.append(KeyedLink(keyed, fields, unique, outputs, sides))
            continue
        if len(set(inputs)) < len(inputs):
            raise _not_yet(keyed, f"two ways from {inputs[0]!r} into one keyed stage")
        links.append(KeyedLink(keyed, graph.schemas[keyed.inputs[0]], tuple(inputs), outputs))
    sink_inputs = senders[sink.name]
    # The first keyed stage in topological order reads only sources' records.
    fields = graph.schemas[sources[0].name] if links[0].sides else links[0].fields
    links_of_sources = tuple(SourceLink(s, tuple(hops[s.name])) for s in sources)
    return Chain(links_of_sources, tuple(links), sink, tuple(sink_inputs), fields)
