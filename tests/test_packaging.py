"""The version says the same thing everywhere: pyproject.toml, ``trainops.__version__`` (which
``python -m trainops env`` prints) and a CHANGELOG.md section. (The built wheel itself is CI's
``.ci/wheel``: built, installed in a fresh virtualenv, imported and run outside the source tree.)
And the core imports none of the optional extras' packages."""

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


def test_the_core_imports_none_of_the_extras():
    """``import trainops`` (and its functional, nn, optim and patch) loads none of the optional
    integrations' packages: transformers, peft, trl, torchao, bitsandbytes, quack, liger_kernel."""
    import subprocess
    import sys

    extras = ("transformers", "peft", "trl", "torchao", "bitsandbytes", "quack", "liger_kernel")
    code = ("import sys, trainops, trainops.functional, trainops.nn, trainops.optim, trainops.patch\n"
            f"print(sorted(m for m in {extras!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout
