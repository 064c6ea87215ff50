"""What the current task's ``async with`` blocks entered, so that each ``__aexit__`` finds its own.

One object -- a semaphore, a limiter -- may be entered by many tasks at
once, and by one task several times, nested: what a block entered cannot be
kept on the object. It is kept in a context variable instead: each task
runs in a context of its own, so tasks sharing an object never see each
other's entries, and a task's nested blocks stack up, innermost last.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["TaskStack"]

Owner = TypeVar("Owner")
Value = TypeVar("Value")


class TaskStack(Generic[Owner, Value]):
    """The values the current task's blocks entered, innermost last, each under the object it entered."""

    __slots__ = ("_entered",)

    def __init__(self, name: str) -> None:
        self._entered: ContextVar[tuple[tuple[Owner, Value], ...]] = ContextVar(name, default=())

    def push(self, owner: Owner, value: Value) -> None:
        """Note that ``owner`` was entered, with ``value``, in the current task."""
        self._entered.set((*self._entered.get(), (owner, value)))

    def pop(self, owner: Owner) -> Value:
        """The value of the innermost block of ``owner`` the current task entered, now left.

        Raises:
            RuntimeError: The task entered no block of ``owner`` (or left it already).
        """
        entered = self._entered.get()
        for index in range(len(entered) - 1, -1, -1):
            if entered[index][0] is owner:
                self._entered.set(entered[:index] + entered[index + 1 :])
                return entered[index][1]
        raise RuntimeError(f"{owner!r}: __aexit__ without a matching __aenter__ in this task")

    def innermost_first(self) -> Iterator[tuple[Owner, Value]]:
        """The current task's blocks, from the innermost out."""
        return reversed(self._entered.get())
