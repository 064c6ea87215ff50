"""The examples run as their docstrings say."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.support import RedisServer

EXAMPLES = Path(__file__).parent.parent / "examples"


def test_limit_db_queries(redis_server: RedisServer) -> None:
    completed = subprocess.run(
        [sys.executable, str(EXAMPLES / "limit_db_queries.py"), redis_server.url],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    tokens = [int(line.rsplit(" ", 1)[1]) for line in completed.stdout.splitlines()]
    assert len(tokens) == 12
    assert len(set(tokens)) == 12
