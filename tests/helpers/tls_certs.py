"""Certificates made by the tests themselves (the ``cryptography`` package): a CA, and
certificates it signs for 127.0.0.1 / localhost, good for both ends of mutual TLS."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pem:
    """A certificate and its key, as files and as bytes."""

    cert: Path
    key: Path

    @property
    def cert_bytes(self) -> bytes:
        return self.cert.read_bytes()

    @property
    def key_bytes(self) -> bytes:
        return self.key.read_bytes()


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(folder: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Pem:
    pem = Pem(folder / f"{stem}.crt", folder / f"{stem}.key")
    pem.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return pem


def make_ca(folder: Path, name: str = "pdserve test CA") -> tuple[Pem, x509.Certificate, object]:
    """A self-signed CA: (its files, its certificate, its key)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        .sign(key, hashes.SHA256())
    )
    stem = name.replace(" ", "-")
    return _write(folder, stem, cert, key), cert, key


def make_leaf(folder: Path, stem: str, ca_cert: x509.Certificate, ca_key) -> Pem:
    """A certificate for 127.0.0.1 and localhost, signed by the CA, for servers and clients."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(stem))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return _write(folder, stem, cert, key)


@dataclass(frozen=True)
class ClusterCerts:
    """A cluster's CA and one certificate for its services, plus a stranger's."""

    ca: Pem
    service: Pem
    stranger: Pem  # signed by another CA
    other_ca: Pem  # that CA (e.g. a public one, which the gateway's public fronts use)


def make_cluster_certs(folder: Path) -> ClusterCerts:
    folder.mkdir(parents=True, exist_ok=True)
    ca, ca_cert, ca_key = make_ca(folder)
    service = make_leaf(folder, "service", ca_cert, ca_key)
    other_ca, other_cert, other_key = make_ca(folder, "another CA")
    stranger = make_leaf(folder, "stranger", other_cert, other_key)
    return ClusterCerts(ca, service, stranger, other_ca)


def peer_certificate(address: str, ca: Pem, client: Pem | None = None) -> bytes:
    """The DER certificate a new TLS connection (ALPN h2, as gRPC) to ``address`` is shown,
    verified against ``ca``; ``client``: the certificate to present (mutual TLS)."""
    context = ssl.create_default_context(cafile=str(ca.cert))
    if client is not None:
        context.load_cert_chain(str(client.cert), str(client.key))
    context.set_alpn_protocols(["h2", "http/1.1"])
    host, _, port = address.rpartition(":")
    raw = socket.create_connection((host, int(port)), timeout=10)
    with context.wrap_socket(raw, server_hostname=host) as tls:
        return tls.getpeercert(binary_form=True)


def der(pem: Pem) -> bytes:
    """``pem``'s certificate in DER."""
    return ssl.PEM_cert_to_DER_cert(pem.cert.read_text())
