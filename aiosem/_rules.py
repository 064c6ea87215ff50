"""The server's rules: the constants both backends of a semaphore step follow.

The fair scripts (``aiosem/lua``) and the Lua-free plan (``_plan.py``) carry
out the same step; each constant here is written once, read by the plan as
a Python name, and injected into every script as a ``local`` of the same
name (see ``_scripts.py``), so the two can never disagree on a number.
The step's result codes and modes live with the rest of the protocol, in
``_protocol.py``, and are injected the same way.
"""

from __future__ import annotations

import math
from typing import Final

__all__ = [
    "COUNTER_TTL_MS",
    "EXPIRE_MARGIN_MS",
    "EXPIRE_SLACK_MS",
    "RUN_LENGTH",
    "SKIPLIST_AT",
    "SKIPLIST_MEMBER_BYTES",
    "SKIPLIST_MOVER",
    "SKIPLIST_MOVER_BYTE",
    "TOMBSTONE_SECONDS",
    "TOMBSTONE_TTL_MS",
    "queue_ttl_ms",
]

#: How long a cancelled identifier is refused: far longer than a request
#: can spend in flight.
TOMBSTONE_SECONDS: Final = 60
#: The TTL a tombstone sets on ``:cancelled``: a second past the tombstone.
TOMBSTONE_TTL_MS: Final = (TOMBSTONE_SECONDS + 1) * 1000
#: How long the fencing counter outlives the last grant: a day, so that an
#: idle semaphore leaves nothing behind for ever, yet far longer than any
#: step of the server's clock back that the counter must cover.
COUNTER_TTL_MS: Final = 86_400_000
#: How much longer than a waiter timeout the queue's keys outlive the last
#: waiter written to them.
EXPIRE_MARGIN_MS: Final = 1000
#: How much of that margin may run down before a step that writes a waiter
#: pushes the TTL out again: most such steps then only read it.
EXPIRE_SLACK_MS: Final = 500
#: The most waiters one run relays a mutex to.
RUN_LENGTH: Final = 64
#: How many members a permit set or the queue grows to when a step adding
#: members moves it to Redis's skiplist encoding (see ``aiosem_add_all`` in
#: the scripts' prelude): a compact (listpack) sorted set places each member
#: it adds by a scan that parses every score on its way.
SKIPLIST_AT: Final = 8
#: The member that moves a set to the skiplist encoding is this byte,
#: ``SKIPLIST_MEMBER_BYTES`` times: longer than ``zset-max-listpack-value``
#: (64 bytes by default) as far as a server tuned for memory would raise it,
#: and so never an identifier.
SKIPLIST_MOVER_BYTE: Final = "~"
SKIPLIST_MEMBER_BYTES: Final = 1025
#: That member, as the scripts spell it (``string.rep``) and the plan writes it.
SKIPLIST_MOVER: Final = SKIPLIST_MOVER_BYTE * SKIPLIST_MEMBER_BYTES


def queue_ttl_ms(waiter_ttl: float) -> int:
    """The TTL, in ms, that a step writing a waiter of ``waiter_ttl`` seconds gives the queue's keys."""
    return math.ceil(waiter_ttl * 1000) + EXPIRE_MARGIN_MS
