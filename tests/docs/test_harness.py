"""What tests/docs relies on: how it reads the pages, checks excerpts, and where a block's Redis is."""

from __future__ import annotations

import traceback
from typing import TYPE_CHECKING

import pytest
import redis.asyncio

from tests.docs.blocks import Block, blocks_of, loopback_literals, missing_runs, python_fence_lines, run

if TYPE_CHECKING:
    from pathlib import Path

    from tests.harness.support import RedisServer

PROGRAM = '''\
import aiosem


class Repository:
    """Rows, three reads at a time."""

    @aiosem.limit_concurrency("db", 3)
    async def get(self, key: int) -> str:
        return str(key)

    async def put(self, key: int) -> None:
        pass
'''
#: A program that takes a permit of the limiter "docs", wherever aiosem connects without being told.
LIMITED = """\
import asyncio

import aiosem


async def main() -> None:
    try:
        async with aiosem.limiter("docs", 1):
            pass
    finally:
        await aiosem.aclose()


asyncio.run(main())
"""


def write_page(tmp_path: Path, text: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(text)
    return page


# --- reading the pages -------------------------------------------------------------------------------


def test_a_python_block_is_read_with_its_line_and_title_and_an_indented_one_dedented(tmp_path: Path) -> None:
    page = write_page(
        tmp_path,
        '# Page\n\n```python title="From examples/x.py"\nx = 1\n```\n\n```bash\nls\n```\n\n'
        '=== "Tab"\n\n    ```python\n    if x:\n        y = 2\n    ```\n',
    )
    assert blocks_of(page) == [
        Block(page, 3, "x = 1\n", "From examples/x.py"),
        Block(page, 13, "if x:\n    y = 2\n", None),
    ]


def test_an_excerpt_names_its_example_by_its_title(tmp_path: Path) -> None:
    excerpt = Block(tmp_path, 1, "", "From examples/crawler.py")
    assert excerpt.example is not None
    assert excerpt.example.parts[-2:] == ("examples", "crawler.py")
    assert Block(tmp_path, 1, "", "first.py").example is None
    assert Block(tmp_path, 1, "", None).example is None


def test_every_fence_of_some_python_is_found_whatever_its_language_is_called(tmp_path: Path) -> None:
    page = write_page(tmp_path, "```python\na\n```\n\n  ```py\nb\n  ```\n\n~~~pycon\n>>> c\n~~~\n\n```pyproject\n```\n")
    assert list(python_fence_lines(page)) == [(1, "python"), (5, "py"), (9, "pycon")]


# --- complete blocks ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fragment", "error"),
    [("permit = await sem.acquire()\n", SyntaxError), ("print(sem.key)\n", NameError)],
    ids=["await outside a function", "a name defined elsewhere"],
)
def test_a_fragment_that_is_not_marked_as_an_excerpt_fails_to_run(
    tmp_path: Path, fragment: str, error: type[Exception]
) -> None:
    with pytest.raises(error):
        run(Block(tmp_path / "page.md", 3, fragment, None), {})


def test_a_failing_block_points_at_its_line_of_the_page(tmp_path: Path) -> None:
    page = write_page(tmp_path, "# Page\n\n```python\nx = 1\nraise ValueError(x)\n```\n")
    [block] = blocks_of(page)
    with pytest.raises(ValueError, match="1") as raised:
        run(block, {})
    last = traceback.extract_tb(raised.value.__traceback__)[-1]
    assert (last.filename, last.lineno) == (str(page), 5)


def test_a_block_runs_as_main_with_its_local_urls_replaced(tmp_path: Path) -> None:
    source = 'URL = "redis://localhost:6379/0"\nassert __name__ == "__main__"\nassert URL == "redis://test:1/0", URL\n'
    run(Block(tmp_path / "page.md", 1, source, None), {"redis://localhost:6379/0": "redis://test:1/0"})


def test_a_literal_that_names_this_machines_redis_is_found_unless_it_is_replaced() -> None:
    source = (
        'a = "redis://localhost:6379/0"\nb = Redis(host="127.0.0.1")\nc = Redis(port=6379)\n'
        'd = "redis://[::1]:7000"\ne = "redis://redis.internal:6379/0"  # not this machine: fine\n'
    )
    assert loopback_literals(source, {}) == [
        "'redis://localhost:6379/0'",
        "'127.0.0.1'",
        "6379",
        "'redis://[::1]:7000'",
    ]
    assert loopback_literals(source, {"redis://localhost:6379/0": "", "redis://[::1]:7000": ""}) == [
        "'127.0.0.1'",
        "6379",
    ]


# --- excerpts ----------------------------------------------------------------------------------------


def test_an_excerpt_made_of_the_programs_lines_is_found_whatever_its_indentation() -> None:
    excerpt = '@aiosem.limit_concurrency("db", 3)\nasync def get(self, key: int) -> str:\n    return str(key)\n'
    assert missing_runs(excerpt, PROGRAM) == []


def test_lines_of_dots_stand_for_lines_left_out() -> None:
    excerpt = (
        "import aiosem\n...\n\n\nclass Repository:\n    ...  # the docstring\n"
        "    async def put(self, key: int) -> None:"
    )
    assert missing_runs(excerpt, PROGRAM) == []


def test_an_excerpt_with_a_line_of_its_own_is_reported_run_by_run() -> None:
    excerpt = "class Repository:\n    ...\n    async def get(self, key: int) -> bytes:\n        return str(key)\n"
    assert missing_runs(excerpt, PROGRAM) == ["async def get(self, key: int) -> bytes:\n    return str(key)"]


def test_an_excerpt_must_keep_the_programs_order() -> None:
    excerpt = "async def put(self, key: int) -> None:\n...\nclass Repository:\n"
    assert missing_runs(excerpt, PROGRAM) == ["class Repository:"]


def test_an_excerpt_must_keep_the_relative_indentation_of_its_lines() -> None:
    excerpt = "async def put(self, key: int) -> None:\npass\n"
    assert missing_runs(excerpt, PROGRAM) == ["async def put(self, key: int) -> None:\npass"]


# --- where a block's Redis is --------------------------------------------------------------------------


async def test_a_client_made_without_an_address_connects_to_the_tests_server(block_server: RedisServer) -> None:
    client = redis.asyncio.Redis()
    assert client.connection_pool.connection_kwargs["port"] == block_server.port  # before it connects anywhere
    try:
        await client.set("docs:probe", "here")
    finally:
        await client.aclose()
    with block_server._sync_client() as admin:
        assert admin.get("docs:probe") == b"here"


def test_aiosem_without_a_url_connects_to_the_tests_server(block_server: RedisServer) -> None:
    run(Block(block_server.directory / "page.md", 1, LIMITED, None), {})
    with block_server._sync_client() as admin:
        assert admin.keys("aiosem:{docs}*")


def test_a_block_that_would_run_on_memory_fails(block_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AIOSEM_REDIS_URL")
    with pytest.raises(AssertionError, match=r"fell back on memory://"):
        run(Block(block_server.directory / "page.md", 1, LIMITED, None), {})
