"""The images build, checked without Docker: the build context .dockerignore lets in, what each
COPY of each stage puts where (tests/docker_build.py), the wheel built from exactly those files
as the Dockerfile builds it (offline, without build isolation: the build dependencies are this
virtualenv's), installed into a directory that stands for the image's site-packages, and every
keyshift package imported from there, for the keyshift image and the Spark image built on it.

What still needs Docker (the base images, apt and pip downloads, the RUN smoke checks in the
images themselves) runs in the kind workflow (.github/workflows/e2e.yaml) and the release
workflow.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.docker_build import (
    BuildError,
    Built,
    IgnorePattern,
    Instruction,
    assemble,
    context_files,
    copy_context,
    ignored,
    parse_dockerfile,
    parse_dockerignore,
)

DOCKERFILE = REPO / "Dockerfile"
SPARK_DOCKERFILE = REPO / "docker" / "spark.Dockerfile"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PACKAGE_DIRS: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]
# The extra whose package needs it: keyshift.spark imports pyspark, which only the Spark image
# installs (`pip install 'keyshift[spark]'` elsewhere).
SPARK_EXTRA_PACKAGE = "keyshift.spark"
KEYSHIFT_IMAGE_ARG = "KEYSHIFT_IMAGE"


def patterns() -> list[IgnorePattern]:
    return parse_dockerignore((REPO / ".dockerignore").read_text())


# -- the matcher: Docker's semantics ------------------------------------------------------------


@pytest.mark.parametrize(
    ("lines", "path", "out"),
    [
        (["*"], "a", True),
        (["*"], "a/b/c", True),  # a directory's pattern takes everything below it
        (["*", "!a"], "a/b/c", False),
        (["*", "!a", "a/b"], "a/b/c", True),  # the last match wins
        (["*", "!a", "a/b", "!a/b/c"], "a/b/c", False),
        (["*.py"], "a.py", True),
        (["*.py"], "d/a.py", False),  # `*` stops at `/`
        (["**/*.py"], "d/e/a.py", True),
        (["**/*.py"], "a.py", True),  # `**` includes no directory at all
        (["d/**"], "d/x", True),
        (["d/**"], "d", False),
        (["d/**/x"], "d/x", True),
        (["a?c"], "abc", True),
        (["a?c"], "a/c", False),
        (["[a-c]x"], "bx", True),
        (["[^a-c]x"], "bx", False),
        (["[^a-c]x"], "dx", True),
        (["/a/./b/"], "a/b", True),  # cleaned like a path
        ([" !  a ", "*"], "a", True),
        (["*", " !  a "], "a", False),
        (["#a", "b"], "#a", False),  # a comment, not a pattern
        ([" #a"], "#a", True),  # not at the start of the line: a pattern
        (["\\*"], "*", True),
        (["\\*"], "a", False),
        (["a.b"], "axb", False),  # `.` is literal
        (["**/__pycache__"], "r/__pycache__/m.pyc", True),
    ],
)
def test_dockerignore_matches_as_docker_does(lines: list[str], path: str, out: bool) -> None:
    assert ignored(path, parse_dockerignore("\n".join(lines))) is out


def test_an_unterminated_class_is_an_error() -> None:
    with pytest.raises(BuildError, match="unterminated class"):
        parse_dockerignore("[ab")


def test_the_walk_goes_into_ignored_directories_an_exception_reaches(tmp_path: Path) -> None:
    for rel in ("keep/x/y.txt", "keep/x/z.log", "drop/y.txt", "top.txt", "drop/deep/a.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    found = context_files(tmp_path, parse_dockerignore("*\n!keep/x\nkeep/**/*.log\n!**/a.txt"))
    assert found == ["drop/deep/a.txt", "keep/x/y.txt"]


# -- the Dockerfile parser ----------------------------------------------------------------------


def test_dockerfile_stages_args_and_copies_are_parsed() -> None:
    text = "\n".join(
        [
            "# syntax=docker/dockerfile:1.7",
            "ARG BASE=python:3.11",
            "FROM ${BASE} AS build",
            "WORKDIR /b",
            "COPY --chown=1:1 a b \\",
            "  # a comment inside the instruction",
            "  ./",
            "FROM --platform=$BUILDPLATFORM build",
            'COPY --from=build ["/b/a", "/x y"]',
        ]
    )
    first, second = parse_dockerfile(text, {"BASE": "debian"})
    assert (first.name, first.base, second.name, second.base) == ("build", "debian", None, "build")
    assert first.instructions[1] == Instruction("COPY", "--chown=1:1 a b ./")
    assert first.instructions[1].flags_and_values() == ({"chown": "1:1"}, ["a", "b", "./"])
    assert second.instructions[0].flags_and_values() == ({"from": "build"}, ["/b/a", "/x y"])
    assert parse_dockerfile(text)[0].base == "python:3.11"


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("RUN true", "RUN before the first FROM"),
        ("ARG A=1", "no FROM"),
        ("FROM a\nRUN true \\", "ends inside a continued instruction"),
    ],
)
def test_a_broken_dockerfile_is_refused(text: str, error: str) -> None:
    with pytest.raises(BuildError, match=error):
        parse_dockerfile(text)


def test_copies_land_as_docker_puts_them(tmp_path: Path) -> None:
    context = tmp_path / "context"
    for rel in ("pkg/m.py", "pkg/sub/n.py", "a.txt", "b.txt"):
        (context / rel).parent.mkdir(parents=True, exist_ok=True)
        (context / rel).write_text(rel)
    text = "\n".join(
        [
            "FROM scratch AS one",
            "WORKDIR /w",
            "COPY pkg ./pkg",  # a directory: its contents, at the destination
            "COPY pkg /flat/",
            "COPY a.txt b.txt sub/",  # several sources: a directory below WORKDIR
            "COPY a.txt renamed",
            "WORKDIR inner",
            "FROM scratch",
            "COPY --from=one /w/pkg /app/pkg",
            'COPY ["*.txt", "/t/"]',
        ]
    )
    one, two = assemble(parse_dockerfile(text), context, tmp_path / "built")
    assert one.workdir == "/w/inner"
    for rel in ("w/pkg/sub/n.py", "flat/m.py", "flat/sub/n.py", "w/sub/a.txt", "w/sub/b.txt"):
        assert (one.root / rel).is_file(), rel
    assert (one.root / "w/renamed").read_text() == "a.txt"
    assert (two.root / "app/pkg/m.py").is_file() and (two.root / "t/b.txt").is_file()
    with pytest.raises(BuildError, match="missing: not found in the build context"):
        assemble(parse_dockerfile("FROM x\nCOPY missing ./"), context, tmp_path / "b2")
    with pytest.raises(BuildError, match="--from=later: not an earlier stage"):
        assemble(parse_dockerfile("FROM x\nCOPY --from=later a ./"), context, tmp_path / "b3")


# -- the images ---------------------------------------------------------------------------------


def _python(*args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    """This virtualenv's Python with -P: a working directory that holds an `operator` folder
    must not hide the standard library's module."""
    out = subprocess.run(
        [sys.executable, "-P", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, f"{shlex.join(args)} in {cwd}:\n{out.stdout}\n{out.stderr}"
    return out.stdout


@dataclass
class Image:
    """A built image, as far as it can be built here: its stages' files and the directory its
    installed Python packages are in."""

    stages: list[Built]
    site: Path

    @property
    def final(self) -> Built:
        return self.stages[-1]


class WheelSteps:
    """The RUN steps of the keyshift image that this test performs itself: `pip wheel` of the
    project (offline, no build isolation) where the Dockerfile runs it, and `pip install` of the
    wheel into `site`. Other RUN steps need the network or the base image: not run here."""

    def __init__(self, wheels: Path, site: Path) -> None:
        self.wheels, self.site = wheels, site
        self.built: list[Path] = []

    def __call__(self, stage: Built, instruction: Instruction) -> None:
        words = instruction.args.split()
        if "pip" in words and "wheel" in words and "--no-deps" in words and words[-1] == ".":
            _python(
                "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                "--wheel-dir", str(self.wheels), ".",
                cwd=stage.path(stage.workdir),
            )  # fmt: skip
            self.built = sorted(self.wheels.glob("keyshift-*.whl"))
        elif "pip" in words and "install" in words and any("keyshift-" in w for w in words):
            assert self.built, "the image installs the keyshift wheel before a stage built it"
            _python(
                "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(self.site),
                *map(str, self.built),
                cwd=stage.root,
            )  # fmt: skip


def build_keyshift_image(workspace: Path) -> Image:
    context = workspace / "context"
    copy_context(REPO, patterns(), context)
    steps = WheelSteps(workspace / "wheels", workspace / "site-packages")
    stages = assemble(parse_dockerfile(DOCKERFILE.read_text()), context, workspace, steps)
    assert steps.built, "no stage of the Dockerfile builds the keyshift wheel"
    assert steps.site.is_dir(), "no stage of the Dockerfile installs the keyshift wheel"
    return Image(stages, steps.site)


def build_spark_image(workspace: Path, keyshift: Image) -> Image:
    """docker/spark.Dockerfile, with the keyshift image as its base (`--build-arg
    KEYSHIFT_IMAGE=...`, as the workflows build it) and the same build context."""
    reference = "keyshift:under-test"
    stages = parse_dockerfile(SPARK_DOCKERFILE.read_text(), {KEYSHIFT_IMAGE_ARG: reference})
    context = workspace / "context"
    copy_context(REPO, patterns(), context)
    built = assemble(stages, context, workspace / "spark", bases={reference: keyshift.final})
    return Image(built, keyshift.site)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Image, Image]]:
    workspace = tmp_path_factory.mktemp("images")
    keyshift = build_keyshift_image(workspace)
    yield keyshift, build_spark_image(workspace, keyshift)


