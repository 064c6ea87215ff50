"""``python -m aiosem demo`` runs workers on a shared limit and reports what it saw."""

from __future__ import annotations

import subprocess
import sys
from typing import TYPE_CHECKING

import pytest

from aiosem.__main__ import main, redact

if TYPE_CHECKING:
    from tests.harness.support import RedisServer

pytestmark = pytest.mark.slow


def demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aiosem", "demo", "--workers", "2", "--coroutines", "5", "--duration", "1.5", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_demo_on_the_embedded_server() -> None:
    completed = demo()
    assert completed.returncode == 0, completed.stderr
    assert "embedded Redis (fakeredis)" in completed.stdout
    assert "over limit 0" in completed.stdout


def test_demo_on_a_real_server(redis_server: RedisServer) -> None:
    completed = demo("--url", redis_server.admin_url, "--kind", "locked")
    assert completed.returncode == 0, completed.stderr
    assert f"Redis: {redis_server.admin_url}" in completed.stdout
    assert "over limit 0" in completed.stdout


def test_demo_never_prints_a_password() -> None:
    assert redact("redis://user:hunter2@host:6380/0") == "redis://user:***@host:6380/0"
    assert redact("redis://:hunter2@host/0") == "redis://:***@host/0"
    assert redact("redis://host:6379/0") == "redis://host:6379/0"


def test_demo_rejects_a_bad_limit(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--limit", "0"])
    assert "must be at least 1" in capsys.readouterr().err
