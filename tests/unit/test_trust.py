"""Internal trust without processes: the security settings' checks, the token file,
secrets to children by environment (never argv), the kvstore's ``--block-layout``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pdserve.core.errors import SettingsError
from pdserve.kv.blocks import BlockLayout
from pdserve.kvstore.store import BlockStore, layout_from_text, layout_to_text
from pdserve.runtime.trust_files import read_token
from pdserve.settings.commands import UpSettings
from pdserve.settings.flags import parse_settings, secret_env, to_argv
from pdserve.settings.process import InternalSecuritySettings, RedisSettings, RegistrySettings
from pdserve.settings.services import DecodeSettings

ROOT = Path(__file__).resolve().parents[2]

TOKEN = "a-token-long-enough-for-the-check"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"internal_token": "short"}, "at least 16 characters"),
        ({"internal_token": TOKEN, "internal_token_file": "/t"}, "pass the internal token once"),
        ({"tls_cert": "/c"}, "--tls-cert and --tls-key go together"),
        ({"tls_key": "/k"}, "--tls-cert and --tls-key go together"),
        ({"tls_client_ca": "/ca"}, "--tls-client-ca .mutual TLS. needs --tls-cert"),
        ({"tls_server_name": "pdserve"}, "--tls-server-name applies to TLS only"),
    ],
)
def test_security_settings_refuse_what_cannot_work(values, message):
    with pytest.raises(SettingsError, match=message):
        InternalSecuritySettings(**values)


def test_the_token_file_is_read_and_checked(tmp_path):
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}  \nignored\n")
    assert read_token(InternalSecuritySettings(internal_token_file=str(path))) == TOKEN
    path.write_text("short\n")
    with pytest.raises(SettingsError, match="--internal-token-file .*at least 16"):
        read_token(InternalSecuritySettings(internal_token_file=str(path)))
    with pytest.raises(SettingsError, match="--internal-token-file .*cannot read it"):
        read_token(InternalSecuritySettings(internal_token_file=str(tmp_path / "none")))


def test_children_get_secrets_by_environment_not_argv(monkeypatch):
    url = "redis://:hunter2@127.0.0.1:6379/0"
    settings = DecodeSettings(
        registry=RegistrySettings(redis=RedisSettings(url)),
        security=InternalSecuritySettings(internal_token=TOKEN),
    )
    argv = to_argv(settings, secrets=False)
    assert TOKEN not in " ".join(argv) and "hunter2" not in " ".join(argv)
    env = secret_env(settings)
    assert env == {"PDSERVE_INTERNAL_TOKEN": TOKEN, "PDSERVE_REDIS_URL": url}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert parse_settings(DecodeSettings, argv, "p", "") == settings
    assert TOKEN not in repr(settings)


def test_up_loads_no_grpc():
    """Its children are forked with a preexec_fn, which gRPC's fork handler aborts."""
    import subprocess
    import sys

    code = "import sys, pdserve.up; sys.exit('grpc' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60).returncode == 0


def test_up_makes_a_token_per_cluster_unless_given(tmp_path):
    from pdserve.up import cluster_security

    made = [cluster_security(UpSettings().security).internal_token for _ in range(2)]
    assert len(made[0]) >= 32 and made[0] != made[1]
    path = tmp_path / "token"
    path.write_text(TOKEN)
    given = cluster_security(InternalSecuritySettings(internal_token_file=str(path)))
    assert given.internal_token == TOKEN and given.internal_token_file is None


LAYOUT = BlockLayout(1, bytes(range(16)), "bfloat16", 16, 30, 3, 64)


def test_block_layout_text_round_trips_and_names_what_is_wrong():
    text = layout_to_text(LAYOUT)
    assert text.startswith("version=1,model_fingerprint=000102")
    assert layout_from_text(text) == LAYOUT
    with pytest.raises(ValueError, match="missing: head_dim"):
        layout_from_text(text.replace(",head_dim=64", ""))
    # A layout written before the head range was a field: the whole block's.
    assert layout_from_text(text.split(",kv_head_start")[0]) == LAYOUT
    with pytest.raises(ValueError, match="unknown: colour"):
        layout_from_text(text + ",colour=red")
    with pytest.raises(ValueError, match="block_size='big' is not a int"):
        layout_from_text(text.replace("block_size=16", "block_size=big"))


def test_a_configured_layout_refuses_another_first_put():
    store = BlockStore(1 << 20, LAYOUT)
    other = dataclasses.replace(LAYOUT, dtype="float32")
    with pytest.raises(ValueError, match="dtype: store bfloat16, request float32"):
        store.put(other, b"k", b"x" * 8, 16)
    assert store.layout == LAYOUT and store.num_blocks == 0
    store.put(LAYOUT, b"k", b"x" * 8, 16)
    assert store.num_blocks == 1
