"""What decorators with a fixed name declare: a semaphore's limit, a rate limiter's rate.

``@limit_concurrency("db", 3)`` declares that semaphore ``db`` has a limit
of 3, so that a ``limiter("db")`` given none may use it; likewise
``@limit_rate("api", 5)`` for ``rate_limiter("api")``. A value given to the
call wins, then one configured by name, then the one declaration -- and
several different declarations of one name are refused as ambiguous. A
semaphore found with no limit at all takes the one in force in Redis.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

from . import _fork

if TYPE_CHECKING:
    from collections.abc import Mapping

    from ._options import Rate

__all__ = ["LIMITS", "RATES", "Declarable"]

V = TypeVar("V")

_lock = threading.Lock()
#: What decorators with a fixed name declared, by setting and name.
_declared: dict[tuple[str, str], set[Any]] = {}


@dataclass(frozen=True, slots=True)
class Declarable(Generic[V]):
    """A setting by name -- a semaphore's limit, a rate limiter's rate -- that a decorator may declare."""

    #: The argument that gives it, as in "pass limit=".
    argument: str
    #: What it belongs to, as in "no limit for semaphore 'api'".
    owner: str
    #: The `configure` argument of these settings by name.
    setting: str
    #: The decorator that declares it.
    decorator: str

    def declare(self, name: str, value: V) -> None:
        """Note that a decorator gives ``name`` this value: a limiter given none may use it."""
        with _lock:
            _declared.setdefault((self.setting, name), set()).add(value)

    def find(self, name: str, given: V | None, configured: Mapping[str, V]) -> V | None:
        """The value of a call: given, else ``configured`` by name, else declared by a decorator, else ``None``.

        Raises:
            LookupError: Several different declarations, and nothing given or configured.
        """
        if given is not None:
            return given
        if name in configured:
            return configured[name]
        with _lock:
            declared = sorted(_declared.get((self.setting, name), ()))
        if len(declared) == 1:
            return declared[0]  # type: ignore[no-any-return]
        if declared:
            raise LookupError(
                f"no {self.argument} for {self.owner} {name!r}: decorators declare it with different "
                f"{self.setting} {declared}; pass {self.argument}=, or set one with "
                f"aiosem.configure({self.setting}={{{name!r}: ...}})"
            )
        return None

    def resolve(self, name: str, given: V | None, configured: Mapping[str, V]) -> V:
        """As `find`, but a value must be found.

        Raises:
            LookupError: None found, or several different declarations.
        """
        found = self.find(name, given, configured)
        if found is not None:
            return found
        what = f"no {self.argument} for {self.owner} {name!r}"
        raise LookupError(
            f"{what}: pass {self.argument}=, set one with aiosem.configure({self.setting}={{{name!r}: ...}}), "
            f"or decorate a function with @{self.decorator}({name!r}, ...) first"
        )


LIMITS: Final[Declarable[int]] = Declarable("limit", "semaphore", "limits", "limit_concurrency")
RATES: Final[Declarable[Rate]] = Declarable("rate", "rate limiter", "rates", "limit_rate")


def reset() -> None:
    """Forget every declaration (tests only)."""
    with _lock:
        _declared.clear()


def _forget_lock() -> None:
    global _lock  # noqa: PLW0603 -- the parent may have held it at the fork
    _lock = threading.Lock()


_fork.forget(_forget_lock)
