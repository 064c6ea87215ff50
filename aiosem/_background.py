"""Tasks that run in the background, kept referenced until they end.

The event loop keeps only a weak reference to a task: one that nobody else
refers to may be collected half-way, silently. Whoever starts a task it
does not await keeps it in a `Background`, which lets go of each task as
it ends.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from collections.abc import Coroutine, Iterator

__all__ = ["Background"]

T = TypeVar("T")


class Background:
    """Keeps background tasks alive until they end; iterating gives those still running."""

    __slots__ = ("_tasks",)

    def __init__(self) -> None:
        self._tasks: set[asyncio.Future[Any]] = set()

    def __repr__(self) -> str:
        return f"Background(running={len(self._tasks)})"

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Future[Any]]:
        return iter([*self._tasks])

    def start(self, coroutine: Coroutine[Any, Any, T], *, name: str) -> asyncio.Task[T]:
        """Run ``coroutine`` in a task of the running loop, kept until it ends."""
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        self.keep(task)
        return task

    def keep(self, task: asyncio.Future[Any]) -> None:
        """Keep ``task``, started elsewhere, until it ends."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
