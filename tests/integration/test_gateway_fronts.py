"""The gateway's fronts. Over TLS (--ssl-certfile, --ssl-keyfile): HTTPS and gRPC show the
public certificate, not the internal one, refuse plaintext, and follow the files as a
cert-manager renewal rewrites them (pdserve.gateway.public_tls). With --metrics-port:
/metrics moves off the public REST port to a plain port of its own."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import time

import httpx
import pytest

from tests.helpers.clusters import rest_address, running
from tests.helpers.tls_certs import der, make_ca, make_cluster_certs, make_leaf, peer_certificate

WAIT_S = 15.0


def _write_atomically(path, data: bytes) -> None:
    """As the kubelet updates a mounted Secret: a new file renamed over the old one."""
    tmp = path.with_suffix(".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def test_public_fronts_show_the_public_certificate_and_follow_its_renewal(
    tmp_path, tiny_chat_llama_path
):
    internal = make_cluster_certs(tmp_path / "internal")
    public_ca, ca_cert, ca_key = make_ca(tmp_path, "public CA")
    first = make_leaf(tmp_path, "public-1", ca_cert, ca_key)
    renewed = make_leaf(tmp_path, "public-2", ca_cert, ca_key)
    mounted = tmp_path / "mounted"
    mounted.mkdir()
    cert, key = mounted / "tls.crt", mounted / "tls.key"
    cert.write_bytes(first.cert_bytes)
    key.write_bytes(first.key_bytes)
    flags = ["--tls-cert", str(internal.service.cert), "--tls-key", str(internal.service.key)]
    flags += ["--tls-ca", str(internal.ca.cert), "--ssl-certfile", str(cert), "--ssl-keyfile"]
    with running(tmp_path / "logs") as c:
        gateway = c.start(
            "gateway",
            "pdserve.gateway",
            *("--decode", "127.0.0.1:9", "--disaggregation", "off", "--http-port", "0"),
            *("--model", str(tiny_chat_llama_path), *flags, str(key)),
        )
        fronts = {"grpc": gateway.address, "https": rest_address(c)}
        verify = ssl.create_default_context(cafile=str(public_ca.cert))
        health = httpx.get(f"https://{fronts['https']}/health", verify=verify, timeout=10)
        assert health.status_code == 200
        with pytest.raises(httpx.HTTPError):  # plaintext HTTP gets no answer
            httpx.get(f"http://{fronts['https']}/health", timeout=10)
        for front, address in fronts.items():
            assert peer_certificate(address, public_ca) == der(first), front
            with pytest.raises(ssl.SSLCertVerificationError):  # not the internal certificate
                peer_certificate(address, internal.ca)

        # Renewed: the key first, then the certificate (a pair half written is not taken).
        _write_atomically(key, renewed.key_bytes)
        _write_atomically(cert, renewed.cert_bytes)
        deadline = time.monotonic() + WAIT_S
        for front, address in fronts.items():
            while peer_certificate(address, public_ca) != der(renewed):
                assert time.monotonic() < deadline, f"{front} still shows the old certificate"
                time.sleep(0.2)
        health = httpx.get(f"https://{fronts['https']}/health", verify=verify, timeout=10)
        assert health.status_code == 200
    assert not c.unhandled_errors()


def test_a_bad_public_pair_stops_the_start_naming_the_flags(tmp_path, tiny_chat_llama_path):
    internal = make_cluster_certs(tmp_path)
    start = [sys.executable, "-m", "pdserve.gateway", "--decode", "127.0.0.1:9"]
    start += ["--disaggregation", "off", "--model", str(tiny_chat_llama_path)]
    mismatched = ["--ssl-certfile", str(internal.service.cert)]
    mismatched += ["--ssl-keyfile", str(internal.stranger.key)]
    done = subprocess.run([*start, *mismatched], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"--ssl-certfile {internal.service.cert} and --ssl-keyfile" in done.stderr
    alone = subprocess.run(
        [*start, "--ssl-certfile", str(internal.service.cert)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert alone.returncode == 2
    assert "--ssl-certfile and --ssl-keyfile go together" in alone.stderr


def test_metrics_port_takes_metrics_off_the_public_port(tmp_path, tiny_chat_llama_path):
    with running(tmp_path / "logs") as c:
        gateway = c.start(
            "gateway",
            "pdserve.gateway",
            *("--decode", "127.0.0.1:9", "--disaggregation", "off", "--http-port", "0"),
            *("--model", str(tiny_chat_llama_path), "--metrics-port", "0"),
            ready=("gateway-metrics",),
        )
        scrape = f"http://{gateway.addresses['gateway-metrics']}"
        public = f"http://{rest_address(c)}"
        metrics = httpx.get(f"{scrape}/metrics", timeout=10)
        assert metrics.status_code == 200
        assert "pdserve:num_requests_running" in metrics.text
        assert "pdserve:pool_workers" in metrics.text  # read in the event loop
        assert httpx.get(f"{scrape}/health", timeout=10).status_code == 200
        assert httpx.get(f"{public}/metrics", timeout=10).status_code == 404
        assert httpx.get(f"{public}/health", timeout=10).status_code == 200
    assert not c.unhandled_errors()
