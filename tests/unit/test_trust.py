"""Internal trust without processes: the security settings' checks and the token file."""

from __future__ import annotations

import pytest

from services.common.config import InternalSecuritySettings
from services.common.settings import SettingsError
from services.common.trust_files import read_token

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
