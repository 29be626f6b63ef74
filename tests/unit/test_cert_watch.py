"""TLS files followed as they rotate (pdserve.runtime.cert_watch), on a fake clock."""

from __future__ import annotations

import os

from pdserve.runtime.cert_watch import CHECK_EVERY_S, CertWatcher
from pdserve.runtime.trust_files import read_trust_files
from pdserve.settings.process import InternalSecuritySettings
from tests.helpers.tls_certs import make_ca, make_leaf


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def _replace(path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def test_a_renewed_pair_is_taken_a_half_written_one_is_not(tmp_path, caplog):
    ca, ca_cert, ca_key = make_ca(tmp_path)
    leaf = make_leaf(tmp_path, "svc", ca_cert, ca_key)
    (tmp_path / "next").mkdir()
    renewed = make_leaf(tmp_path / "next", "svc", ca_cert, ca_key)
    settings = InternalSecuritySettings(
        tls_cert=str(leaf.cert), tls_key=str(leaf.key), tls_ca=str(ca.cert)
    )
    clock = Clock()
    watcher = CertWatcher(settings, read_trust_files(settings), clock=clock)
    assert watcher.server_config_if_new() is None  # the initial set is what the server has
    first = watcher.channel_credentials()

    _replace(leaf.cert, renewed.cert.read_bytes())  # the key not yet: not a pair
    clock.now += CHECK_EVERY_S
    assert not watcher.check() and watcher.generation == 0
    assert "not usable yet" in caplog.text and watcher.files.cert != renewed.cert.read_bytes()

    _replace(leaf.key, renewed.key.read_bytes())
    clock.now += CHECK_EVERY_S
    assert watcher.check() and watcher.generation == 1
    assert watcher.files.cert == renewed.cert.read_bytes()
    assert watcher.server_config_if_new() is not None  # once, for the next handshake
    assert watcher.server_config_if_new() is None
    assert watcher.channel_credentials() is not first
