"""What a forked child does with the state its parent left: forget it, without closing anything.

A gunicorn ``--preload`` worker, or a ``multiprocessing`` child started by
``fork``, inherits the parent's per-loop clients and the embedded store;
their sockets are the parent's. Each module holding such state registers a
`forget` hook here: the child calls them all, keeps what they return --
neither closed nor collected, since finalizers would close the parent's
sockets, or unregister them from an epoll instance parent and child share --
and remembers it was forked (one sign of several workers sharing a job).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["forget", "forked"]

_forked = False
#: What the hooks return, in the order they were registered.
_hooks: list[Callable[[], object]] = []
#: What a forked child inherited and must neither close nor let be collected.
_left_by_parent: list[object] = []


def forget(hook: Callable[[], object]) -> None:
    """Call ``hook`` in a forked child, to forget what it holds; what it returns, if not ``None``, is kept.

    A hook also renews its module's locks: another thread of the parent may
    have held one at the fork, and would never release it in the child.
    """
    _hooks.append(hook)


def forked() -> bool:
    """Whether this process was forked after aiosem was imported."""
    return _forked


def _after_fork_in_child() -> None:
    global _forked  # noqa: PLW0603 -- a new process
    _forked = True
    _left_by_parent.append([kept for hook in _hooks if (kept := hook()) is not None])


def reset() -> None:
    """Forget that this process was forked (tests only)."""
    global _forked  # noqa: PLW0603 -- a clean slate
    _forked = False


if hasattr(os, "register_at_fork"):  # pragma: no branch -- not on Windows
    os.register_at_fork(after_in_child=_after_fork_in_child)