def modules_of(site: Path) -> list[str]:
    """Every module of the keyshift packages installed in `site`."""
    return sorted(
        ".".join(path.relative_to(site).with_suffix("").parts).removesuffix(".__init__")
        for path in (site / "keyshift").rglob("*.py")
    )


IMPORT_ALL = """
import importlib, pathlib, sys
site = pathlib.Path(sys.argv[1]).resolve()
for name in sys.argv[2:]:
    module = importlib.import_module(name)
    origin = pathlib.Path(module.__file__).resolve()
    assert site in origin.parents, f"{name} imported from {origin}, not from the image"
print(len(sys.argv) - 2)
"""


def import_all(image: Image, names: list[str]) -> None:
    """Import `names` as a pod would: Python with -P in the image's working directory, the
    installed packages first on the path (this virtualenv's dependencies after them)."""
    cwd = image.final.path(image.final.workdir)
    found = _python("-c", IMPORT_ALL, str(image.site), *names, cwd=cwd, env=_env(image.site))
    assert int(found) == len(names)


def _env(site: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(site), "PYTHONDONTWRITEBYTECODE": "1"}


@pytest.mark.slow
def test_keyshift_image_builds_its_wheel_and_imports_every_package(
    images: tuple[Image, Image],
) -> None:
    keyshift, _ = images
    modules = modules_of(keyshift.site)
    assert set(PACKAGE_DIRS) <= set(modules), "a package of pyproject.toml is not in the wheel"
    # keyshift.spark's modules need pyspark, which only the Spark image has: its package (which
    # imports no pyspark) is imported here, its modules in the Spark image's test.
    outside_spark = [m for m in modules if not m.startswith(SPARK_EXTRA_PACKAGE + ".")]
    import_all(keyshift, outside_spark)
    # The job code pods import from their working directory.
    assert keyshift.final.workdir == "/app"
    assert (keyshift.final.path("/app/examples/lookups.py")).is_file()


