"""The public fronts' TLS: ``--ssl-certfile`` and ``--ssl-keyfile`` (vLLM's flags).

The REST API serves HTTPS and the gRPC front TLS with this pair, which is the certificate
clients see (issued to the public name, e.g. by cert-manager); the internal ``--tls-cert``
stays between pdserve's services. Both fronts follow the files as they rotate: gRPC asks
``CertWatcher`` before each handshake, and ``follow`` loads a new pair into the HTTPS
server's context, which every later connection uses. A pair caught half written is logged
and the old one kept.
"""

from __future__ import annotations

import asyncio
import logging
import ssl

import grpc

from pdserve.runtime.cert_watch import CHECK_EVERY_S, CertWatcher
from pdserve.runtime.trust_files import TrustFiles, read_pair
from pdserve.settings.process import InternalSecuritySettings

logger = logging.getLogger(__name__)

FLAGS = ("--ssl-certfile", "--ssl-keyfile")


def _read(settings: InternalSecuritySettings) -> TrustFiles:
    cert, key = read_pair(settings.tls_cert, settings.tls_key, FLAGS)
    return TrustFiles(cert=cert, key=key)


class PublicTLS:
    """The public pair, checked at start (SettingsError naming the flag), as it is now."""

    def __init__(self, certfile: str, keyfile: str) -> None:
        self.certfile, self.keyfile = certfile, keyfile
        pair = InternalSecuritySettings(tls_cert=certfile, tls_key=keyfile)
        self._watch = CertWatcher(pair, _read(pair), reader=_read)

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """The gRPC front's credentials: TLS, no client certificate asked."""
        return self._watch.server_credentials()

    async def follow(self, context: ssl.SSLContext) -> None:
        """Load each new pair into ``context`` (the HTTPS server's) until cancelled."""
        applied = self._watch.generation
        while True:
            await asyncio.sleep(CHECK_EVERY_S)
            self._watch.check()
            if self._watch.generation == applied:
                continue
            applied = self._watch.generation
            try:
                context.load_cert_chain(self.certfile, self.keyfile)
            except (OSError, ssl.SSLError) as error:  # rewritten again since the check
                # The watcher sees the files change again, and this tries again then.
                logger.warning("the HTTPS front keeps its certificate: %s", error)
                continue
            logger.warning("public TLS files changed: new HTTPS connections use them now")
