"""The public surface: what ``aiosem`` and ``aiosem.recipes`` export, and how."""

from __future__ import annotations

import inspect
import types
from importlib.resources import files

import pytest

import aiosem
import aiosem.recipes

#: The book's functions (Redis in Action, listings 6.8-6.17), each with the
#: book's positional parameters: (name, default), in the book's order.
_EMPTY = inspect.Parameter.empty
BOOK_SIGNATURES: dict[str, list[tuple[str, object]]] = {
    "acquire_lock": [("conn", _EMPTY), ("lockname", _EMPTY), ("acquire_timeout", 10)],
    "release_lock": [("conn", _EMPTY), ("lockname", _EMPTY), ("identifier", _EMPTY)],
    "acquire_lock_with_timeout": [
        ("conn", _EMPTY),
        ("lockname", _EMPTY),
        ("acquire_timeout", 10),
        ("lock_timeout", 10),
    ],
    "acquire_semaphore": [("conn", _EMPTY), ("semname", _EMPTY), ("limit", _EMPTY), ("timeout", 10)],
    "release_semaphore": [("conn", _EMPTY), ("semname", _EMPTY), ("identifier", _EMPTY)],
    "acquire_fair_semaphore": [("conn", _EMPTY), ("semname", _EMPTY), ("limit", _EMPTY), ("timeout", 10)],
    "release_fair_semaphore": [("conn", _EMPTY), ("semname", _EMPTY), ("identifier", _EMPTY)],
    "refresh_fair_semaphore": [("conn", _EMPTY), ("semname", _EMPTY), ("identifier", _EMPTY)],
    "acquire_semaphore_with_lock": [("conn", _EMPTY), ("semname", _EMPTY), ("limit", _EMPTY), ("timeout", 10)],
}


def _public_names(module: types.ModuleType) -> set[str]:
    """The names a module binds for its users: no submodules, no ``from __future__`` features."""
    return {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and not isinstance(value, types.ModuleType)
        and type(value).__module__ != "__future__"
    }


def test_all_is_sorted() -> None:
    assert aiosem.__all__ == sorted(aiosem.__all__)


def test_all_lists_exactly_the_public_names() -> None:
    assert set(aiosem.__all__) == _public_names(aiosem) | {"__version__"}


def test_all_has_no_duplicates() -> None:
    assert len(aiosem.__all__) == len(set(aiosem.__all__))


@pytest.mark.parametrize("name", [name for name in aiosem.__all__ if name != "__version__"])
def test_every_public_name_claims_the_package_as_its_module(name: str) -> None:
    assert getattr(aiosem, name).__module__ == "aiosem"


def test_version_is_a_string() -> None:
    assert isinstance(aiosem.__version__, str)
    assert aiosem.__version__


def test_star_import_gives_exactly_all() -> None:
    namespace: dict[str, object] = {}
    exec("from aiosem import *", namespace)  # noqa: S102 -- a fixed statement, to see what * binds
    assert set(namespace) - {"__builtins__"} == set(aiosem.__all__)


def test_recipes_export_exactly_the_nine_book_functions() -> None:
    assert set(aiosem.recipes.__all__) == set(BOOK_SIGNATURES)
    assert len(aiosem.recipes.__all__) == 9


def test_recipes_all_is_sorted() -> None:
    assert aiosem.recipes.__all__ == sorted(aiosem.recipes.__all__)


def test_recipes_define_no_other_public_function() -> None:
    defined = {
        name
        for name, value in vars(aiosem.recipes).items()
        if not name.startswith("_") and inspect.isfunction(value) and value.__module__ == "aiosem.recipes"
    }
    assert defined == set(aiosem.recipes.__all__)


@pytest.mark.parametrize("name", sorted(BOOK_SIGNATURES))
def test_each_recipe_is_a_coroutine_function_of_the_module(name: str) -> None:
    function = getattr(aiosem.recipes, name)
    assert inspect.iscoroutinefunction(function)
    assert function.__module__ == "aiosem.recipes"


@pytest.mark.parametrize("name", sorted(BOOK_SIGNATURES))
def test_each_recipe_takes_the_books_parameters_in_the_books_order(name: str) -> None:
    book = BOOK_SIGNATURES[name]
    parameters = list(inspect.signature(getattr(aiosem.recipes, name)).parameters.values())
    leading = [(parameter.name, parameter.default) for parameter in parameters[: len(book)]]
    assert leading == book
    assert all(parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for parameter in parameters[: len(book)])


@pytest.mark.parametrize("name", sorted(BOOK_SIGNATURES))
def test_each_recipe_adds_only_optional_parameters_after_the_books(name: str) -> None:
    # A call written for the book's function still binds.
    parameters = list(inspect.signature(getattr(aiosem.recipes, name)).parameters.values())
    added = parameters[len(BOOK_SIGNATURES[name]) :]
    assert all(parameter.default is not _EMPTY for parameter in added)


def test_py_typed_ships_in_the_package() -> None:
    assert files("aiosem").joinpath("py.typed").is_file()
