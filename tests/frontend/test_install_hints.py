"""Every install instruction works from where its reader stands, and says it the same way.

aiosem is not on PyPI. The pages are read in a clone, where they say
``pip install '.[extra]'``; an error hint is read wherever aiosem runs,
where it names the extra's packages themselves, as the installed metadata
lists them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from aiosem._extras import extra_requirements, install_hint

ROOT = Path(__file__).parents[2]
#: What users read: the README, the pages, the examples and the library's own messages and docstrings.
READ_BY_USERS = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "examples").glob("*.py")),
    *sorted((ROOT / "aiosem").rglob("*.py")),
]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: ``pip install`` and what it installs, up to the end of the line or of a code span.
_PIP_INSTALL = re.compile(r"pip install (?P<what>[^`\n#)]+)")
#: What a page may install: the clone (``.``, with extras, or its path), or nox (and uv) to run the tests.
_FROM_THE_CLONE = re.compile(r"""'(?:\.|/path/to/aiosem)\[(?P<extras>[\w,]+)\]'|\.|nox(?: uv)?""")


def pyproject_extras() -> dict[str, list[str]]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 and later
    extras: dict[str, list[str]] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    return extras


def test_nothing_tells_a_user_to_install_aiosem_from_pypi() -> None:
    found = [
        f"{path.relative_to(ROOT)}: {match[0]}"
        for path in READ_BY_USERS
        for match in _PIP_INSTALL.finditer(path.read_text())
        if re.match(r"""["']?aiosem\b""", match["what"])
    ]
    assert found == []


def test_every_install_on_the_pages_is_from_the_clone_and_names_real_extras() -> None:
    extras = pyproject_extras()
    for page in PAGES:
        for match in _PIP_INSTALL.finditer(page.read_text()):
            command = match["what"].strip().removesuffix("&&").strip()
            command = command.partition(" && ")[0]
            form = _FROM_THE_CLONE.fullmatch(command)
            assert form is not None, f"{page.relative_to(ROOT)}: pip install {command}"
            named = (form["extras"] or "").split(",") if form["extras"] else []
            assert set(named) <= extras.keys(), f"{page.relative_to(ROOT)}: no extra {named}"


@pytest.mark.parametrize("extra", ["memory", "cli", "fastapi", "aiohttp", "otel", "examples"])
def test_a_hint_installs_the_packages_of_the_extra_as_pyproject_lists_them(extra: str) -> None:
    extras = pyproject_extras()

    def expanded(name: str) -> set[str]:
        found = set()
        for requirement in extras[name]:
            inner = re.fullmatch(r"aiosem\[([\w,]+)\]", requirement)
            found |= set().union(*map(expanded, inner[1].split(","))) if inner else {requirement.replace(" ", "")}
        return found

    assert set(extra_requirements(extra)) == expanded(extra)
    assert install_hint(extra) == "pip install " + " ".join(f"'{r}'" for r in extra_requirements(extra))


def test_a_hint_for_an_extra_aiosem_does_not_have_still_reads_as_a_sentence() -> None:
    assert install_hint("no-such-extra") == "install aiosem's 'no-such-extra' extra"


def test_the_readme_installs_and_runs_the_demo_in_one_command_and_the_tests_in_another() -> None:
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```console\n(.+)\n```", readme)
    assert "pip install '.[memory]' && python -m aiosem demo" in commands
    assert "pip install nox && nox -s tests" in commands