@pytest.mark.slow
def test_spark_image_imports_every_module_and_has_the_spark_scripts(
    images: tuple[Image, Image],
) -> None:
    _, spark = images
    import_all(spark, modules_of(spark.site))
    assert spark.final.workdir == "/app"
    assert sorted(spark.final.path("/app/examples/spark").glob("*.py")), "no Spark scripts"


def test_every_package_dir_is_let_in_and_copied_where_the_wheel_is_built(tmp_path: Path) -> None:
    context = tmp_path / "context"
    sent = set(copy_context(REPO, patterns(), context))
    wheel_stage: list[Built] = []

    def at_wheel_build(stage: Built, instruction: Instruction) -> None:
        if "pip wheel" in instruction.args and instruction.args.split()[-1] == ".":
            # A snapshot: later instructions may change the stage's files.
            snapshot = tmp_path / "at-wheel-build"
            shutil.copytree(stage.root, snapshot, symlinks=True)
            wheel_stage.append(Built(stage.stage, snapshot, stage.workdir))

    assemble(parse_dockerfile(DOCKERFILE.read_text()), context, tmp_path, at_wheel_build)
    assert wheel_stage, "no stage of the Dockerfile runs `pip wheel ... .`"
    build = wheel_stage[0]
    project = build.path(build.workdir)
    assert (project / "pyproject.toml").is_file() and (project / "README.md").is_file()
    for package, directory in PACKAGE_DIRS.items():
        sources = {
            str(p.relative_to(REPO))
            for p in (REPO / directory).rglob("*.py")
            if "__pycache__" not in p.parts
        }
        assert sources, f"{package}: {directory}/ has no Python files"
        missing = sorted(sources - sent)
        assert not missing, f"{package}: .dockerignore keeps {missing} out of the context"
        not_copied = sorted(s for s in sources if not (project / s).is_file())
        assert not not_copied, f"{package}: no COPY puts {not_copied} in {build.workdir}"
