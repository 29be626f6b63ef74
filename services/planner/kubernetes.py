"""The actuator of a cluster in Kubernetes: reads and patches the scale subresource of the
pools' Deployments through the API server (plain HTTPS with httpx, no client library), as
the pod's service account. Only the Deployments it is given, in its one namespace, are
ever read or patched; the chart's Role allows no more (docs/operations.md)."""

from __future__ import annotations

import logging
import os
import re
import ssl
from collections.abc import Mapping
from pathlib import Path

import httpx

from pdserve.planner.actuators import POOLS, ActuatorError
from pdserve.settings.planner import PlannerSettings

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TIMEOUT_S = 10.0
MERGE_PATCH = "application/merge-patch+json"
PERMISSION = "get and patch on deployments/scale (apiGroup apps)"

logger = logging.getLogger(__name__)

# What the API server accepts as a namespace (a DNS label) and a Deployment's name (a DNS
# subdomain): anything else could step out of the one path this actuator may touch.
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


class KubernetesActuator:
    """Sets each pool's replicas on its Deployment's scale, and nothing else."""

    def __init__(
        self,
        deployments: Mapping[str, str],
        *,
        api_url: str | None = None,
        namespace: str | None = None,
        token_file: str | Path | None = None,
        ca_file: str | Path | None = None,
        timeout: float = TIMEOUT_S,
    ) -> None:
        """``deployments``: pool -> Deployment name. ``api_url``: default the in-cluster API
        (KUBERNETES_SERVICE_HOST); ``namespace``: default the service account's.
        ``token_file`` (default the service account's) is read again on every call, as a
        projected token rotates; a missing one sends no token (e.g. to ``kubectl proxy``).
        ``ca_file``: default the service account's CA where it exists, else the system's.
        ``timeout``: seconds each call's connect, send and read may take."""
        if not deployments:
            raise ActuatorError("no Deployment to scale: give --decode-deployment")
        for pool, name in deployments.items():
            if pool not in POOLS:
                raise ActuatorError(f"unknown pool {pool!r}: pools are {', '.join(POOLS)}")
            if not _NAME.fullmatch(name or ""):
                raise ActuatorError(f"--{pool}-deployment {name!r} is not a Deployment name")
        if timeout <= 0:
            raise ActuatorError(f"the Kubernetes API timeout must be positive, got {timeout}")
        self.deployments = dict(deployments)
        self.api_url = (api_url or _in_cluster_url()).rstrip("/")
        self.namespace = namespace or _own_namespace()
        if not _NAMESPACE.fullmatch(self.namespace):
            raise ActuatorError(f"--namespace {self.namespace!r} is not a namespace name")
        self.token_file = Path(token_file) if token_file else SERVICE_ACCOUNT / "token"
        self.timeout = timeout
        self._client = httpx.Client(
            base_url=self.api_url,
            verify=_tls_context(ca_file),
            timeout=httpx.Timeout(timeout),
            trust_env=False,  # the API server directly, never through a proxy of the env
        )

    def replicas(self, pool: str) -> int:
        """The replicas ``pool``'s Deployment is set to (its scale's spec.replicas)."""
        scale = self._call("GET", pool)
        replicas = scale.get("spec", {}).get("replicas", 0)  # omitted when 0
        if not isinstance(replicas, int):
            raise ActuatorError(f"{self._describe(pool)}: spec.replicas is {replicas!r}")
        return replicas

    def scale(self, pool: str, replicas: int) -> None:
        """Set ``pool``'s Deployment to ``replicas`` (a merge patch of its scale)."""
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise ActuatorError(f"{pool}: replicas must be a whole number >= 0, got {replicas!r}")
        self._call("PATCH", pool, {"spec": {"replicas": replicas}})
        logger.info("scaled %s to %d replicas", self._describe(pool), replicas)

    def close(self) -> None:
        """Close the connections to the API server."""
        self._client.close()

    def _path(self, pool: str) -> str:
        name = self.deployments.get(pool)
        if name is None:
            raise ActuatorError(
                f"no Deployment is given for the {pool} pool (--{pool}-deployment): this "
                f"planner scales only {', '.join(sorted(self.deployments))}"
            )
        return f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{name}/scale"

    def _describe(self, pool: str) -> str:
        return f"the {pool} pool's Deployment {self.namespace}/{self.deployments.get(pool)}"

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        try:
            token = self.token_file.read_text().strip()
        except FileNotFoundError:
            token = ""
        except OSError as e:
            raise ActuatorError(f"cannot read the token file {self.token_file}: {e}") from None
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def _call(self, method: str, pool: str, patch: dict | None = None) -> dict:
        path, what = self._path(pool), self._describe(pool)
        headers = self._headers()
        if patch is not None:
            headers["Content-Type"] = MERGE_PATCH
        try:
            response = self._client.request(method, path, headers=headers, json=patch)
        except httpx.TimeoutException:
            raise ActuatorError(
                f"{method} of {what}'s scale: the Kubernetes API at {self.api_url} did not "
                f"answer within {self.timeout:g} s"
            ) from None
        except httpx.HTTPError as e:
            raise ActuatorError(
                f"{method} of {what}'s scale: cannot reach the Kubernetes API at "
                f"{self.api_url}: {e}"
            ) from None
        if response.is_success:
            return _json(response, what)
        raise ActuatorError(self._refusal(method, what, response))

    def _refusal(self, method: str, what: str, response: httpx.Response) -> str:
        code, message = response.status_code, _status_message(response)
        if code == 401:
            source = (
                f"the token of {self.token_file}"
                if self.token_file.exists()
                else f"no token ({self.token_file} does not exist)"
            )
            return f"{method} of {what}'s scale: the Kubernetes API refused {source}: {message}"
        if code == 403:
            return (
                f"{method} of {what}'s scale is forbidden: {message}. The planner's service "
                f"account needs RBAC that allows {PERMISSION} on that Deployment (the chart's "
                "planner Role grants exactly that)"
            )
        if code == 404:
            return (
                f"{what} was not found ({message}): check --namespace and the pool's "
                "--prefill-deployment / --decode-deployment"
            )
        return f"{method} of {what}'s scale: the Kubernetes API answered {code}: {message}"


