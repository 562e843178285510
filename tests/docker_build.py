"""What `docker build` would put in an image, worked out without Docker: the build context that
.dockerignore lets in, and the files each build stage's COPY instructions place in its
filesystem.

Used by tests/test_build_context.py (which then builds and imports the wheel as the Dockerfile
does) and tests/test_e2e_files.py (which checks what the Dockerfiles say). The semantics follow
Docker's own code (moby/patternmatcher, buildkit's dockerignore reader and Dockerfile parser):

- .dockerignore: a line starting with `#` is a comment; lines are trimmed, a leading `!` makes an
  exception, a pattern is cleaned like a path (`./a/` is `a`, a leading `/` dropped); `*` and `?`
  never match `/`, `**` matches any number of directories (none included), `[...]` is a class,
  `\\` escapes. A pattern matching a directory matches everything below it; the last pattern
  that matches a path decides.
- Dockerfile: parser directives and comments dropped, `\\` continues a line; global ARGs (before
  the first FROM) substitute into FROM; a stage starts at `/` or at its base stage's files, and
  WORKDIR is relative to the previous one. COPY/ADD with `--from` take from an earlier stage's
  files, else from the context; a directory source copies its contents; with several sources or
  a destination ending in `/` the destination is a directory.
"""

from __future__ import annotations

import fnmatch
import json
import posixpath
import re
import shlex
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path


class BuildError(Exception):
    """What `docker build` would fail with, said as plainly."""


# -- .dockerignore ------------------------------------------------------------------------------


@dataclass(frozen=True)
class IgnorePattern:
    text: str
    exception: bool
    regex: re.Pattern[str]


def _clean(path: str) -> str:
    """Go's filepath.Clean for slash-separated paths."""
    cleaned = posixpath.normpath(path) if path else "."
    # normpath keeps a leading `//`; Clean does not.
    return "/" + cleaned.lstrip("/") if cleaned.startswith("//") else cleaned


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """moby/patternmatcher's translation of a pattern into a regular expression."""
    out = "^"
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "*":
            if pattern[i + 1 : i + 2] == "*":
                i += 1
                if pattern[i + 1 : i + 2] == "/":
                    i += 1  # `**/` is `**`
                out += ".*" if i + 1 >= len(pattern) else "(.*/)?"
            else:
                out += "[^/]*"
        elif ch == "?":
            out += "[^/]"
        elif ch == "\\":
            i += 1
            out += re.escape(pattern[i]) if i < len(pattern) else re.escape("\\")
        elif ch == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                raise BuildError(f".dockerignore: unterminated class in {pattern!r}")
            body = pattern[i + 1 : end]
            out += "[" + ("^" + body[1:] if body.startswith("^") else body) + "]"
            i = end
        else:
            out += re.escape(ch)
        i += 1
    return re.compile(out + "$")


def parse_dockerignore(text: str) -> list[IgnorePattern]:
    """The patterns of a .dockerignore file, as buildkit's reader cleans them."""
    patterns = []
    for raw in text.splitlines():
        if raw.startswith("#"):
            continue
        line = raw.strip()
        if not line:
            continue
        exception = line.startswith("!")
        if exception:
            line = line[1:].strip()
        if line:
            line = _clean(line)
            if len(line) > 1 and line.startswith("/"):
                line = line[1:]
        patterns.append(IgnorePattern(line, exception, _pattern_regex(line)))
    return patterns


def ignored(path: str, patterns: Iterable[IgnorePattern]) -> bool:
    """Whether the context path `path` (slash-separated, relative) stays out of the context."""
    path = _clean(path)
    parts = path.split("/")
    parents = ["/".join(parts[: i + 1]) for i in range(len(parts) - 1)]
    matched = False
    for pattern in patterns:
        # An exclusion can only change an unmatched path, an exception a matched one.
        if pattern.exception != matched:
            continue
        if pattern.regex.match(path) or any(pattern.regex.match(p) for p in parents):
            matched = not pattern.exception
    return matched


