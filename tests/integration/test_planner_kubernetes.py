"""The planner's Kubernetes actuator (pdserve.planner.kubernetes) against a stand-in of the
API server's scale subresource: a real HTTPS server on 127.0.0.1 that holds a few
Deployments (the pools', the gateway's and kvstore's, another namespace's), checks the
bearer token and an RBAC rule like the chart's Role, and records every request. The
actuator reads and patches only its own pools' Deployments, in its namespace, with a merge
patch; a refusal, a missing Deployment, an unreachable or silent server each become an
ActuatorError that says what to change, within the timeout."""

from __future__ import annotations

import re
import socket
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdserve.planner import kubernetes
from pdserve.planner.actuators import ActuatorError
from pdserve.planner.kubernetes import MERGE_PATCH, KubernetesActuator, from_settings
from pdserve.settings.flags import parse_settings
from pdserve.settings.planner import PlannerSettings
from tests.helpers.kube_api import ScaleAPI, serve
from tests.helpers.tls_certs import make_cluster_certs

NS = "pdserve"
POOLS = {"prefill": "t-pdserve-prefill", "decode": "t-pdserve-decode"}


@dataclass
class Cluster:
    api: ScaleAPI
    ca: Path
    other_ca: Path
    token_file: Path

    def actuator(self, **kwargs) -> KubernetesActuator:
        deployments = kwargs.pop("deployments", POOLS)
        args = {
            "api_url": self.api.url,
            "namespace": NS,
            "token_file": self.token_file,
            "ca_file": self.ca,
            **kwargs,
        }
        return KubernetesActuator(deployments, **args)


@pytest.fixture
def cluster(tmp_path) -> Iterator[Cluster]:
    certs = make_cluster_certs(tmp_path / "certs")
    api = ScaleAPI(
        token="token-1",
        replicas={
            (NS, POOLS["prefill"]): 1,
            (NS, POOLS["decode"]): 2,
            (NS, "t-pdserve-gateway"): 2,
            (NS, "t-pdserve-kvstore"): 1,
            ("other", POOLS["decode"]): 5,
        },
        allowed={(verb, NS, name) for verb in ("get", "patch") for name in POOLS.values()},
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs.service.cert, certs.service.key)
    server = serve(api, lambda sock: context.wrap_socket(sock, server_side=True))
    token_file = tmp_path / "token"
    token_file.write_text("token-1\n")
    try:
        yield Cluster(api, certs.ca.cert, certs.other_ca.cert, token_file)
    finally:
        server.shutdown()
        server.server_close()


def test_it_reads_and_patches_only_its_own_pools_deployments(cluster):
    actuator = cluster.actuator()
    assert (actuator.replicas("prefill"), actuator.replicas("decode")) == (1, 2)
    actuator.scale("decode", 4)
    actuator.scale("prefill", 0)
    assert (actuator.replicas("prefill"), actuator.replicas("decode")) == (0, 4)
    assert cluster.api.replicas == {
        (NS, POOLS["prefill"]): 0,
        (NS, POOLS["decode"]): 4,
        (NS, "t-pdserve-gateway"): 2,
        (NS, "t-pdserve-kvstore"): 1,
        ("other", POOLS["decode"]): 5,
    }
    own = {f"/apis/apps/v1/namespaces/{NS}/deployments/{name}/scale" for name in POOLS.values()}
    assert {r.path for r in cluster.api.requests} == own
    patches = [r for r in cluster.api.requests if r.method == "PATCH"]
    assert [(r.content_type, r.body) for r in patches] == [
        (MERGE_PATCH, {"spec": {"replicas": 4}}),
        (MERGE_PATCH, {"spec": {"replicas": 0}}),
    ]
    assert {r.method for r in cluster.api.requests} == {"GET", "PATCH"}
    # Nothing else can be named: no request leaves for it.
    seen = len(cluster.api.requests)
    for pool in ("gateway", "kvstore", "t-pdserve-gateway"):
        with pytest.raises(ActuatorError, match=f"no Deployment is given for the {pool} pool"):
            actuator.scale(pool, 3)
    with pytest.raises(ActuatorError, match="whole number"):
        actuator.scale("decode", -1)
    assert len(cluster.api.requests) == seen
    actuator.close()


