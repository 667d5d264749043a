"""README.md as users read it: every ```python block runs as written, the two set-up commands are the
ones CI runs, and every relative link of the README and docs/ points at a file of the repository.

The examples are written device-agnostic (``"cuda" if torch.cuda.is_available() else "cpu"``) at
small sizes, so each runs here on the CPU in seconds; a block that imports transformers skips
without it (the ``test`` extra installs it, so CI runs them all).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

# What `.ci/run` reads out of the README (its sed expression, in Python's syntax): the test command.
CI_TEST_COMMAND = re.compile(r"^    (python3 -m pip install .* && python3 -m pytest .*)$", re.MULTILINE)
SETUP_COMMANDS = (
    "    pip install torch==2.13.0 -e '.[plot]' && python -m trainops train",
    "    python3 -m pip install -q torch==2.13.0 -e '.[test]' && python3 -m pytest -q -m \"not gpu\"",
)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """The ```python fenced blocks of a Markdown text: (the line of the block's first code line, code)."""
    blocks, lines, start = [], text.splitlines(), None
    for number, line in enumerate(lines, 1):
        if start is None and line.strip() == "```python":
            start = number + 1
        elif start is not None and line.strip() == "```":
            blocks.append((start, "\n".join(lines[start - 1:number - 1]) + "\n"))
            start = None
    assert start is None, f"README.md: the ```python block from line {start} is never closed"
    return blocks


BLOCKS = python_blocks(README.read_text())


def test_the_readme_has_its_three_examples():
    assert len(BLOCKS) >= 3, f"README.md: {len(BLOCKS)} python blocks, expected the three examples"


@pytest.mark.parametrize("line, code", BLOCKS, ids=[f"line{line}" for line, _ in BLOCKS])
def test_readme_example_runs_as_written(line, code):
    if re.search(r"^import transformers|^from transformers", code, re.MULTILINE):
        pytest.importorskip("transformers")
    # compiled under the README's name so that a traceback points at the README's line
    compiled = compile("\n" * (line - 1) + code, str(README), "exec")
    exec(compiled, {"__name__": "__readme__"})


def test_python_blocks_parses_fences_and_refuses_an_open_one():
    text = "a\n```python\nx = 1\ny = 2\n```\n```bash\nls\n```\n```python\nz = 3\n```\n"
    assert python_blocks(text) == [(3, "x = 1\ny = 2\n"), (10, "z = 3\n")]
    with pytest.raises(AssertionError, match="never closed"):
        python_blocks("```python\nx = 1\n")


def test_the_setup_commands_are_there_word_for_word():
    lines = README.read_text().splitlines()
    for command in SETUP_COMMANDS:
        assert command in lines, f"README.md lost the set-up command {command.strip()!r}"


def test_ci_reads_exactly_the_test_command():
    found = CI_TEST_COMMAND.findall(README.read_text())
    assert found == [SETUP_COMMANDS[1].strip()], found
    ci = (ROOT / ".ci" / "run").read_text()
    assert r"s/^    \(python3 -m pip install .* && python3 -m pytest .*\)$/\1/p" in ci, \
        ".ci/run reads the README's test command some other way: update CI_TEST_COMMAND"


def relative_links(text: str) -> list[str]:
    """The targets of a Markdown text's links and images, outside code, that are not URLs (anchors cut)."""
    prose = re.sub(r"```.*?```|`[^`\n]*`", "", text, flags=re.DOTALL)  # code is not links
    return [t for t in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", prose) if "://" not in t]


def test_relative_links_finds_links_and_images_outside_code():
    text = "[a](docs/a.md#x) ![b](../b.png) [c](https://c.org) `[d](d.md)`\n```\n[e](e.md)\n```\n"
    assert relative_links(text) == ["docs/a.md", "../b.png"]


@pytest.mark.parametrize("page", ["README.md", "CONTRIBUTING.md", "CHANGELOG.md", "docs/benchmarks.md",
                                  "docs/design.md", "docs/contributing.md", "docs/guide.md"])
def test_relative_links_point_at_files(page):
    path = ROOT / page
    missing = [t for t in relative_links(path.read_text()) if not (path.parent / t).exists()]
    assert not missing, f"{page}: links to missing files {missing}"
