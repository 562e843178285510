"""The import contract of docs/architecture.md: policies import nothing of ours; the runtime never
imports the operator; only the Spark connectors import pyspark (keyshift runs without Spark);
no folder is importable under a bare name that shadows the stdlib."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

FORBIDDEN = {
    "policies": ("keyshift", "pyspark"),
    "runtime": ("keyshift.operator", "keyshift.spark", "pyspark"),
    "operator": ("keyshift.spark", "pyspark"),
}


def imports_of(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            names.append("." * node.level + (node.module or ""))
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layer_imports(package: str) -> None:
    violations = []
    for path in sorted((REPO / package).rglob("*.py")):
        for name in imports_of(path):
            if name.startswith(".") and package == "policies":
                continue  # relative imports stay inside the package
            own = package == "policies" and name.startswith("keyshift.policies")
            if not own and any(name == f or name.startswith(f + ".") for f in FORBIDDEN[package]):
                violations.append(f"{path.relative_to(REPO)} imports {name}")
    assert not violations


def test_stdlib_operator_is_not_shadowed() -> None:
    spec = importlib.util.find_spec("operator")
    assert spec is not None and spec.origin is not None
    assert not spec.origin.startswith(str(REPO / "operator"))
    assert importlib.util.find_spec("keyshift.operator") is not None
