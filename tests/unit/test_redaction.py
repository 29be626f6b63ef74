"""Secrets out of what pdserve prints: Redis passwords masked in URLs, settings, registry
errors and `pdserve status`."""

from __future__ import annotations

import pytest

from pdserve.controlplane.view import RegistryView
from pdserve.settings.process import RedisSettings, RegistrySettings
from pdserve.settings.redaction import redact_url
from pdserve.settings.services import DecodeSettings


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:hunter2@10.0.0.5:6379/0", "redis://:***@10.0.0.5:6379/0"),
        ("rediss://app:hunter2@redis.example:6380/1", "rediss://app:***@redis.example:6380/1"),
        (
            "redis://10.0.0.5:6379/0?password=hunter2&db=1",
            "redis://10.0.0.5:6379/0?password=***&db=1",
        ),
        ("redis://[::1]:6379/0", "redis://[::1]:6379/0"),
        ("redis://:hunter2@[::1]:6379", "redis://:***@[::1]:6379"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://user@127.0.0.1/0", "redis://user@127.0.0.1/0"),
        (None, None),
    ],
)
def test_redact_url_masks_passwords_only(url, shown):
    assert redact_url(url) == shown


def test_a_redis_password_stays_out_of_settings_and_errors():
    url = "redis://:hunter2@127.0.0.1:1/0"
    settings = DecodeSettings(registry=RegistrySettings(redis=RedisSettings(url)))
    assert "hunter2" not in repr(settings) and "redis://:***@127.0.0.1:1/0" in repr(settings)
    view = RegistryView(url)
    assert "hunter2" not in view.describe("decode") and "hunter2" not in repr(view)


def test_status_prints_no_redis_password(capsys):
    from pdserve.status import main

    assert main(["--redis-url", "redis://:hunter2@127.0.0.1:1/0"]) == 1
    err = capsys.readouterr().err
    assert "hunter2" not in err and "redis://:***@127.0.0.1:1/0" in err


def test_sentinel_urls_keep_their_hosts_and_lose_both_passwords():
    from pdserve.settings.redis_url import parse_sentinel_url

    url = "redis+sentinel://:p%40ss@10.0.0.1,[::1]:26380/registry/2?sentinel_password=s3cret"
    shown = redact_url(url)
    assert shown == (
        "redis+sentinel://:***@10.0.0.1:26379,[::1]:26380/registry/2?sentinel_password=***"
    )
    spec = parse_sentinel_url(url)
    assert (spec.password, spec.sentinel_password) == ("p@ss", "s3cret")
    assert spec.sentinels == (("10.0.0.1", 26379), ("::1", 26380)) and spec.db == 2
    assert "s3cret" not in repr(spec) and "p@ss" not in repr(spec)
