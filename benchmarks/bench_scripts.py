"""The server's time in each fair script, in the pattern of the contended limit-16 loop, and against another checkout.

64 coroutines at limit 16, each holding its permit for one pass of the event
loop, move in lockstep: the 16 holders release together, the step hands
their permits to the 16 longest waiters, and those 16 acquire again and
queue behind the other 48. This replays that pattern step by step from one
client -- a release of 16, then an acquire of 16 fresh waiters, 400 times
-- through `aiosem._fair.fair_step`, and reads each script's own duration
from ``SLOWLOG`` (the server's time, from the script's start to its reply,
whatever the client does meanwhile): p10 and p50 per kind of step.

With ``--against DIR``, the scripts of that checkout (its ``aiosem/lua``)
replay the same pattern on a second semaphore of the same server, step by
step in turn with this checkout's, so that both meet the same noise: how a
change of a script changes its time. The Python that drives both is this
checkout's.

It starts a private ``redis-server`` (``$AIOSEM_REDIS_SERVER``, else the one on
``PATH``) on a free loopback port, without persistence, and stops it at the
end; it never touches port 6379.

Run it::

    python benchmarks/bench_scripts.py
    git worktree add /tmp/before HEAD~1 && python benchmarks/bench_scripts.py --against /tmp/before
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import secrets
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Final

from harness import (
    RedisServer,
    environment,
    markdown_table,
    new_client,
    percentile,
    redis_server_binary,
    write_report,
)

import aiosem._fair
from aiosem import AsyncFairSemaphore
from aiosem._fair import fair_step
from aiosem._keys import encode_record
from aiosem._protocol import Operation, Step
from aiosem._scripts import Script, _lua_header

if TYPE_CHECKING:
    from collections.abc import Sequence

    import redis.asyncio

    from aiosem._keys import SemaphoreKeys

LIMIT: Final = 16
#: Waiters queued behind the holders: 64 coroutines in all.
QUEUED: Final = 48
ROUNDS: Final = 400
LEASE: Final = 10.0
WAITER_TTL: Final = 3.0
#: What the identifiers' records say (see `aiosem._keys.encode_record`): as long as any process's.
RECORD: Final = encode_record(LEASE, 12345, "bench-host", None)
#: The scripts a fair semaphore runs, by operation, and their files.
FILES: Final = {Operation.ACQUIRE: "fair_acquire", Operation.RELEASE: "fair_release", Operation.REFRESH: "fair_refresh"}


def scripts_of(checkout: Path) -> dict[Operation, Script]:
    """The fair scripts of a checkout, built as `aiosem._scripts` builds this one's."""
    lua = checkout / "aiosem" / "lua"
    prelude = _lua_header() + "\n" + (lua / "_prelude.lua").read_text(encoding="utf-8")
    built = {}
    for operation, name in FILES.items():
        source = f"{prelude}\n{(lua / f'{name}.lua').read_text(encoding='utf-8')}"
        built[operation] = Script(name, source, hashlib.sha1(source.encode()).hexdigest())  # noqa: S324 -- Redis's name
    return built


@dataclass
class Track:
    """One checkout's scripts, replaying the pattern on a semaphore of their own."""

    label: str
    scripts: dict[Operation, Script]
    keys: SemaphoreKeys
    token: str = field(default_factory=lambda: secrets.token_hex(8))
    holders: list[str] = field(default_factory=list)
    queue: list[str] = field(default_factory=list)
    release_us: list[int] = field(default_factory=list)
    acquire_us: list[int] = field(default_factory=list)

    def identifiers(self, count: int) -> list[str]:
        return [f"{self.token}.{secrets.token_hex(8)}" for _ in range(count)]


@dataclass(frozen=True, slots=True)
class Timing:
    checkout: str
    step: str
    identifiers: int
    steps: int
    p10_us: int
    p50_us: int


async def run_step(client: redis.asyncio.Redis, track: Track, step: Step, identifiers: Sequence[str]) -> None:
    aiosem._fair._SCRIPTS = track.scripts  # noqa: SLF001 -- the checkout's scripts, for this step
    await fair_step(
        client,
        step,
        track.keys,
        identifiers,
        now=None,
        lease=LEASE,
        limit=LIMIT,
        waiter_ttl=WAITER_TTL,
        caller=track.token,
        # A release carries a call id, as the class's do: its receipt is part of its cost.
        call=secrets.token_hex(8) if step is Step.RELEASE else "",
        record=RECORD,
    )


async def last_duration(admin: redis.asyncio.Redis) -> int:
    (entry,) = await admin.slowlog_get(1)
    return int(entry["duration"])


async def replay(port: int, checkouts: Sequence[tuple[str, Path]]) -> list[Timing]:
    client, admin = new_client(port), new_client(port)
    original = aiosem._fair._SCRIPTS  # noqa: SLF001 -- put back at the end
    try:
        tracks = [
            Track(label, scripts_of(path), AsyncFairSemaphore(client, f"scripts-{index}", LIMIT)._keys)  # noqa: SLF001
            for index, (label, path) in enumerate(checkouts)
        ]
        for track in tracks:
            track.holders = track.identifiers(LIMIT)
            await run_step(client, track, Step.WAIT, track.holders)
            track.queue = track.identifiers(QUEUED)
            await run_step(client, track, Step.WAIT, track.queue)
        await admin.config_set("slowlog-log-slower-than", 0)
        for _ in range(ROUNDS):
            for track in tracks:
                await admin.slowlog_reset()
                await run_step(client, track, Step.RELEASE, track.holders)
                track.release_us.append(await last_duration(admin))
                track.holders, track.queue = track.queue[:LIMIT], track.queue[LIMIT:]
                arriving = track.identifiers(LIMIT)
                await admin.slowlog_reset()
                await run_step(client, track, Step.WAIT, arriving)
                track.acquire_us.append(await last_duration(admin))
                track.queue += arriving
    finally:
        aiosem._fair._SCRIPTS = original  # noqa: SLF001
        await client.aclose()
        await admin.aclose()
    timings = []
    for track in tracks:
        for step, durations in (("release", track.release_us), ("acquire", track.acquire_us)):
            ordered = sorted(durations)
            p10, p50 = int(percentile(ordered, 0.1)), int(percentile(ordered, 0.5))
            timings.append(Timing(track.label, step, LIMIT, len(ordered), p10, p50))
    return timings


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--against", type=Path, help="another checkout, whose scripts replay the pattern in turn")
    parser.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    args = parser.parse_args(argv)
    here = Path(__file__).resolve().parent.parent
    checkouts = [("this checkout", here)]
    if args.against is not None:
        if not (args.against / "aiosem" / "lua" / "_prelude.lua").is_file():
            parser.error(f"--against: {args.against} has no aiosem/lua/_prelude.lua")
        checkouts.append((str(args.against), args.against))
    with (
        tempfile.TemporaryDirectory(prefix="aiosem-bench-") as directory,
        RedisServer(redis_server_binary(), Path(directory)) as server,
    ):
        timings = asyncio.run(replay(server.port, checkouts))
        report = {**environment(server.version), "timings": [asdict(timing) for timing in timings]}
    header = ("checkout", "step", "identifiers", "steps", "p10 us", "p50 us")
    rows = [(t.checkout, t.step, str(t.identifiers), str(t.steps), str(t.p10_us), str(t.p50_us)) for t in timings]
    print(markdown_table(header, rows))
    if args.json is not None:
        write_report(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
