"""The ```python blocks of the documentation, found by Sybil, and the two ways a block may be kept honest.

A block is either **complete** -- a program that runs as it is -- or an
**excerpt** of an example program: its fence says so with a title that
mkdocs shows above the block, ```` ```python title="From examples/crawler.py" ````.
An excerpt's lines are the example's own, verbatim but for their
indentation; a line that is only ``...`` (and perhaps a comment) stands for
lines left out. Every block that is not an excerpt is run as a complete
program.

Sybil lexes the Markdown (indented fences inside tabs included); its
pytest plugin is not used, because the pages live outside ``tests/``, where
plain ``pytest`` collects, and the blocks need this suite's fixtures.
"""

from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sybil import Sybil
from sybil.parsers.markdown.lexers import RawFencedCodeBlockLexer

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Mapping

    from sybil import Document, Region

ROOT = Path(__file__).parents[2]
#: The test modules that run the programs of ``examples/``.
EXAMPLE_TESTS = ROOT / "tests" / "examples"

#: The info string of a Python fence: ``python``, then mkdocs' attributes (``title="..."``).
_PYTHON_INFO = re.compile(r"python(?:[ \t]+(?P<attributes>[^\n]*))?$\n", re.MULTILINE)
_TITLE = re.compile(r'\btitle="(?P<title>[^"]*)"')
#: The title that makes a block an excerpt, and names the example it is from.
_EXCERPT_TITLE = re.compile(r"From (?P<example>examples/[\w.-]+\.py)")
#: A line of an excerpt that stands for lines left out.
_ELISION = re.compile(r"\.\.\.(\s*#.*)?")
#: Every fence that opens a block of some Python: the pages must say ``python``, which the lexer reads.
_ANY_PYTHON_FENCE = re.compile(r"^[ \t]*(?:`{3,}|~{3,})[ \t]*(?P<language>py|python\d?|pycon|ipython)\b", re.MULTILINE)
#: Hosts that would reach a Redis of this machine, such as the shared one on port 6379.
_LOOPBACK = ("localhost", "127.0.0.1", "::1")
#: Redis's default port, and the shared server's.
_REDIS_PORT = 6379


@dataclass(frozen=True)
class Block:
    """One ```python block: where it is, its source (dedented), and its title if it has one."""

    page: Path
    line: int
    source: str
    title: str | None

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def example(self) -> Path | None:
        """The example program this block is an excerpt of, or None for a complete program."""
        match = _EXCERPT_TITLE.fullmatch(self.title or "")
        return None if match is None else ROOT / match["example"]


def _python_blocks(document: Document) -> Iterable[Region]:
    """Sybil's parser of ```python fences, with or without attributes, as the test runs them."""
    for region in RawFencedCodeBlockLexer(info_pattern=_PYTHON_INFO)(document):
        region.parsed = region.lexemes["source"]
        yield region


_SYBIL = Sybil(parsers=[_python_blocks])


def pages() -> list[Path]:
    """README.md and the pages of docs/ (the API reference is generated from docstrings: not these)."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks_of(page: Path) -> list[Block]:
    """The ```python blocks of a Markdown page, in order."""
    document = _SYBIL.parse(page)
    found = []
    for example in document.examples():
        title = _TITLE.search(example.region.lexemes["attributes"] or "")
        found.append(Block(page, example.line, str(example.parsed), None if title is None else title["title"]))
    return found


def python_fence_lines(page: Path) -> Iterator[tuple[int, str]]:
    """The line and language of every fence that opens a block of Python, found without Sybil."""
    text = page.read_text()
    for match in _ANY_PYTHON_FENCE.finditer(text):
        yield text.count("\n", 0, match.start()) + 1, match["language"]


def missing_runs(excerpt: str, program: str) -> list[str]:
    """The runs of ``excerpt`` (its lines between elisions) not found, in order, in ``program``.

    A run is found where the program has the same lines, one after the
    other, with the same indentation relative to each other.
    """
    lines = program.splitlines()
    missing = []
    start = 0
    for run in _runs(excerpt):
        size = len(run)
        for at in range(start, len(lines) - size + 1):
            if textwrap.dedent("\n".join(lines[at : at + size])) == _run_text(run):
                start = at + size
                break
        else:
            missing.append(_run_text(run))
    return missing


def _run_text(run: list[str]) -> str:
    return textwrap.dedent("\n".join(run))


def _runs(excerpt: str) -> Iterator[list[str]]:
    run: list[str] = []
    for line in [*excerpt.splitlines(), "..."]:
        if _ELISION.fullmatch(line.strip()):
            while run and not run[-1].strip():
                run.pop()
            if run:
                yield run
            run = []
        elif run or line.strip():
            run.append(line)


def loopback_literals(source: str, allowed: Mapping[str, str]) -> list[str]:
    """The literals of ``source`` that name this machine's Redis, other than those ``allowed`` (to be replaced).

    A block that named one would reach whatever listens there: the shared
    Redis on port 6379, say, instead of the test's own.
    """
    constants = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Constant)]
    return [
        repr(node.value)
        for node in sorted(constants, key=lambda node: (node.lineno, node.col_offset))
        if node.value not in allowed
        and (
            (isinstance(node.value, str) and any(host in node.value for host in _LOOPBACK))
            or (isinstance(node.value, int) and node.value == _REDIS_PORT)
        )
    ]


def run(block: Block, replacements: Mapping[str, str]) -> None:
    """Run a complete block as ``python`` runs a file: in a namespace of its own, as ``__main__``.

    Each key of ``replacements`` in its source is replaced by its value
    first. Tracebacks show the page and its line numbers.
    """
    source = block.source
    for local, replacement in replacements.items():
        source = source.replace(local, replacement)
    code = compile("\n" * block.line + source, str(block.page), "exec", dont_inherit=True)
    exec(code, {"__name__": "__main__"})  # noqa: S102 -- running the documentation's programs is the point
