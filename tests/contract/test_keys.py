"""Key layout: every key of a semaphore shares one Redis Cluster hash tag, its escaped name."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING
from urllib.parse import unquote

import fakeredis
import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.crc import key_slot

from aiosem import AsyncFairSemaphore, AsyncLockedSemaphore
from aiosem._keys import SemaphoreKeys, check_prefix, escape_name
from tests.harness.topology import hash_tag

if TYPE_CHECKING:
    import redis.asyncio

SemaphoreClass = type[AsyncFairSemaphore] | type[AsyncLockedSemaphore]

#: Names that could move, cancel or double a hash tag, or collide after escaping.
AWKWARD_NAMES = [
    "{",
    "}",
    "{}",
    "}{",
    "a{b}c",
    "{{x}}",
    "{x}{y}",
    "a}b{c",
    " ",
    "a b",
    "  {  }  ",
    "sémaphore",
    "信号量{😀}",
    "%",
    "%7B",
    "%7D",
    "%25",
    "%%7B}",
    "x" * 10_000,
    "{" * 5_000 + "}" * 5_000,
]

#: Prefixes without braces (those are refused, see below).
prefixes = st.text(min_size=1).filter(lambda prefix: "{" not in prefix and "}" not in prefix)
#: Names drawn mostly from the characters the escaping is about, so near-collisions are tried.
escape_prone_names = st.text(alphabet="%{}7BD25ab", min_size=1)


def all_keys(keys: SemaphoreKeys) -> list[str]:
    return [keys.timeout_set, keys.owner_set, keys.counter, keys.lock]


@pytest.mark.parametrize(
    ("key", "hashed"),
    [
        ("plain", "plain"),
        ("a{b}c", "b"),
        ("{}", "{}"),
        ("a{}b{c}", "a{}b{c}"),
        ("}{", "}{"),
        ("{{x}}", "{x"),
        ("a{b}{c}", "b"),
        ("a{b", "a{b"),
        ("", ""),
    ],
)
def test_the_hash_tag_rule_here_agrees_with_redis_py(key: str, hashed: str) -> None:
    assert hash_tag(key) == hashed
    assert key_slot(key.encode()) == key_slot(hash_tag(key).encode())


@given(name=st.text(min_size=1), prefix=prefixes)
def test_every_key_has_the_same_hash_tag(name: str, prefix: str) -> None:
    keys = SemaphoreKeys.for_name(prefix, name)
    assert {hash_tag(key) for key in all_keys(keys)} == {escape_name(name)}


@pytest.mark.parametrize("name", AWKWARD_NAMES, ids=lambda name: repr(name)[:20])
def test_awkward_names_keep_one_tag_the_escaped_name(name: str) -> None:
    keys = SemaphoreKeys.for_name("aiosem", name)
    assert [hash_tag(key) for key in all_keys(keys)] == [escape_name(name)] * 4
    assert len({key_slot(key.encode()) for key in all_keys(keys)}) == 1


@given(name=st.text(min_size=1))
def test_the_tag_is_never_empty_and_has_no_braces(name: str) -> None:
    tag = escape_name(name)
    assert tag
    assert "{" not in tag
    assert "}" not in tag


def test_escaping_encodes_percent_and_braces_only() -> None:
    assert escape_name("a{b}c%d é") == "a%7Bb%7Dc%25d é"
    assert escape_name("%7B") == "%257B"


@given(name=st.text(min_size=1) | escape_prone_names)
def test_percent_decoding_undoes_the_escape(name: str) -> None:
    assert unquote(escape_name(name)) == name


@given(first=st.text(min_size=1) | escape_prone_names, second=st.text(min_size=1) | escape_prone_names)
def test_different_names_never_share_a_base_key(first: str, second: str) -> None:
    if first != second:
        assert SemaphoreKeys.for_name("aiosem", first).base != SemaphoreKeys.for_name("aiosem", second).base


@pytest.mark.parametrize(
    ("first", "second"), [("{", "%7B"), ("}", "%7D"), ("%", "%25"), ("%7B", "%257B"), ("{}", "%7B%7D")]
)
def test_a_name_and_its_escaped_spelling_are_different_semaphores(first: str, second: str) -> None:
    assert SemaphoreKeys.for_name("aiosem", first).base != SemaphoreKeys.for_name("aiosem", second).base


@given(first=st.tuples(prefixes, st.text(min_size=1)), second=st.tuples(prefixes, st.text(min_size=1)))
def test_different_prefix_and_name_pairs_never_share_a_base_key(
    first: tuple[str, str], second: tuple[str, str]
) -> None:
    if first != second:
        assert SemaphoreKeys.for_name(*first).base != SemaphoreKeys.for_name(*second).base


def test_the_layout_is_the_books_under_the_base_key() -> None:
    keys = SemaphoreKeys.for_name("app", "db")
    assert keys.base == "app:{db}"
    assert keys.timeout_set == "app:{db}"
    assert keys.owner_set == "app:{db}:owner"
    assert keys.counter == "app:{db}:counter"
    assert keys.lock == "lock:app:{db}"
    assert keys.fair == (
        "app:{db}",
        "app:{db}:owner",
        "app:{db}:counter",
        "app:{db}:queue",
        "app:{db}:waiters",
        "app:{db}:cancelled",
        "app:{db}:tickets",
        "app:{db}:limit",
        "app:{db}:holders",
        "app:{db}:weight",
        "app:{db}:arriving",
    )
    assert keys.channels == "app:{db}:wake:"


@pytest.mark.parametrize("prefix", ["{", "}", "a{b", "a}b", "{x}", "x{}"])
def test_a_prefix_with_a_brace_is_refused(prefix: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"prefix must not contain '{{' or '}}', got {prefix!r}")):
        check_prefix(prefix)


@pytest.mark.parametrize("prefix", ["aiosem", "app:v2", "a b", "é"])
def test_a_prefix_without_braces_is_kept(prefix: str) -> None:
    assert check_prefix(prefix) == prefix


@pytest.mark.parametrize("cls", [AsyncFairSemaphore, AsyncLockedSemaphore], ids=["fair", "locked"])
async def test_a_semaphore_key_escapes_braces_in_its_name(cls: SemaphoreClass) -> None:
    connection = fakeredis.FakeAsyncRedis()
    try:
        assert cls(connection, "a{b}", 1).key == "aiosem:{a%7Bb%7D}"
    finally:
        await connection.aclose()


@pytest.mark.parametrize("cls", [AsyncFairSemaphore, AsyncLockedSemaphore], ids=["fair", "locked"])
async def test_a_semaphore_writes_only_its_own_keys(
    cls: SemaphoreClass, client: redis.asyncio.Redis, client_admin: redis.asyncio.Redis
) -> None:
    sem = cls(client, "{{x}} %7B", 1)
    permit = await sem.acquire(blocking=False)
    assert permit is not None
    keys = SemaphoreKeys.for_name("aiosem", "{{x}} %7B")
    written = [keys.timeout_set, keys.owner_set, keys.counter, keys.limit, keys.holders]
    expected = sorted(key.encode() for key in written)
    assert sorted(await client_admin.keys("*")) == expected
    assert len({key_slot(key) for key in expected}) == 1
