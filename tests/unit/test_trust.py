"""Internal trust without processes: the security settings' checks, the token file, the
kvstore's ``--block-layout``."""

from __future__ import annotations

import dataclasses

import pytest

from services.common.config import (
    InternalSecuritySettings,
)
from services.common.kv_blocks import BlockLayout
from services.common.settings import SettingsError
from services.common.trust_files import read_token
from services.kvstore.store import BlockStore, layout_from_text, layout_to_text

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


LAYOUT = BlockLayout(1, bytes(range(16)), "bfloat16", 16, 30, 3, 64)


def test_block_layout_text_round_trips_and_names_what_is_wrong():
    text = layout_to_text(LAYOUT)
    assert text.startswith("version=1,model_fingerprint=000102")
    assert layout_from_text(text) == LAYOUT
    with pytest.raises(ValueError, match="missing: head_dim"):
        layout_from_text(text.rsplit(",", 1)[0])
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
