"""The docs stay true to the repository: the README's settings table is the one settings.py
generates; links and paths in the Markdown docs point inside the repository, at what is there;
docs/architecture.md names every module of runtime/, policies/, operator/ and spark/."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

from keyshift.policies.settings import settings_table
from tests.conftest import REPO


def test_readme_lists_every_autoscaler_setting() -> None:
    readme = (REPO / "README.md").read_text()
    assert settings_table() in readme, (
        "README.md's settings table is stale; replace it with the output of "
        "keyshift.policies.settings.settings_table()"
    )


# --- links and paths in the Markdown docs stay inside the repository ----------------------

DOCS = ("README.md", "bench/README.md", "e2e/README.md", "docs/*.md")
# What runs write (all gitignored): a doc may name these before they exist.
GENERATED = ("out/*", "e2e/logs/*", "bench/reports/*.json", ".venv/*")
# Top-level entries that are no part of the repository's tree, even where they exist.
UNTRACKED = {".git", ".venv", ".mypy_cache", ".ruff_cache", ".pytest_cache", ".hypothesis"}
# A file of the project, not of the system (/usr/bin/java) or a URL path (/metrics).
PROJECT_FILE = re.compile(r"\.(md|py|ya?ml|json|toml|txt|cfg|ini|sh|png)$")

FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)


def doc_files() -> list[Path]:
    return sorted({p for pattern in DOCS for p in REPO.glob(pattern)})


def prose(text: str) -> str:
    """The text outside fenced code blocks."""
    return FENCE.sub("", text)


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors for a Markdown file's headings."""
    anchors: set[str] = set()
    for line in prose(path.read_text()).splitlines():
        if match := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line):
            slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
            anchor, n = slug, 0
            while anchor in anchors:
                n += 1
                anchor = f"{slug}-{n}"
            anchors.add(anchor)
    return anchors


def inside(path: Path) -> bool:
    return path.resolve().is_relative_to(REPO)


def exists(path: Path) -> bool:
    if any(c in path.name for c in "*?["):
        return any(path.parent.glob(path.name))
    return path.exists()


def generated(path: Path) -> bool:
    relative = path.resolve().relative_to(REPO).as_posix()
    return any(fnmatch.fnmatch(name, p) for name in (relative, relative + "/") for p in GENERATED)


def link_problems(doc: Path) -> list[str]:
    text = CODE_SPAN.sub("", prose(doc.read_text()))
    targets = INLINE_LINK.findall(text) + REFERENCE_LINK.findall(text)
    problems = []
    for target in targets:
        if re.match(r"(https?|mailto):", target):
            continue
        where, _, fragment = target.partition("#")
        if re.match(r"[a-z][a-z0-9+.-]*:", where) or where.startswith("/"):
            problems.append(f"{target}: only http(s) links may leave the repository")
            continue
        path = doc.parent / where if where else doc
        if not inside(path):
            problems.append(f"{target}: outside the repository")
        elif not path.exists():
            problems.append(f"{target}: no such file")
        elif fragment and path.suffix == ".md" and fragment not in heading_anchors(path):
            problems.append(f"{target}: {path.relative_to(REPO)} has no heading #{fragment}")
    return problems


def path_problems(doc: Path) -> list[str]:
    """Backtick-quoted paths that look like the repository's must be there."""
    top = {p.name for p in REPO.iterdir()} - UNTRACKED
    top |= {pattern.split("/")[0] for pattern in GENERATED}
    local = {p.name for p in doc.parent.iterdir()}
    problems = []
    for _, span in CODE_SPAN.findall(prose(doc.read_text())):
        span = span.strip()
        if not span or re.search(r"\s|://|^[~$<]", span):
            continue
        if span.startswith("/"):
            if PROJECT_FILE.search(span.rstrip("/")):
                problems.append(f"`{span}`: an absolute path; name the file in the repository")
            continue
        if ".." in span.split("/"):
            problems.append(f"`{span}`: `..` leads out of the repository")
            continue
        first = span.removeprefix("./").split("/")[0]
        if "/" not in span.removeprefix("./") or first not in top | local:
            continue  # a module, a flag, a URL path: not a path in the repository
        candidates = [REPO / span, doc.parent / span]
        if not any(inside(c) and (exists(c) or generated(c)) for c in candidates):
            problems.append(f"`{span}`: no such file or directory in the repository")
    return problems


def test_doc_files_are_found() -> None:
    names = {p.relative_to(REPO).as_posix() for p in doc_files()}
    assert {"README.md", "bench/README.md", "e2e/README.md", "docs/architecture.md"} <= names


@pytest.mark.parametrize("doc", [p.relative_to(REPO).as_posix() for p in doc_files()])
def test_links_and_paths_stay_inside_the_repository(doc: str) -> None:
    path = REPO / doc
    problems = link_problems(path) + path_problems(path)
    assert not problems, f"{doc}:\n  " + "\n  ".join(problems)


# --- the architecture map names every module ----------------------------------------------

LAYERS = ("runtime", "policies", "operator", "spark")


def test_architecture_names_every_module() -> None:
    path = REPO / "docs" / "architecture.md"
    assert path.exists(), "docs/architecture.md, the map of the repository, is missing"
    architecture = path.read_text()
    modules = [
        path.relative_to(REPO).as_posix()
        for layer in LAYERS
        for path in sorted((REPO / layer).rglob("*.py"))
        if path.name != "__init__.py" and "__pycache__" not in path.parts
    ]
    assert len(modules) > 40
    missing = [m for m in modules if f"`{m}`" not in architecture]
    assert not missing, (
        f"docs/architecture.md does not name {missing}; add each to its table of modules"
    )
