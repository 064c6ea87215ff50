"""Every ```python block of README.md and docs/*.md runs, or is an excerpt of an example that runs.

A block without the title ``From examples/NAME.py`` is a complete program,
and runs here as ``python page.py`` would run it (``__name__`` is
``"__main__"``), in a namespace of its own, within `BLOCK_TIMEOUT` seconds.
What a block shows of its results it checks with ``assert``, so running it
checks them too. A fragment that is not marked as an excerpt fails here
(a ``NameError``, or a ``SyntaxError`` for an ``await`` outside a
function); so does a new block that is neither.

Where a block connects. The blocks are written as a user writes them, for
a Redis on their own machine. None of them reaches a Redis of this machine
(the shared one on port 6379, say): they run against the session's own
redis-server, and each of these redirections is done in the open:

- ``redis://localhost:6379/0`` in a block's source is replaced by the
  session's server's URL, and ``redis://localhost:7000`` by a node of the
  session's cluster (`LOCAL_URLS`);
- `block_server` (tests/docs/conftest.py) sets ``AIOSEM_REDIS_URL`` to the
  session's server, for the decorators, limiters and ``configure()``
  without ``url``; and makes ``redis.asyncio.Redis()`` with no address
  connect to it, instead of redis-py's default, localhost:6379;
- ``memory://`` is refused, so no block passes on the in-process Redis;
- any other literal naming this machine (``localhost``, ``127.0.0.1``,
  port 6379) fails the block before it runs.

An excerpt's lines are checked against its example, whose run is
tests/examples' business: here, that a test there runs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from tests.docs.blocks import (
    EXAMPLE_TESTS,
    ROOT,
    Block,
    blocks_of,
    loopback_literals,
    missing_runs,
    pages,
    python_fence_lines,
    run,
)

if TYPE_CHECKING:
    from tests.harness.support import RedisServer
    from tests.harness.topology import RedisClusterGroup

#: The longest a block may run. The slowest, a rate limit of 5 a second for 10 calls, takes 2 s.
BLOCK_TIMEOUT = 30
#: The local URLs the blocks name: the session's server's, and a node's of the session's cluster, replace them.
LOCAL_URL = "redis://localhost:6379/0"
LOCAL_CLUSTER_URL = "redis://localhost:7000"

BLOCKS = [block for page in pages() for block in blocks_of(page)]
PROGRAMS = [block for block in BLOCKS if block.example is None]
EXCERPTS = [block for block in BLOCKS if block.example is not None]


@pytest.mark.timeout(BLOCK_TIMEOUT)
@pytest.mark.parametrize("block", PROGRAMS, ids=str)
def test_a_complete_block_runs_on_the_tests_redis_server(
    block: Block, block_server: RedisServer, request: pytest.FixtureRequest
) -> None:
    local = {LOCAL_URL: block_server.url}
    if LOCAL_CLUSTER_URL in block.source:
        cluster: RedisClusterGroup = request.getfixturevalue("redis_cluster")
        local[LOCAL_CLUSTER_URL] = cluster.nodes[0].url
    assert loopback_literals(block.source, local) == [], f"{block} would connect to this machine's Redis"
    run(block, local)


@pytest.mark.parametrize("block", EXCERPTS, ids=str)
def test_an_excerpt_is_its_examples_own_lines(block: Block) -> None:
    assert block.example is not None
    assert block.example.is_file(), f"{block} is from {block.example}, which does not exist"
    assert missing_runs(block.source, block.example.read_text()) == []


@pytest.mark.parametrize("block", EXCERPTS, ids=str)
def test_the_example_of_an_excerpt_is_run_by_the_tests_of_examples(block: Block) -> None:
    assert block.example is not None
    quoted = f'"{block.example.name}"'
    assert any(quoted in test.read_text() for test in EXAMPLE_TESTS.glob("test_*.py")), block.example


def test_the_tests_see_every_python_block_of_the_pages() -> None:
    for page in pages():
        fences = list(python_fence_lines(page))
        assert [language for _, language in fences if language != "python"] == [], f"{page}: say ```python"
        assert [block.line for block in blocks_of(page)] == [line for line, _ in fences], page


def test_the_pages_have_blocks_of_both_kinds() -> None:
    assert {block.page.relative_to(ROOT).as_posix() for block in PROGRAMS} >= {"README.md", "docs/quickstart.md"}
    assert EXCERPTS