def _may_reinclude_below(directory: str, patterns: list[IgnorePattern]) -> bool:
    """Whether some exception could let in a path below the ignored `directory`, so the walk
    must go in (only a shortcut: every path found is still matched). Conservative: an exception
    whose leading components agree with the directory's, or that has a `**` there, could."""
    dir_parts = directory.split("/")
    for pattern in patterns:
        if pattern.exception and _may_match_below(dir_parts, pattern.text.split("/")):
            return True
    return False


def _may_match_below(dir_parts: list[str], parts: list[str]) -> bool:
    for mine, theirs in zip(dir_parts, parts, strict=False):
        if "**" in theirs:
            return True  # any depth from here on
        if not fnmatch.fnmatchcase(mine, theirs):
            return False
    return True


def context_files(root: Path, patterns: list[IgnorePattern]) -> list[str]:
    """Every file of the build context rooted at `root`, as sorted relative paths."""
    found: list[str] = []

    def walk(directory: Path, rel: str) -> None:
        for entry in sorted(directory.iterdir()):
            path = f"{rel}/{entry.name}" if rel else entry.name
            if entry.is_dir() and not entry.is_symlink():
                if ignored(path, patterns) and not _may_reinclude_below(path, patterns):
                    continue
                walk(entry, path)
            elif not ignored(path, patterns):
                found.append(path)

    walk(root, "")
    return found


def copy_context(root: Path, patterns: list[IgnorePattern], into: Path) -> list[str]:
    """The build context as Docker sends it: the files let in, copied below `into`."""
    files = context_files(root, patterns)
    for rel in files:
        target = into / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)
    return files


# -- Dockerfile ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    op: str
    args: str  # flags included, continuation lines joined

    def flags_and_values(self) -> tuple[dict[str, str], list[str]]:
        """`--name=value` flags and the remaining words (the JSON form understood)."""
        flags: dict[str, str] = {}
        rest = self.args
        while (flag := _FLAG.match(rest)) is not None:
            flags[flag.group(1)] = flag.group(2) or ""
            rest = rest[flag.end() :]
        if rest.startswith("["):
            return flags, [str(v) for v in json.loads(rest)]
        return flags, shlex.split(rest)


_FLAG = re.compile(r"--([a-z-]+)(?:=(\S*))?\s+")


@dataclass
class Stage:
    index: int
    name: str | None
    base: str
    instructions: list[Instruction] = field(default_factory=list)


_VARIABLE = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)")


def _substitute(text: str, values: Mapping[str, str]) -> str:
    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(3)
        default = match.group(2)
        return values.get(name) or (default or "")

    return _VARIABLE.sub(one, text)


def logical_lines(text: str) -> list[Instruction]:
    """Every instruction of a Dockerfile in order, FROM and global ARGs included: continuation
    lines joined, blank lines, comments and parser directives dropped."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # also inside a continued instruction, as Docker drops them there
        if line.endswith("\\"):
            pending += line[:-1].rstrip() + " "
            continue
        lines.append(pending + line)
        pending = ""
    if pending:
        raise BuildError("Dockerfile ends inside a continued instruction")
    found = []
    for line in lines:
        op, _, args = line.partition(" ")
        found.append(Instruction(op.upper(), args.strip()))
    return found


def parse_dockerfile(text: str, build_args: Mapping[str, str] | None = None) -> list[Stage]:
    """The stages of a Dockerfile, with global ARGs (overridden by `build_args`) put into the
    FROM lines."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for instruction in logical_lines(text):
        op, args = instruction.op, instruction.args
        if op == "FROM":
            words = _substitute(args, global_args).split()
            words = [w for w in words if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(len(stages), name, words[0]))
        elif not stages:
            if op != "ARG":
                raise BuildError(f"{op} before the first FROM")
            key, _, default = args.partition("=")
            given = (build_args or {}).get(key)
            global_args[key] = given if given is not None else default.strip('"')
        else:
            stages[-1].instructions.append(instruction)
    if not stages:
        raise BuildError("no FROM in the Dockerfile")
    return stages


