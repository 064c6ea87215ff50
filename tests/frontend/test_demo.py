"""``python -m aiosem demo`` runs workers on a shared limit and reports what it saw."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import TYPE_CHECKING

import pytest
import redis

from aiosem.__main__ import main, redact
from aiosem._default_client import ENV_URL

if TYPE_CHECKING:
    from tests.harness.support import RedisServer

pytestmark = pytest.mark.slow


def demo(*args: str, url_in_environment: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run the demo briefly; ``$AIOSEM_REDIS_URL`` is ``url_in_environment``, or unset."""
    environment = {key: value for key, value in os.environ.items() if key != ENV_URL}
    if url_in_environment is not None:
        environment[ENV_URL] = url_in_environment
    return subprocess.run(
        [sys.executable, "-m", "aiosem", "demo", "--workers", "2", "--coroutines", "5", "--duration", "1.5", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=environment,
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


def test_demo_takes_the_url_from_the_environment_without_url(fresh_redis_server: RedisServer) -> None:
    completed = demo(url_in_environment=fresh_redis_server.admin_url)
    assert completed.returncode == 0, completed.stderr
    assert f"Redis: {fresh_redis_server.admin_url}" in completed.stdout
    with redis.Redis.from_url(fresh_redis_server.admin_url) as admin:
        assert int(admin.info("stats")["total_commands_processed"]) > 100  # the workers' steps, not a probe


def test_url_takes_precedence_over_the_environment(fresh_redis_server: RedisServer) -> None:
    completed = demo("--url", fresh_redis_server.admin_url, url_in_environment="redis://127.0.0.1:1/0")
    assert completed.returncode == 0, completed.stderr
    assert f"Redis: {fresh_redis_server.admin_url}" in completed.stdout


@pytest.mark.parametrize("kind", ["fair", "locked", "recipe-fair"])
def test_demo_leaves_nothing_that_status_lists(fresh_redis_server: RedisServer, kind: str) -> None:
    completed = demo("--url", fresh_redis_server.admin_url, "--kind", kind)
    assert completed.returncode == 0, completed.stderr
    status = subprocess.run(
        [sys.executable, "-m", "aiosem", "status", "--url", fresh_redis_server.admin_url, "--json", "demo-*"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(status.stdout)["semaphores"] == []
    with redis.Redis.from_url(fresh_redis_server.admin_url) as admin:
        left = admin.keys("*")
        # Only the receipts of the last releases, which expire within a lease.
        assert all(b":receipt:" in key and 0 < admin.pttl(key) <= 10_000 for key in left), left

    assert redact("redis://user:hunter2@host:6380/0") == "redis://user:***@host:6380/0"
    assert redact("redis://:hunter2@host/0") == "redis://:***@host/0"
    assert redact("redis://host:6379/0") == "redis://host:6379/0"


def test_demo_rejects_a_bad_limit(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--limit", "0"])
    assert "must be at least 1" in capsys.readouterr().err
