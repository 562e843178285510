"""The import contract of docs/architecture.md: policies import nothing of ours; the runtime never
imports the operator or the policies; only the Spark connectors import pyspark (keyshift runs
without Spark); no package has an import circle (relative imports count, resolved); no folder
is importable under a bare name that shadows the stdlib."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from typing import get_args

import pytest

REPO = Path(__file__).resolve().parent.parent

FORBIDDEN = {
    "policies": ("keyshift", "pyspark"),
    "runtime": ("keyshift.operator", "keyshift.policies", "keyshift.spark", "pyspark"),
    "operator": ("keyshift.spark", "pyspark"),
}


def module_of(path: Path) -> str:
    """The import name of a file of ours: runtime/job.py is keyshift.runtime.job."""
    parts = path.relative_to(REPO).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("keyshift", *parts))


def imports_of(path: Path, module: str | None = None) -> list[str]:
    """Every module `path` (the module named `module`, by default its own name) imports,
    relative imports resolved to absolute names; `from M import N` counts M and, if it is one
    of ours, M.N (N may be a module). An `importlib.import_module` of a name built at run time
    counts as the constant start of that name followed by "*": it may import any module there.
    """
    module = module or module_of(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - max(node.level - 1, 0)]
            if node.level == 0:
                target = node.module or ""
            else:
                target = ".".join([*base, node.module] if node.module else base)
            names.append(target)
            if target.startswith("keyshift."):
                names += [f"{target}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call) and _is_import_module(node.func) and node.args:
            name = node.args[0]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                names.append(name.value)
            elif isinstance(name, ast.JoinedStr):
                start = name.values[0] if name.values else None
                prefix = start.value if isinstance(start, ast.Constant) else ""
                names.append(f"{prefix!s}*")
    return names


def _is_import_module(func: ast.expr) -> bool:
    return (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id == "import_module"
    )


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layer_imports(package: str) -> None:
    violations = []
    for path in sorted((REPO / package).rglob("*.py")):
        for name in imports_of(path):
            own = package == "policies" and name.startswith("keyshift.policies")
            if not own and any(name == f or name.startswith(f + ".") for f in FORBIDDEN[package]):
                violations.append(f"{path.relative_to(REPO)} imports {name}")
    assert not violations


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of `graph` (module -> modules it imports): its strongly connected
    components of more than one module, and modules importing themselves (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph.get(node, ()):
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def import_graph(package: str) -> dict[str, set[str]]:
    """Which of `package`'s modules each of its modules imports (static imports at any depth
    of the file, and dynamic ones: a function's import closes a circle as surely as one at the
    top, and a loop imported by name is imported all the same)."""
    paths = sorted((REPO / package).rglob("*.py"))
    modules = {module_of(p) for p in paths}
    graph = {}
    for path in paths:
        names = imports_of(path)
        wild = [n[:-1] for n in names if n.endswith("*")]
        # A module imported by name is some other module, not the one importing it.
        dynamic = {m for m in modules if any(m.startswith(w) for w in wild if w)}
        graph[module_of(path)] = {m for m in modules if m in names} | (dynamic - {module_of(path)})
    return graph


@pytest.mark.parametrize("package", ["runtime", "policies", "operator", "spark"])
def test_no_import_circles(package: str) -> None:
    assert cycles(import_graph(package)) == []


def test_the_circle_finder_finds_circles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}, "e": {"a"}}
    assert cycles(graph) == [["a", "b", "c"], ["d"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_relative_and_dynamic_imports_are_seen(tmp_path: Path) -> None:
    """A relative import cannot slip past the layer rules or the circle check, nor can a
    module imported by a name built at run time."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import importlib\n"
        "from ..operator import cli\n"
        "from . import job\n"
        "from .protocol import Stop\n"
        "importlib.import_module(f'keyshift.runtime.{name}')\n"
    )
    names = imports_of(probe, "keyshift.runtime.probe")
    assert {"keyshift.operator", "keyshift.operator.cli", "keyshift.runtime.job"} <= set(names)
    assert {"keyshift.runtime.protocol", "keyshift.runtime.*"} <= set(names)
    graph = import_graph("runtime")
    assert "keyshift.runtime.source_stage" in graph["keyshift.runtime.instance"]


def test_the_runtime_and_the_policies_bound_parallelism_alike() -> None:
    """Neither imports the other: each has its own bound, and they must agree."""
    from keyshift.policies.settings import MAX_PARALLELISM as POLICIES_MAX
    from keyshift.runtime.job import MAX_PARALLELISM as RUNTIME_MAX

    assert POLICIES_MAX == RUNTIME_MAX


def test_the_policies_settings_name_the_runtimes_strategies() -> None:
    """The one list of strategies is the protocol's; the settings, which may not import it,
    spell the same ones (the CRD and the CLI derive theirs from the protocol's)."""
    from keyshift.policies.settings import AutoscalerSettings
    from keyshift.runtime.protocol import STRATEGIES

    assert get_args(AutoscalerSettings.model_fields["strategy"].annotation) == STRATEGIES


def test_stdlib_operator_is_not_shadowed() -> None:
    spec = importlib.util.find_spec("operator")
    assert spec is not None and spec.origin is not None
    assert not spec.origin.startswith(str(REPO / "operator"))
    assert importlib.util.find_spec("keyshift.operator") is not None
