"""The ``aiosem`` command line.

==============================================  =====================================================
``aiosem demo [--url URL]``                     worker processes share one limit, watched live
``aiosem status [NAME...] [--json] [--watch]``  limit, holders, waiters, tokens and rate, from Redis
``aiosem limit NAME [N | --clear] [--locked]``  show, set or clear the limit in force for everybody
``aiosem reset NAME [--yes] [--rate]``          clear a stuck semaphore; its fencing counter stays
``aiosem --version``                            the installed version
==============================================  =====================================================

``status``, ``limit`` and ``reset`` take the Redis URL from ``--url``, else
from ``AIOSEM_REDIS_URL``. Exit statuses: 0 done; 1 a named semaphore does
not exist, or a reset was not confirmed; 2 a usage error (as argparse's), no
URL, or no ``rich`` for the table; 3 Redis failed or could not be reached,
or a step lock stayed busy for a whole lease; 130 Ctrl-C; 141 the reader of
the output left (``| head``). A failure is told in one line on stderr.
Passwords in URLs are never printed.

``demo`` takes ``--url``, else ``AIOSEM_REDIS_URL``, else serves an
embedded store. A ``status`` NAME with ``*``, ``?`` or ``[`` is a pattern
(``'demo-*'``); ``--watch`` redraws until Ctrl-C, which ends it with 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import secrets
import sys
from importlib.metadata import version
from typing import TYPE_CHECKING, Any, Final, TypeVar
from urllib.parse import unquote, unquote_plus

import redis
from redis.exceptions import RedisClusterException

from ._config import Settings
from ._default_client import ENV_URL
from ._demo import KINDS, Config, embedded_server, interrupts_deferred
from ._demo import main as run_demo
from ._exceptions import RedisUnavailable, SemaphoreError
from ._extras import install_hint
from ._fair import AsyncFairSemaphore
from ._keys import check_prefix
from ._locked import AsyncLockedSemaphore
from ._status import find_names, read_status, reset
from ._urls import CLUSTER_SCHEMES, SENTINEL_SCHEMES, SERVER_SCHEMES, check_url_form, close, connect
from ._validation import check_limit, check_name, check_timeout

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from rich.console import Console
    from rich.text import Text

    from ._connection import Client
    from ._keys import Record
    from ._semaphore import SemaphoreStatistics
    from ._status import SemaphoreStatus

T = TypeVar("T")

#: The lease ``status`` assumes unless told: the library's default ``timeout``.
_DEFAULT_TIMEOUT: Final = Settings().timeout
#: Characters that end a URL's host part: in credentials, they make the URL
#: ambiguous, and a parser could take part of a password for a path or query.
_AMBIGUOUS: Final = re.compile("[/?#]")
#: The start of a redis-py object's repr; the group is the class's name.
_REDIS_REPR: Final = re.compile(r"<redis\.(?:\w+\.)*(\w+)")
#: How often ``status --watch`` reads again, in seconds, unless told.
_WATCH_INTERVAL: Final = 2.0
#: What makes a ``status`` argument a pattern of names rather than a name.
_GLOB: Final = re.compile(r"[*?\[]")
#: The width tables are drawn at when the output is not a terminal.
_UNFOLDED: Final = 1000
_SCHEMES: Final = (*SERVER_SCHEMES, *CLUSTER_SCHEMES, *SENTINEL_SCHEMES)
_EXIT_NOT_FOUND: Final = 1
_EXIT_USAGE: Final = 2
_EXIT_REDIS: Final = 3
_EXIT_INTERRUPTED: Final = 130
_EXIT_BROKEN_PIPE: Final = 141


def redact(url: str) -> str:
    """Return ``url`` with its password, and any ``*password*`` query parameter, replaced by ``***``.

    It reads the text alone, so it never fails, whatever the form: one host
    or several (cluster and sentinel URLs), a Unix socket, a URL too
    malformed to parse. The credentials are everything between ``//`` and
    the last ``@``, so a password with an unencoded ``@`` is hidden whole;
    the user name before their first ``:`` is kept, unless no ``:`` follows
    it (a password may have been written there). Credentials with a ``/``,
    ``?`` or ``#`` make the URL ambiguous -- where does the password end? --
    and all but its scheme is hidden. In the query, the first parameter
    named like ``password`` is hidden with everything after it, as an
    unencoded ``&`` may have cut its value short.
    """
    scheme, slashes, rest = url.partition("//")
    if not slashes:
        scheme, rest = "", url
    credentials, at, rest = rest.rpartition("@")
    if _AMBIGUOUS.search(credentials):
        return f"{scheme}{slashes}***"
    hidden = ""
    if at:
        user, colon, _ = credentials.partition(":")
        hidden = f"{user}:***@" if colon else "***@"
    location, question, query = rest.partition("?")
    shown = []
    for parameter in query.split("&") if question else ():
        key = parameter.partition("=")[0]
        if "password" in unquote(key).lower():
            shown.append(f"{key}=***")
            break
        shown.append(parameter)
    return f"{scheme}{slashes}{hidden}{location}{question}{'&'.join(shown)}"


class _Refusal(Exception):
    """Ends a command with a one-line message on stderr and an exit status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _lease(text: str) -> float:
    try:
        return check_timeout(float(text), "--timeout")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _limit_value(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"limit must be a whole number, got {text!r}") from None
    try:
        return check_limit(value)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _prefix(text: str) -> str:
    try:
        return check_prefix(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _name(text: str) -> str:
    try:
        return check_name(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _add_redis_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        help=f"redis://, rediss://, unix://, redis+cluster:// or redis+sentinel:// (default: ${ENV_URL})",
    )
    parser.add_argument(
        "--prefix", type=_prefix, default=Settings().prefix, help="the prefix of the keys (default: aiosem)"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aiosem", description="Distributed counting semaphores on Redis.")
    parser.add_argument("--version", action="version", version=f"aiosem {version('aiosem')}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="worker processes share one limit; watch that it is never exceeded",
        description="Several worker processes share one limit; a live view shows how many hold at once.",
    )
    demo.add_argument(
        "--url", help=f"a Redis URL (default: ${ENV_URL}, else an embedded fakeredis server on a loopback port)"
    )
    demo.add_argument("--kind", choices=KINDS, default="fair", help="which semaphore or recipe (default: fair)")
    demo.add_argument("--workers", type=_positive_int, default=4, help="worker processes (default: 4)")
    demo.add_argument("--coroutines", type=_positive_int, default=10, help="coroutines per worker (default: 10)")
    demo.add_argument("--limit", type=_positive_int, default=3, help="permits shared by all (default: 3)")
    demo.add_argument("--duration", type=_positive_float, default=10.0, help="seconds to run (default: 10)")
    demo.add_argument("--hold", type=_positive_float, default=0.02, help="mean seconds a permit is held")

    status = commands.add_parser(
        "status",
        help="show semaphores as Redis has them: limit, holders, waiters, tokens, rate",
        description=(
            "Show each named semaphore, or every one under the prefix: its limit, its holders with their "
            "fencing tokens, host, process id and label, and what is left of their leases (remaining = last "
            "confirmation + lease - now, on Redis's clock), its waiters in queue order, the last fencing token, "
            "and the rate limiter of the same name."
        ),
    )
    status.add_argument(
        "names",
        nargs="*",
        type=_name,
        metavar="NAME",
        help="semaphores to show, or patterns of names with *, ? or [...] (default: all)",
    )
    _add_redis_arguments(status)
    status.add_argument(
        "--timeout",
        type=_lease,
        default=_DEFAULT_TIMEOUT,
        help=(
            "the lease to assume, in seconds, for a holder that records none of its own (a client of the book's "
            f"recipes) (default: {_DEFAULT_TIMEOUT:g})"
        ),
    )
    status.add_argument("--json", action="store_true", help="print JSON, in a documented schema, instead of a table")
    status.add_argument(
        "--watch",
        nargs="?",
        type=_positive_float,
        const=_WATCH_INTERVAL,
        metavar="SECONDS",
        help=f"read and show again every SECONDS (default: {_WATCH_INTERVAL:g}) until Ctrl-C",
    )

    limit = commands.add_parser(
        "limit",
        help="show, set or clear the limit in force for every process",
        description=(
            "Without N or --clear, show the limit in force and whether it was set, changing nothing. With N, "
            "set it: in force at once for every process, whatever limit each brings, until cleared; raising "
            "it grants waiters at once, lowering it takes no permit back. With --clear, clear a set limit: "
            "the next acquire's limit applies."
        ),
    )
    limit.add_argument("name", type=_name, metavar="NAME", help="the semaphore")
    change = limit.add_mutually_exclusive_group()
    change.add_argument("limit", nargs="?", type=_limit_value, metavar="N", help="the limit to set (at least 1)")
    change.add_argument("--clear", action="store_true", help="clear a set limit")
    _add_redis_arguments(limit)
    limit.add_argument(
        "--locked",
        action="store_true",
        help="set or clear it as AsyncLockedSemaphore does, without Lua, for a server that forbids scripting",
    )

    reset_ = commands.add_parser(
        "reset",
        help="clear a stuck semaphore: its permits, queue, limit and lock; keep its fencing counter",
        description=(
            "Delete a semaphore's permits, waiters, limit (a set one too) and step lock in one transaction. Its "
            "fencing counter is kept, so the next grant's token is higher than any before. Holders find their "
            "permit lost at their next refresh."
        ),
    )
    reset_.add_argument("name", type=_name, metavar="NAME", help="the semaphore to reset")
    _add_redis_arguments(reset_)
    reset_.add_argument("--rate", action="store_true", help="also reset the rate limiter of the same name")
    reset_.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status.

    A command that fails says why in one line on stderr. Ctrl-C ends any
    command quietly (130); so does a reader that stops reading, as ``head``
    does (141): the statuses a shell gives to a command killed by SIGINT
    and SIGPIPE.
    """
    args = _parser().parse_args(argv)
    command = {"demo": _demo, "status": _status, "limit": _limit, "reset": _reset}[args.command]
    try:
        return command(args)
    except _Refusal as refusal:
        print(f"aiosem {args.command}: error: {refusal}", file=sys.stderr)
        return refusal.status
    except KeyboardInterrupt:
        return _EXIT_INTERRUPTED
    except BrokenPipeError:
        # What is still buffered for stdout would fail again as Python exits.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return _EXIT_BROKEN_PIPE


def _demo(args: argparse.Namespace) -> int:
    with interrupts_deferred():
        return _run_demo(args)


def _run_demo(args: argparse.Namespace) -> int:
    limit = 1 if args.kind in ("recipe-lock", "recipe-lock-with-timeout") else args.limit

    def config(url: str) -> Config:
        return Config(
            url=url,
            kind=args.kind,
            name=f"demo-{secrets.token_hex(4)}",
            limit=limit,
            workers=args.workers,
            coroutines=args.coroutines,
            duration=args.duration,
            hold=args.hold,
        )

    # As status and reset: --url, else the environment's; memory:// there
    # (one process's store) means the embedded server the workers can share.
    url = args.url if args.url is not None else os.environ.get(ENV_URL) or None
    if url is not None and not url.lower().startswith("memory://"):
        print(f"Redis: {redact(url)}")
        try:
            return run_demo(config(url), embedded=False)
        except _REDIS_FAILURES as error:
            raise _failure(error, url) from None
    try:
        server = embedded_server()
        url = server.__enter__()
    except ModuleNotFoundError as error:
        raise _Refusal(
            f"the embedded server needs {error.name}: {install_hint('memory')}, or pass --url", _EXIT_USAGE
        ) from None
    try:
        return run_demo(config(url), embedded=True)
    finally:
        server.__exit__(None, None, None)


def _url(args: argparse.Namespace) -> str:
    """The Redis URL of a command, checked without connecting."""
    url: str | None = args.url or os.environ.get(ENV_URL)
    if not url:
        raise _Refusal(f"no Redis URL: pass --url or set {ENV_URL}", _EXIT_USAGE)
    scheme, separator, rest = url.partition("://")
    if scheme.lower() == "memory":
        raise _Refusal("memory:// is a store inside one process: give the URL of the Redis to inspect", _EXIT_USAGE)
    if not separator or scheme.lower() not in _SCHEMES:
        schemes = ", ".join(f"{known}://" for known in _SCHEMES)
        raise _Refusal(f"{redact(url)} is not a Redis URL: one starts with {schemes}", _EXIT_USAGE)
    if _AMBIGUOUS.search(rest.rpartition("@")[0]):
        raise _Refusal(
            f"{redact(url)}: a '/', '?' or '#' before the last '@' makes the URL ambiguous: "
            "percent-encode them in the credentials (%2F, %3F, %23), and any '@' in the query (%40)",
            _EXIT_USAGE,
        )
    try:
        check_url_form(url, "--url")
    except ValueError as error:
        raise _Refusal(str(error), _EXIT_USAGE) from None
    return url


def _on_redis(url: str, work: Callable[[Client], Awaitable[T]]) -> T:
    """Run ``work`` with a client of ``url``, closed afterwards; fail with one line, the URL redacted."""
    try:
        client = connect(url)
    except ValueError as error:
        # redis-py's parsing: of a URL whose credentials are unambiguous, it
        # quotes the path, query or port, never the password.
        raise _Refusal(f"--url: {error}", _EXIT_USAGE) from None

    async def run() -> T:
        try:
            return await work(client)
        finally:
            await close(client)

    try:
        return asyncio.run(run())
    except _REDIS_FAILURES as error:
        raise _failure(error, url) from None


#: What a command that talks to Redis may fail with, told in one line.
_REDIS_FAILURES: Final = (redis.RedisError, RedisClusterException, OSError, asyncio.TimeoutError)


def _failure(error: BaseException, url: str) -> _Refusal:
    """The one line that ends a command when Redis at ``url`` failed with ``error``."""
    if isinstance(error, RedisUnavailable):
        return _Refusal(_describe(error, url), _EXIT_REDIS)  # it names the Redis itself
    unreachable = " is unreachable" if isinstance(error, (redis.ConnectionError, OSError)) else ""
    return _Refusal(f"Redis at {redact(url)}{unreachable}: {_describe(error, url)}", _EXIT_REDIS)


def _describe(error: BaseException, url: str) -> str:
    """``error`` in one line, with no password of ``url`` and no redis-py object in it.

    Some messages show a client's repr -- Sentinel's "No master found" shows
    each sentinel's -- and redis-py releases before the fix of
    CVE-2026-32597 put the password in a connection pool's. The passwords
    are replaced first, whole, before the reprs are cut out.
    """
    message = str(error) or type(error).__name__
    for secret in _passwords(url):
        message = message.replace(secret, "***")
    return " ".join(_without_reprs(message).split())


def _passwords(url: str) -> list[str]:
    """The passwords in ``url`` in every form a message may show them, longest first."""
    credentials, at, rest = url.partition("://")[2].rpartition("@")
    user, colon, password = credentials.partition(":")
    found = [password if colon else user] if at else []
    for parameter in rest.partition("?")[2].split("&"):
        key, _, value = parameter.partition("=")
        if "password" in unquote(key).lower():
            found.append(value)
    forms = {form for value in found for form in (value, unquote(value), unquote_plus(value))}
    forms |= {repr(form)[1:-1] for form in forms}
    return sorted(filter(None, forms), key=len, reverse=True)


def _without_reprs(message: str) -> str:
    """``message`` with each ``<redis.…>`` repr, however nested, replaced by its class's name."""
    parts = []
    position = 0
    while (match := _REDIS_REPR.search(message, position)) is not None:
        parts.append(message[position : match.start()] + match[1])
        position, depth = len(message), 0
        for index in range(match.start(), len(message)):
            depth += {"<": 1, ">": -1}.get(message[index], 0)
            if depth == 0:
                position = index + 1
                break
    parts.append(message[position:])
    return "".join(parts)


def _status(args: argparse.Namespace) -> int:
    url = _url(args)
    if not args.json:
        try:
            import rich  # noqa: F401, PLC0415 -- an optional dependency, checked before Redis is read
        except ImportError:
            raise _Refusal(f"the table needs rich: {install_hint('cli')}, or pass --json", _EXIT_USAGE) from None
    arguments = list(dict.fromkeys(args.names))
    names = [argument for argument in arguments if not _GLOB.search(argument)]
    patterns = [argument for argument in arguments if _GLOB.search(argument)]

    async def read(client: Client) -> list[SemaphoreStatus]:
        found = names
        if patterns or not names:
            found = list(dict.fromkeys([*names, *await find_names(client, args.prefix, patterns)]))
        return [await read_status(client, args.prefix, name, args.timeout) for name in found]

    if args.watch is not None:
        return _watch(url, read, args)
    statuses = _on_redis(url, read)
    _show(statuses, args)
    missing = [status.name for status in statuses if not status.exists]
    for name in missing:
        print(f"aiosem status: no semaphore {name!r} under prefix {args.prefix!r}", file=sys.stderr)
    return _EXIT_NOT_FOUND if missing else 0


def _watch(url: str, read: Callable[[Client], Awaitable[list[SemaphoreStatus]]], args: argparse.Namespace) -> int:
    """Read and show the semaphores every ``args.watch`` seconds until Ctrl-C, which ends it quietly with 0.

    A name not found is shown as such, not an error: it may appear meanwhile.
    """

    async def loop(client: Client) -> None:
        while True:
            _show(await read(client), args, again=True)
            await asyncio.sleep(args.watch)

    # Ctrl-C is how a watch ends: not an error.
    with contextlib.suppress(KeyboardInterrupt):
        _on_redis(url, loop)
    return 0


def _show(statuses: Sequence[SemaphoreStatus], args: argparse.Namespace, *, again: bool = False) -> None:
    """Print ``statuses`` as JSON or as tables; ``again``: as the next frame of ``--watch``.

    Watched, the JSON is one document per line (JSON Lines), and the tables
    replace the last ones on a terminal.
    """
    if args.json:
        document = _as_json(statuses, args.prefix, args.timeout)
        print(json.dumps(document) if again else json.dumps(document, indent=2), flush=True)
    else:
        _print_tables(statuses, args.prefix, args.timeout, clear=again)


def _as_json(statuses: Sequence[SemaphoreStatus], prefix: str, timeout: float) -> dict[str, Any]:
    """The ``--json`` document; its schema is documented in docs/cli.md."""
    return {
        "prefix": prefix,
        "timeout": timeout,
        "semaphores": [
            {
                "name": status.name,
                "key": status.key,
                "exists": status.exists,
                "time": status.time,
                "limit": status.limit,
                "limit_set": status.limit_set,
                "last_token": status.last_token,
                "held": status.held,
                "holders": [
                    {
                        "identifier": holder.identifier,
                        "weight": holder.weight,
                        "fencing_token": holder.fencing_token,
                        "age": round(holder.age, 6),
                        "lease": holder.lease,
                        "lease_recorded": holder.record is not None,
                        "remaining": round(holder.remaining, 6),
                        "expired": holder.expired,
                        **_who(holder.record),
                    }
                    for holder in status.holders
                ],
                "waiting": len(status.waiters),
                "waiters": [
                    {
                        "identifier": waiter.identifier,
                        "weight": waiter.weight,
                        "ticket": waiter.ticket,
                        "place": waiter.place,
                    }
                    | _who(waiter.record)
                    for waiter in status.waiters
                ],
                "rate": None if status.rate_ahead is None else {"ahead": round(status.rate_ahead, 6)},
                "lock": (
                    None
                    if not status.locked
                    else {"expires_in": None if status.lock_expires_in is None else round(status.lock_expires_in, 3)}
                ),
            }
            for status in statuses
        ],
    }


def _who(record: Record | None) -> dict[str, Any]:
    """A holder's or waiter's host, process id and label, as JSON; ``null`` each for one that recorded none."""
    if record is None:
        return {"host": None, "pid": None, "label": None}
    return {"host": record.host, "pid": record.pid, "label": record.label}


def _print_tables(statuses: Sequence[SemaphoreStatus], prefix: str, timeout: float, *, clear: bool = False) -> None:
    """One row per semaphore, then a table of the holders and one of the waiters of each that has any."""
    from rich.console import Console  # noqa: PLC0415 -- an optional dependency
    from rich.table import Table  # noqa: PLC0415
    from rich.text import Text  # noqa: PLC0415

    console = Console()
    if not console.is_terminal:
        # Piped or captured: no screen to fit, and a name folded over two lines is hard to find.
        console = Console(width=_UNFOLDED)
    elif clear:
        console.clear()
    if not statuses:
        console.print(Text(f"no semaphores under prefix {prefix!r}"))
        return
    summary = Table(
        title=Text(f"semaphores under prefix {prefix!r}"),
        caption=(
            "remaining = last confirmation + lease - now, on Redis's clock; "
            f"a lease marked * is assumed (--timeout {timeout:g}): its holder recorded none"
        ),
    )
    for column in ("name", "limit", "held", "waiting", "last token", "rate ahead", "lock"):
        summary.add_column(column, justify="left" if column == "name" else "right")
    for status in statuses:
        if not status.exists:
            summary.add_row(Text(status.name), "not found", "", "", "", "", "")
            continue
        expired = sum(holder.expired for holder in status.holders)
        summary.add_row(
            Text(status.name),
            "-" if status.limit is None else _limit_text(status.limit, status.limit_set),
            f"{status.held} (+{expired} expired)" if expired else str(status.held),
            str(len(status.waiters)),
            "-" if status.last_token is None else str(status.last_token),
            "-" if status.rate_ahead is None else f"{status.rate_ahead:.3f} s",
            _lock_cell(status),
        )
    console.print(summary)
    for status in statuses:
        _print_holders_and_waiters(console, status)


def _print_holders_and_waiters(console: Console, status: SemaphoreStatus) -> None:
    from rich.table import Table  # noqa: PLC0415 -- an optional dependency
    from rich.text import Text  # noqa: PLC0415

    if status.holders:
        holders = Table(title=Text(f"holders of {status.name!r}"))
        for column in ("fencing token", "identifier", "weight", "host", "pid", "label", "age", "lease", "remaining"):
            holders.add_column(column, justify="right" if column in _NUMERIC else "left")
        for holder in status.holders:
            holders.add_row(
                str(holder.fencing_token),
                Text(holder.identifier),
                str(holder.weight),
                *_who_cells(holder.record),
                f"{holder.age:.3f} s",
                f"{holder.lease:g} s" if holder.record is not None else f"{holder.lease:g} s *",
                "expired" if holder.expired else f"{holder.remaining:.3f} s",
                style="dim" if holder.expired else None,
            )
        console.print(holders)
    if status.waiters:
        waiters = Table(title=Text(f"waiters of {status.name!r}, in queue order"))
        for column in ("place", "identifier", "weight", "host", "pid", "label"):
            waiters.add_column(column, justify="right" if column in _NUMERIC else "left")
        for waiter in status.waiters:
            waiters.add_row(str(waiter.place), Text(waiter.identifier), str(waiter.weight), *_who_cells(waiter.record))
        console.print(waiters)


#: The columns of the holders' and waiters' tables that are right-justified.
_NUMERIC: Final = frozenset(("fencing token", "weight", "pid", "age", "lease", "remaining", "place"))


def _who_cells(record: Record | None) -> tuple[Text, str, Text]:
    """Host, process id and label, for a table: '-' for what was not recorded."""
    from rich.text import Text  # noqa: PLC0415 -- an optional dependency

    if record is None:
        return Text("-"), "-", Text("-")
    return Text(record.host), str(record.pid), Text("-" if record.label is None else record.label)


def _limit_text(limit: int, limit_set: bool) -> str:
    """A limit in force, marked if it was set (a limit its users brought is not)."""
    return f"{limit} (set)" if limit_set else str(limit)


def _lock_cell(status: SemaphoreStatus) -> str:
    if not status.locked:
        return "-"
    return "held" if status.lock_expires_in is None else f"held, {status.lock_expires_in:.3f} s left"


def _limit(args: argparse.Namespace) -> int:
    """Show the limit in force, or set or clear it; say so in one line."""
    url = _url(args)
    name = repr(args.name)
    if args.limit is None and not args.clear:
        # Read as status reads: no Lua, nothing changed.
        status = _on_redis(url, lambda client: read_status(client, args.prefix, args.name, _DEFAULT_TIMEOUT))
        shown = "no limit in force" if status.limit is None else f"limit {_limit_text(status.limit, status.limit_set)}"
        print(f"{name}: {shown}; {status.held} held, {len(status.waiters)} waiting")
        return 0
    kind = AsyncLockedSemaphore if args.locked else AsyncFairSemaphore

    async def step(client: Client) -> tuple[bool, int | None, SemaphoreStatistics]:
        # Whether a limit was set, for the message only: the step itself decides.
        was_set = args.clear and (await read_status(client, args.prefix, args.name, _DEFAULT_TIMEOUT)).limit_set
        # Made without a limit: it brings none, so it neither stores one nor meets a mismatch.
        semaphore = kind(client, args.name, None, prefix=args.prefix)
        try:
            before = await semaphore.set_limit(args.limit)
            return was_set, before, semaphore.statistics()
        finally:
            await semaphore.aclose()

    try:
        was_set, before, after = _on_redis(url, step)
    except SemaphoreError as error:  # Redis's own errors became a _Refusal: here, a step lock that stayed busy
        raise _Refusal(_describe(error, url), _EXIT_REDIS) from None
    if args.limit is not None:
        was = "none" if before is None else before
        print(f"{name}: limit {args.limit} (was {was}); {after.holders} held, {after.waiting} waiting")
    elif after.limit is None:
        cleared = f"limit cleared (was {before})" if was_set else "no limit was set"
        print(f"{name}: {cleared}; the next acquire's limit applies")
    elif was_set:
        # Cleared while in use: as if its users had brought it.
        print(f"{name}: limit cleared (was {before}); it stays in force as its users' while they hold or wait")
    else:
        print(f"{name}: no limit was set; limit {after.limit}, brought by its users, stays while they hold or wait")
    return 0


def _reset(args: argparse.Namespace) -> int:
    url = _url(args)
    if not args.yes and not sys.stdin.isatty():
        raise _Refusal("stdin is not a terminal, so the reset cannot be confirmed: pass --yes", _EXIT_USAGE)
    if not args.yes:
        status = _on_redis(url, lambda client: read_status(client, args.prefix, args.name, _DEFAULT_TIMEOUT))
        if not status.exists:
            raise _Refusal(f"no semaphore {args.name!r} under prefix {args.prefix!r}", _EXIT_NOT_FOUND)
        rate = " and the state of its rate limiter" if args.rate else ""
        kept = "no fencing token issued yet" if status.last_token is None else f"last token {status.last_token}"
        limit = f"the limit set ({status.limit})" if status.limit_set else "its limit"
        print(
            f"Resetting {args.name!r} ({status.key}) deletes {len(status.holders)} permit(s), "
            f"{len(status.waiters)} waiter(s), {limit} and its step lock{rate}; "
            f"its fencing counter stays ({kept})."
        )
        try:
            answer = input("Type the name to confirm: ")
        except (EOFError, KeyboardInterrupt):
            answer = None
        if answer != args.name:
            raise _Refusal("not confirmed; nothing was deleted", _EXIT_NOT_FOUND)
    done = _on_redis(url, lambda client: reset(client, args.prefix, args.name, rate=args.rate))
    if not done.existed:
        raise _Refusal(f"no semaphore {args.name!r} under prefix {args.prefix!r}", _EXIT_NOT_FOUND)
    rate = " and its rate limiter's state" if args.rate else ""
    counter = (
        "no fencing token was ever issued"
        if done.last_token is None
        else f"the fencing counter stays at {done.last_token}: the next grant's token is higher"
    )
    print(f"reset {args.name!r}: deleted {done.holders} permit(s), {done.waiters} waiter(s){rate}; {counter}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
