"""The README documents every autoscaler setting: its table is the one settings.py generates."""

from __future__ import annotations

from keyshift.policies.settings import settings_table
from tests.conftest import REPO


def test_readme_lists_every_autoscaler_setting() -> None:
    readme = (REPO / "README.md").read_text()
    assert settings_table() in readme, (
        "README.md's settings table is stale; replace it with the output of "
        "keyshift.policies.settings.settings_table()"
    )
