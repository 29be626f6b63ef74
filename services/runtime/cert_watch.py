"""TLS files followed as they rotate (a cert-manager renewal rewriting a mounted Secret).

The PEM files a service was started with (``--tls-cert``, ``--tls-key``, ``--tls-ca``,
``--tls-client-ca``) are looked at again, by ``stat``, at most once a second, when a new
connection or a new channel needs them. When any changed and the new set is usable (the
key is the certificate's, the CAs parse), it replaces the old one: the server presents the
new certificate on every new connection (gRPC asks ``server_config`` before each
handshake), and channels made from then on (``channel_credentials``, ``generation``) dial
with it. A set caught half written, or wrong, is logged once and the old one kept.
Connections already open keep the certificate they were opened with.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable

import grpc

from pdserve.core.errors import SettingsError
from pdserve.runtime.trust_files import TrustFiles, read_trust_files
from pdserve.settings.process import InternalSecuritySettings

logger = logging.getLogger(__name__)

CHECK_EVERY_S = 1.0


def _stamps(paths: tuple[str | None, ...]) -> tuple:
    out = []
    for path in paths:
        try:
            st = os.stat(path) if path else None
        except OSError:
            st = None
        out.append((st.st_ino, st.st_mtime_ns, st.st_size) if st else None)
    return tuple(out)


class CertWatcher:
    """The TLS files of ``settings``, as they are now (see the module)."""

    def __init__(
        self,
        settings: InternalSecuritySettings,
        files: TrustFiles,
        clock=time.monotonic,
        reader: Callable[[InternalSecuritySettings], TrustFiles] = read_trust_files,
    ):
        # The token file is followed on its own (token_ring): not read again here.
        self._settings = dataclasses.replace(
            settings, internal_token=None, internal_token_file=None
        )
        self._paths = (settings.tls_cert, settings.tls_key, settings.tls_ca, settings.tls_client_ca)
        self._files = files
        self._reader = reader
        self._stamps = _stamps(self._paths)
        self._clock = clock
        self._next_check = clock() + CHECK_EVERY_S
        self._lock = threading.Lock()  # gRPC asks for the server's config from its own threads
        self._served_generation = 0
        self._warned = False
        self.generation = 0
        self._channel_credentials = self._make_channel_credentials()

    @property
    def files(self) -> TrustFiles:
        self.check()
        return self._files

    def check(self) -> bool:
        """Look at the files (at most once a second); whether a new set was taken."""
        with self._lock:
            if self._clock() < self._next_check:
                return False
            self._next_check = self._clock() + CHECK_EVERY_S
            stamps = _stamps(self._paths)
            if stamps == self._stamps:
                return False
            try:
                files = self._reader(self._settings)
            except SettingsError as error:
                if not self._warned:
                    logger.warning("TLS files changed but are not usable yet (%s): keeping the "
                                   "ones in use", error)  # fmt: skip
                    self._warned = True
                return False
            self._stamps, self._files, self._warned = stamps, files, False
            self.generation += 1
            self._channel_credentials = self._make_channel_credentials()
            logger.warning("TLS files changed: new connections and channels use them now")
            return True

    # -- the server side ----------------------------------------------------------------

    def server_config(self) -> grpc.ServerCertificateConfiguration:
        f = self._files
        return grpc.ssl_server_certificate_configuration(
            [(f.key, f.cert)], root_certificates=f.client_ca
        )

    def server_config_if_new(self) -> grpc.ServerCertificateConfiguration | None:
        """What gRPC asks before each handshake: the new configuration, or None to keep."""
        self.check()
        with self._lock:
            if self._served_generation == self.generation:
                return None
            self._served_generation = self.generation
            return self.server_config()

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self.server_config(),
            self.server_config_if_new,
            require_client_authentication=self._files.client_ca is not None,
        )

    # -- the client side ----------------------------------------------------------------

    def _make_channel_credentials(self) -> grpc.ChannelCredentials | None:
        if not self._settings.dials_tls:
            return None
        f = self._files
        return grpc.ssl_channel_credentials(
            root_certificates=f.ca, private_key=f.key, certificate_chain=f.cert
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """The credentials a channel made now dials with."""
        self.check()
        return self._channel_credentials
