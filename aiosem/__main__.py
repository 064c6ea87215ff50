"""The ``aiosem`` command line: ``python -m aiosem demo [--url redis://…]``."""

from __future__ import annotations

import argparse
import secrets
import sys
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from ._demo import KINDS, Config, embedded_server
from ._demo import main as run_demo

if TYPE_CHECKING:
    from collections.abc import Sequence


def redact(url: str) -> str:
    """Return ``url`` with any password replaced by ``***``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="aiosem", description="Distributed counting semaphores on Redis.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="worker processes share one limit; watch that it is never exceeded",
        description="Several worker processes share one limit; a live view shows how many hold at once.",
    )
    demo.add_argument("--url", help="a Redis URL (default: an embedded fakeredis server on a loopback port)")
    demo.add_argument("--kind", choices=KINDS, default="fair", help="which semaphore or recipe (default: fair)")
    demo.add_argument("--workers", type=_positive_int, default=4, help="worker processes (default: 4)")
    demo.add_argument("--coroutines", type=_positive_int, default=10, help="coroutines per worker (default: 10)")
    demo.add_argument("--limit", type=_positive_int, default=3, help="permits shared by all (default: 3)")
    demo.add_argument("--duration", type=_positive_float, default=10.0, help="seconds to run (default: 10)")
    demo.add_argument("--hold", type=_positive_float, default=0.02, help="mean seconds a permit is held")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    args = _parser().parse_args(argv)
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

    if args.url is not None:
        print(f"Redis: {redact(args.url)}")
        return run_demo(config(args.url), embedded=False)
    try:
        server = embedded_server()
        url = server.__enter__()
    except ModuleNotFoundError as error:
        print(f"the embedded server needs {error.name}: pip install 'aiosem[memory]', or pass --url", file=sys.stderr)
        return 2
    try:
        return run_demo(config(url), embedded=True)
    finally:
        server.__exit__(None, None, None)


if __name__ == "__main__":
    sys.exit(main())
