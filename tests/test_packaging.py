"""The version says the same thing everywhere: pyproject.toml, ``trainops.__version__`` (which
``python -m trainops env`` prints) and a CHANGELOG.md section. (The built wheel itself is CI's
``.ci/wheel``: built, installed in a fresh virtualenv, imported and run outside the source tree.)"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import trainops

ROOT = Path(__file__).resolve().parent.parent


def test_pyproject_and_the_package_state_one_version():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["version"] == trainops.__version__


def test_the_changelog_has_a_section_for_this_version():
    release = re.match(r"\d+\.\d+\.\d+", trainops.__version__).group(0)
    headings = re.findall(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE)
    assert headings and headings[0] == release, \
        f"CHANGELOG.md's first section is {headings[:1]}, expected {release} (trainops {trainops.__version__})"