def from_settings(settings: PlannerSettings) -> KubernetesActuator:
    """The actuator ``pdserve planner --actuator kubernetes`` scales through."""
    deployments = {
        pool: name
        for pool, name in (
            ("prefill", settings.prefill_deployment),
            ("decode", settings.decode_deployment),
        )
        if name is not None
    }
    return KubernetesActuator(
        deployments, api_url=settings.kubernetes_api, namespace=settings.namespace
    )


def _in_cluster_url() -> str:
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ActuatorError(
            "KUBERNETES_SERVICE_HOST is unset (not in a pod): give --kubernetes-api"
        )
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    return f"https://{host}:{port}"


def _own_namespace() -> str:
    path = SERVICE_ACCOUNT / "namespace"
    try:
        return path.read_text().strip()
    except OSError:
        raise ActuatorError(f"no --namespace, and {path} cannot be read (not in a pod)") from None


def _tls_context(ca_file: str | Path | None) -> ssl.SSLContext:
    if ca_file is None:
        default = SERVICE_ACCOUNT / "ca.crt"
        ca_file = default if default.exists() else None
    try:
        return ssl.create_default_context(cafile=None if ca_file is None else str(ca_file))
    except (OSError, ssl.SSLError) as e:
        raise ActuatorError(f"cannot load the Kubernetes API's CA {ca_file}: {e}") from None


def _json(response: httpx.Response, what: str) -> dict:
    try:
        body = response.json()
    except ValueError:
        raise ActuatorError(f"{what}'s scale: the Kubernetes API answered no JSON") from None
    if not isinstance(body, dict):
        raise ActuatorError(f"{what}'s scale: the Kubernetes API answered {body!r}")
    return body


def _status_message(response: httpx.Response) -> str:
    """The message of the API's Status object, else the start of the body."""
    try:
        message = response.json().get("message")
    except (ValueError, AttributeError):
        message = None
    return str(message) if message else response.text[:200] or response.reason_phrase
