"""The version a release tag stands for, checked against the files that carry it: the release
workflow (.github/workflows/release.yaml) runs `python3 tools/release_version.py "$TAG"` before it
builds anything, and tags images and the chart with what it prints. A tag `vX.Y.Z` must equal
pyproject.toml's project.version and helm/keyshift/Chart.yaml's version and appVersion, so an
image, its wheel and the chart that installs it never disagree. Standard library only (the
workflow runs it before installing anything); tests/test_e2e_files.py tests it.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TAG = re.compile(r"^v(\d+\.\d+\.\d+(?:-[0-9A-Za-z.-]+)?)$")
# Chart.yaml's top-level `version:` and `appVersion:` (quoted or not).
CHART_FIELD = re.compile(r"^(version|appVersion):\s*[\"']?([^\"'\s#]+)[\"']?\s*(?:#.*)?$", re.M)


def versions(root: Path) -> dict[str, str]:
    """Where the version is written, and what it says there."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]["version"]
    chart = dict(CHART_FIELD.findall((root / "helm" / "keyshift" / "Chart.yaml").read_text()))
    return {
        "pyproject.toml project.version": project,
        "helm/keyshift/Chart.yaml version": chart.get("version", "<missing>"),
        "helm/keyshift/Chart.yaml appVersion": chart.get("appVersion", "<missing>"),
    }


def release_version(tag: str, root: Path = ROOT) -> str:
    """The version of `tag`; ValueError saying what disagrees."""
    match = TAG.match(tag)
    if match is None:
        raise ValueError(f"tag {tag!r} is not vMAJOR.MINOR.PATCH[-PRERELEASE]")
    version = match.group(1)
    wrong = [f"{where} is {found}" for where, found in versions(root).items() if found != version]
    if wrong:
        raise ValueError(f"tag {tag} is version {version}, but " + ", ".join(wrong))
    return version


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: release_version.py TAG", file=sys.stderr)
        return 2
    try:
        print(release_version(argv[0]))
    except ValueError as exc:
        print(f"release_version: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
