"""A connection left open names the test and the code that opened it, in the warning the garbage collector gives.

A redis-py connection nobody closed is found only when the garbage
collector frees it: often during a later test, whose traceback then says
nothing of where it came from ("unclosed Connection", "loop is closed").
`trace_openings` records, at each connection's opening, the test running
and the awaits that led there, and has the connection's own warning carry
them. It costs a short stack per connection opened, a few thousand a run.
"""

from __future__ import annotations

import os
import traceback
import warnings
from typing import Any, Final

from redis.asyncio.connection import AbstractConnection

#: How many frames of the opening are kept: enough to reach aiosem's caller through redis-py's own.
_FRAMES: Final = 24


def trace_openings() -> None:
    """Have every redis-py asyncio connection record its opening, and name it if it is freed open."""
    connect = AbstractConnection.connect
    finalize = AbstractConnection.__del__

    async def connect_traced(self: AbstractConnection) -> None:
        if not self.is_connected:
            test = os.environ.get("PYTEST_CURRENT_TEST", "no test")
            self._aiosem_opened = f"in {test}, at:\n{''.join(traceback.format_stack(limit=_FRAMES))}"  # type: ignore[attr-defined]
        await connect(self)  # type: ignore[no-untyped-call,unused-ignore]  # untyped in redis-py 8

    def finalize_named(self: AbstractConnection, *args: Any) -> None:
        if getattr(self, "_writer", None) is not None:
            opened = getattr(self, "_aiosem_opened", "where unknown")
            warnings.warn(f"unclosed connection {self!r}, opened {opened}", ResourceWarning, stacklevel=1)
        finalize(self, *args)

    AbstractConnection.connect = connect_traced  # type: ignore[method-assign]
    AbstractConnection.__del__ = finalize_named  # type: ignore[method-assign]
