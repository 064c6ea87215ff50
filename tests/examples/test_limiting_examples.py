"""The examples of limiting by name run as their docstrings say."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.harness.support import RedisServer

pytestmark = pytest.mark.apps

EXAMPLES = Path(__file__).parents[2] / "examples"


def run(example: str, *arguments: str) -> str:
    completed = subprocess.run(
        [sys.executable, str(EXAMPLES / example), *arguments],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return completed.stdout


def test_the_handler_answers_busy_beyond_the_backends_limit(redis_server: RedisServer) -> None:
    answers = run("handler.py", redis_server.url).splitlines()
    assert len(answers) == 10
    # Ten requests arrive at once; three get the backend, and the others
    # give up within 50 ms, long before any of the three is done.
    assert sum(answer.startswith("200 ") for answer in answers) == 3
    assert sum(answer.startswith("503 ") for answer in answers) == 7