def stage_of(stages: list[Stage], ref: str) -> Stage | None:
    """The earlier stage a FROM or `--from` names (by name or index), if it is one."""
    for stage in stages:
        if stage.name is not None and stage.name.lower() == ref.lower():
            return stage
    return stages[int(ref)] if ref.isdigit() and int(ref) < len(stages) else None


# -- assembling the stages ----------------------------------------------------------------------


@dataclass
class Built:
    """One stage's filesystem, as the COPY instructions left it (`root` stands for `/`)."""

    stage: Stage
    root: Path
    workdir: str = "/"

    def path(self, absolute: str) -> Path:
        return self.root / absolute.lstrip("/")


RunHook = Callable[[Built, Instruction], None]


def _glob(base: Path, pattern: str) -> list[Path]:
    """Sources of a COPY: Go's filepath.Match per component, relative to `base`."""
    pattern = _clean(pattern).lstrip("/")
    if pattern == ".":
        return [base]
    found = [base]
    for part in pattern.split("/"):
        found = [
            child
            for parent in found
            if parent.is_dir()
            for child in sorted(parent.iterdir())
            if fnmatch.fnmatchcase(child.name, part)
        ]
    return found


def _copy(source: Path, destination: Path, into_directory: bool) -> None:
    if source.is_dir():
        shutil.copytree(source, destination, dirs_exist_ok=True, symlinks=True)
        return
    target = destination / source.name if into_directory else destination
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, target)


def assemble(
    stages: list[Stage],
    context: Path,
    workspace: Path,
    on_run: RunHook | None = None,
    bases: Mapping[str, Built] | None = None,
) -> list[Built]:
    """Every stage's filesystem below `workspace`, from the context copied at `context`.
    `bases` gives the filesystems of images a FROM names that are not stages of this file (an
    image built from another Dockerfile); any other base image counts as empty. `on_run` is
    called for each RUN with the stage's files as they are at that point."""
    built: list[Built] = []
    for stage in stages:
        root = workspace / f"stage-{stage.index}"
        base = stage_of(stages[: stage.index], stage.base)
        outside = (bases or {}).get(stage.base)
        workdir = "/"
        if base is not None or outside is not None:
            origin = built[base.index] if base is not None else outside
            assert origin is not None
            shutil.copytree(origin.root, root, symlinks=True)
            workdir = origin.workdir
        else:
            root.mkdir(parents=True)
        current = Built(stage, root, workdir)
        for instruction in stage.instructions:
            if instruction.op == "WORKDIR":
                current.workdir = posixpath.normpath(
                    posixpath.join(current.workdir, instruction.args)
                )
                current.path(current.workdir).mkdir(parents=True, exist_ok=True)
            elif instruction.op in ("COPY", "ADD"):
                _apply_copy(instruction, current, stages, built, context)
            elif instruction.op == "RUN" and on_run is not None:
                on_run(current, instruction)
        built.append(current)
    return built


def _apply_copy(
    instruction: Instruction, current: Built, stages: list[Stage], built: list[Built], context: Path
) -> None:
    flags, values = instruction.flags_and_values()
    if len(values) < 2:
        raise BuildError(f"{instruction.op} {instruction.args}: needs a source and a destination")
    *sources, destination = values
    origin = context
    if "from" in flags:
        stage = stage_of(stages[: current.stage.index], flags["from"])
        if stage is None:
            raise BuildError(f"{instruction.op} --from={flags['from']}: not an earlier stage")
        origin = built[stage.index].root
    into_directory = len(sources) > 1 or destination.endswith("/")
    target = current.path(posixpath.join(current.workdir, destination))
    into_directory = into_directory or target.is_dir()
    for source in sources:
        matches = _glob(origin, source)
        if not matches:
            where = "the build context" if origin == context else f"stage {flags['from']}"
            raise BuildError(f"{instruction.op} {source}: not found in {where}")
        for match in matches:
            _copy(match, target, into_directory)
