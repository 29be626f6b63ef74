"""What the internal-security settings name, read once and checked, without gRPC: the
internal token (from its variable, flag or file) and the TLS PEM files.

`pdserve up` checks its children's files with this before starting anything; it must not
load gRPC (its children are forked with a ``preexec_fn``, which gRPC's fork handler
aborts). ``pdserve.runtime.trust`` turns the result into gRPC credentials.
"""

from __future__ import annotations

import logging
import os
import ssl
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.core.errors import SettingsError
from pdserve.settings.process import MIN_TOKEN_CHARS, InternalSecuritySettings

logger = logging.getLogger(__name__)

TOKEN_ENV = "PDSERVE_INTERNAL_TOKEN"


@dataclass(frozen=True)
class TrustFiles:
    """The token and the PEM bytes the settings name (None: not configured)."""

    token: str | None = field(default=None, repr=False)
    cert: bytes | None = field(default=None, repr=False)
    key: bytes | None = field(default=None, repr=False)
    ca: bytes | None = field(default=None, repr=False)
    client_ca: bytes | None = field(default=None, repr=False)


def read_trust_files(settings: InternalSecuritySettings) -> TrustFiles:
    """Read the token and the TLS files named by ``settings``; SettingsError naming the
    flag when one is missing or unusable."""
    files = {"token": read_token(settings)}
    if settings.tls_cert:
        files["cert"] = _read("--tls-cert", settings.tls_cert)
        files["key"] = _read("--tls-key", settings.tls_key)
        check_pair(settings.tls_cert, settings.tls_key)
    for name, flag, path in (
        ("client_ca", "--tls-client-ca", settings.tls_client_ca),
        ("ca", "--tls-ca", settings.tls_ca),
    ):
        if path:
            files[name] = _read(flag, path)
            _check_ca(flag, path)
    return TrustFiles(**files)


def read_token(settings: InternalSecuritySettings) -> str | None:
    """The internal token: the first line of ``--internal-token-file``, else the flag's or
    the variable's value; a value given as a flag is warned about (``ps`` shows it)."""
    if settings.internal_token_file:
        text = _read("--internal-token-file", settings.internal_token_file).decode()
        lines = text.strip().splitlines()
        token = lines[0].strip() if lines else ""
        if len(token) < MIN_TOKEN_CHARS:
            raise SettingsError(
                f"--internal-token-file {settings.internal_token_file}: the token on its first "
                f"line must have at least {MIN_TOKEN_CHARS} characters"
            )
        return token
    token = settings.internal_token.strip() if settings.internal_token else None
    if token and os.environ.get(TOKEN_ENV, "").strip() != token:
        logger.warning(
            "--internal-token given on the command line: every user of this machine can read "
            "it (ps); use %s or --internal-token-file",
            TOKEN_ENV,
        )
    return token


def _read(flag: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise SettingsError(f"{flag} {path}: cannot read it ({error.strerror})") from None


def read_pair(cert: str, key: str, flags: tuple[str, str]) -> tuple[bytes, bytes]:
    """A certificate chain and its key, read and checked; SettingsError naming ``flags``."""
    pair = _read(flags[0], cert), _read(flags[1], key)
    check_pair(cert, key, flags)
    return pair


def check_pair(cert: str, key: str, flags: tuple[str, str] = ("--tls-cert", "--tls-key")) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # An encrypted key asks for a password: the empty one fails, as gRPC would.
        context.load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as error:
        raise SettingsError(
            f"{flags[0]} {cert} and {flags[1]} {key} are not a PEM certificate chain and its "
            f"unencrypted private key ({error.reason or error})"
        ) from None


def _check_ca(flag: str, path: str) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cafile=path)
    except ssl.SSLError as error:
        raise SettingsError(
            f"{flag} {path}: not PEM CA certificates ({error.reason or error})"
        ) from None