def test_from_settings_takes_the_pods_service_account_and_skips_an_absent_prefill_pool(
    cluster, tmp_path, monkeypatch
):
    """In a pod: the API's address from KUBERNETES_SERVICE_HOST/PORT, the namespace, CA and
    token from the service account's files; no prefill Deployment without a prefill pool."""
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "namespace").write_text(NS)
    (account / "token").write_text("token-1")
    (account / "ca.crt").write_bytes(cluster.ca.read_bytes())
    monkeypatch.setattr(kubernetes, "SERVICE_ACCOUNT", account)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", cluster.api.url.rsplit(":", 1)[1])
    argv = ["--profile=profile.json", "--gateway-metrics=http://gw:9400/metrics"]
    argv += ["--redis-url=redis://127.0.0.1:6379/0", "--disaggregation=off"]
    argv += [f"--decode-deployment={POOLS['decode']}"]
    settings = parse_settings(PlannerSettings, argv, prog="pdserve planner", description="")
    actuator = from_settings(settings)
    assert actuator.api_url == cluster.api.url and actuator.namespace == NS
    assert actuator.replicas("decode") == 2
    with pytest.raises(ActuatorError, match="--prefill-deployment"):
        actuator.replicas("prefill")
    assert [r.path.rsplit("/", 2)[1] for r in cluster.api.requests] == [POOLS["decode"]]
    actuator.close()


def test_a_forbidden_patch_names_the_rbac_permission(cluster):
    cluster.api.allowed.discard(("patch", NS, POOLS["decode"]))  # a Role of get alone
    actuator = cluster.actuator()
    assert actuator.replicas("decode") == 2
    with pytest.raises(ActuatorError) as refused:
        actuator.scale("decode", 3)
    message = str(refused.value)
    assert f"Deployment {NS}/{POOLS['decode']}" in message
    assert 'cannot patch resource "deployments/scale"' in message  # the API's own words
    assert "patch on deployments/scale" in message and "RBAC" in message
    assert cluster.api.replicas[NS, POOLS["decode"]] == 2


def test_a_missing_deployment_or_another_namespace_says_which(cluster):
    cluster.api.allowed.add(("get", NS, "t-pdserve-typo"))
    typo = cluster.actuator(deployments={"decode": "t-pdserve-typo"})
    with pytest.raises(ActuatorError, match=f"Deployment {NS}/t-pdserve-typo was not found"):
        typo.replicas("decode")
    # The Role is the release's namespace's: another namespace's Deployment is refused.
    elsewhere = cluster.actuator(namespace="other")
    with pytest.raises(ActuatorError, match='forbidden: .* in the namespace "other"'):
        elsewhere.scale("decode", 1)
    assert cluster.api.replicas["other", POOLS["decode"]] == 5


def test_the_token_file_is_read_again_on_every_call(cluster):
    actuator = cluster.actuator()
    assert actuator.replicas("decode") == 2
    # The kubelet rotates the projected token: a new file, and the old token expires.
    cluster.token_file.write_text("token-2\n")
    cluster.api.token = "token-2"
    actuator.scale("decode", 3)
    assert [r.authorization for r in cluster.api.requests] == ["Bearer token-1", "Bearer token-2"]
    cluster.api.token = "token-3"  # a token the file does not hold
    with pytest.raises(ActuatorError, match=f"refused the token of {cluster.token_file}"):
        actuator.replicas("decode")


def test_the_api_servers_certificate_is_checked_against_the_ca(cluster):
    actuator = cluster.actuator(ca_file=cluster.other_ca)
    with pytest.raises(ActuatorError, match="cannot reach the Kubernetes API"):
        actuator.replicas("decode")
    assert cluster.api.requests == []


def test_an_unreachable_or_silent_api_fails_within_the_timeout(cluster):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    actuator = cluster.actuator(api_url=f"https://127.0.0.1:{port}", timeout=0.5)
    with pytest.raises(ActuatorError, match=f"cannot reach the Kubernetes API at .*:{port}"):
        actuator.replicas("decode")
    # A server that takes the connection and never answers (the kernel accepts it).
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        url = f"https://127.0.0.1:{silent.getsockname()[1]}"
        actuator = cluster.actuator(api_url=url, timeout=0.5)
        start = time.monotonic()
        with pytest.raises(ActuatorError, match=r"did not answer within 0.5 s"):
            actuator.scale("decode", 3)
        assert time.monotonic() - start < 3.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"deployments": {}}, "--decode-deployment"),
        ({"deployments": {"decode": "../../secrets/x"}}, "not a Deployment name"),
        ({"deployments": {"gateway": "t-pdserve-gateway"}}, "unknown pool 'gateway'"),
        ({"namespace": "kube-system/x"}, "not a namespace name"),
        ({"timeout": 0}, "must be positive"),
    ],
)
def test_a_bad_setting_is_refused_at_start(cluster, kwargs, message):
    with pytest.raises(ActuatorError, match=re.escape(message)):
        cluster.actuator(**kwargs)


def test_outside_a_pod_it_asks_for_the_api_and_the_namespace(tmp_path, monkeypatch):
    monkeypatch.setattr(kubernetes, "SERVICE_ACCOUNT", tmp_path / "none")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ActuatorError, match="--kubernetes-api"):
        KubernetesActuator(POOLS)
    with pytest.raises(ActuatorError, match="no --namespace"):
        KubernetesActuator(POOLS, api_url="http://127.0.0.1:1")
