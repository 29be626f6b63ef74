"""The registry through Redis Sentinel (``redis+sentinel://``): a password-protected master,
its replica and a Sentinel, all real servers; a kvstore registers through the Sentinel URL,
the master fails over to the replica, and the kvstore's heartbeats go on into the new
master without a restart. Bad Sentinel URLs stop a start naming what is wrong."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from pdserve.local.launcher import Launcher, free_port
from pdserve.local.redis_server import find_redis_server, start_redis
from tests.helpers.clusters import running

PASSWORD = "a-sentinel-test-password"
SERVICE = "registry"
WAIT_S = 30.0


def _conf(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


def _until(what, deadline_s: float = WAIT_S, every_s: float = 0.2):
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            got = what()
        except redis.RedisError:
            got = None
        if got:
            return got
        assert time.monotonic() < deadline, f"not within {deadline_s} s: {what}"
        time.sleep(every_s)


@pytest.fixture
def sentinel_set(tmp_path):
    """(master, replica port, Sentinel port); each server stopped after the test."""
    master = start_redis(password=PASSWORD)
    launcher = Launcher(tmp_path / "servers")
    binary = find_redis_server()
    replica_port, sentinel_port = free_port(), free_port()
    auth = f'requirepass "{PASSWORD}"\nmasterauth "{PASSWORD}"\n'
    replica = launcher.start(
        "replica",
        [binary, _conf(tmp_path / "replica.conf", auth + f"replicaof 127.0.0.1 {master.port}\n")]
        + ["--port", str(replica_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        + ["--dir", str(tmp_path)],
    )
    sentinel_conf = (
        f"port {sentinel_port}\nbind 127.0.0.1\ndir {tmp_path}\n"
        f"sentinel monitor {SERVICE} 127.0.0.1 {master.port} 1\n"
        f'sentinel auth-pass {SERVICE} "{PASSWORD}"\n'
        f"sentinel down-after-milliseconds {SERVICE} 1000\n"
        f"sentinel failover-timeout {SERVICE} 10000\n"
    )
    sentinel = launcher.start(
        "sentinel", [binary, _conf(tmp_path / "sentinel.conf", sentinel_conf), "--sentinel"]
    )
    try:
        ask = redis.Redis(port=sentinel_port, socket_timeout=2)
        _until(lambda: ask.sentinel_slaves(SERVICE))  # it found the replica
        yield master, replica_port, sentinel_port
    finally:
        launcher.stop([sentinel, replica])
        master.stop()


def _entries(port: int) -> list[dict]:
    r = redis.Redis(port=port, password=PASSWORD, socket_timeout=2)
    return [json.loads(r.get(k)) for k in r.scan_iter(match="pdserve:worker:*")]


def test_a_kvstore_registers_through_sentinel_and_follows_a_failover(sentinel_set, tmp_path):
    master, replica_port, sentinel_port = sentinel_set
    url = f"redis+sentinel://:{PASSWORD}@127.0.0.1:{sentinel_port}/{SERVICE}/0"
    with running(tmp_path / "logs") as c:
        kvstore = c.start(  # the URL by its variable, as the chart gives it
            "kvstore",
            "pdserve.kvstore",
            *("--capacity-bytes", "16MiB", "--registry-ttl", "3"),
            env={"PDSERVE_REDIS_URL": url},
        )
        (entry,) = _until(lambda: _entries(master.port))
        assert entry["address"] == kvstore.address

        ask = redis.Redis(port=sentinel_port, socket_timeout=2)
        ask.execute_command("SENTINEL", "FAILOVER", SERVICE)
        _until(lambda: ask.sentinel_get_master_addr_by_name(SERVICE)[1] == replica_port)
        # The new master gets the kvstore's heartbeats: its entry is written there again.
        before = entry["updated_at"]
        _until(
            lambda: [e for e in _entries(replica_port) if e["updated_at"] > before + 1],
            deadline_s=WAIT_S,
        )
        assert kvstore.alive()
        log = kvstore.log_text()
    assert "redis+sentinel://:***@" in log and PASSWORD not in log  # logged redacted
    assert c.unhandled_errors() == []


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis+sentinel://127.0.0.1:26379", "names the master's service"),
        ("redis+sentinel:///registry", "at least one Sentinel"),
        ("redis+sentinel://127.0.0.1:x/registry", "port is a number"),
        ("redis+sentinel://127.0.0.1/registry?db=2", "only ?sentinel_password="),
    ],
)
def test_a_bad_sentinel_url_stops_the_start(url, message):
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.kvstore", "--redis-url", url],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr
