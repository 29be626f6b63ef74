"""Run what the rendered chart describes as local processes: one per container of each pod
of each Deployment, with the manifest's command, args and env.

The only changes are those a node and its cluster network would make: every pod's IP and
``0.0.0.0`` become 127.0.0.1, each pod's container ports become free local ports, and a
Service's DNS name and port become the address of the pod it selects. Env comes from the
manifests as the kubelet resolves it (values, the downward API, Secrets), ``$(VAR)`` is
expanded in args as Kubernetes does, a Secret or ConfigMap volume is written to a directory
of the pod's own (and its mount path, in env and args, alone or as a ``--flag=PATH`` value,
becomes that directory), and commands are looked up on a PATH that holds only ``pdserve``
(this virtualenv's) and ``valkey-server`` (the Redis-compatible server found here). A pod is
ready when its own readinessProbe passes, tried the way the kubelet would.

A headless Service (``clusterIP: None``) names each pod it selects; here, where each pod's
port is a different local port, it may select one pod only.
"""

from __future__ import annotations

import base64
import math
import os
import re
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.local.launcher import Child, Launcher, free_port
from pdserve.local.redis_server import find_redis_server
from tests.helpers.helm_chart import NAMESPACE, ROOT

LOOPBACK = "127.0.0.1"
_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_TRAILING_PORT = re.compile(r"(^|[=:])(\d+)$")


@dataclass
class Pod:
    """One replica of a Deployment, and the local ports its container ports became."""

    name: str
    deployment: dict
    ports: dict[int, int] = field(default_factory=dict)  # containerPort -> local port

    @property
    def labels(self) -> dict[str, str]:
        return self.deployment["spec"]["template"]["metadata"]["labels"]

    @property
    def spec(self) -> dict:
        return self.deployment["spec"]["template"]["spec"]

    @property
    def component(self) -> str:
        return self.labels.get("app.kubernetes.io/component", "")

    def port_named(self, name: str) -> int:
        """The containerPort called ``name``."""
        for c in self.spec["containers"]:
            for p in c.get("ports", []):
                if p.get("name") == name:
                    return p["containerPort"]
        raise KeyError(f"{self.name} has no port named {name}")


@dataclass
class Running:
    """A started container: its pod, its manifest, its process and its resolved env."""

    pod: Pod
    container: dict
    child: Child
    env: dict[str, str]


class LocalCluster:
    """The rendered chart's pods as processes on 127.0.0.1."""

    def __init__(self, manifests: list[dict], log_dir: Path) -> None:
        self.manifests = manifests
        self.secrets = _secrets(manifests)
        self.config_maps = {
            d["metadata"]["name"]: d.get("data", {}) for d in manifests if d["kind"] == "ConfigMap"
        }
        self.services = {d["metadata"]["name"]: d for d in manifests if d["kind"] == "Service"}
        self.pods = [
            Pod(f"{d['metadata']['name']}-{i}", d)
            for d in manifests
            if d["kind"] == "Deployment"
            for i in range(d["spec"].get("replicas", 1))
        ]
        for pod in self.pods:
            for c in pod.spec["containers"]:
                for p in c.get("ports", []):
                    pod.ports[p["containerPort"]] = free_port()
        self.log_dir = log_dir
        self.bin_dir = log_dir / "bin"
        self.bin_dir.mkdir(parents=True, exist_ok=True)
        (self.bin_dir / "pdserve").symlink_to(Path(sys.executable).parent / "pdserve")
        (self.bin_dir / "valkey-server").symlink_to(find_redis_server())
        self.launcher = Launcher(log_dir, env=self.base_env(), cwd=log_dir)
        self.running: list[Running] = []
        self._later: tuple[str, ...] = ()

    def base_env(self) -> dict[str, str]:
        """What the image gives every container: PATH, HOME, pdserve's cache home, and this
        checkout's code (the virtualenv's may be an editable install of another)."""
        env = {
            "PATH": f"{self.bin_dir}:/usr/bin:/bin",
            "PYTHONPATH": str(ROOT),
            "HOME": os.environ.get("HOME", "/tmp"),
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        for name in ("PDSERVE_HOME", "TMPDIR", "LANG"):
            if name in os.environ:
                env[name] = os.environ[name]
        return env

    # -- the network --------------------------------------------------------------------

    def service_address(self, name: str, port_name: str) -> str:
        """``127.0.0.1:P`` of Service ``name``'s port ``port_name``, through its selector."""
        svc = self.services[name]
        port = next(p for p in svc["spec"]["ports"] if p["name"] == port_name)
        return self._service_target(svc, port["port"])

    def _service_target(self, svc: dict, service_port: int) -> str:
        selector = svc["spec"]["selector"]
        pods = [p for p in self.pods if selector.items() <= p.labels.items()]
        if not pods:
            raise AssertionError(f"Service {svc['metadata']['name']} selects no pod")
        if svc["spec"].get("clusterIP") == "None" and len(pods) > 1:
            raise AssertionError(
                f"headless Service {svc['metadata']['name']} selects {len(pods)} pods: its "
                "name stands for each of them, which one local address:port cannot"
            )
        port = next(p for p in svc["spec"]["ports"] if p["port"] == service_port)
        target = port.get("targetPort", port["port"])
        pod = pods[0]
        container_port = pod.port_named(target) if isinstance(target, str) else target
        return f"{LOOPBACK}:{pod.ports[container_port]}"

    def rewrite(self, pod: Pod, text: str) -> str:
        """``text`` with Service names, pod addresses and container ports made local."""
        for name, svc in self.services.items():
            dns = rf"{re.escape(name)}(?:\.{NAMESPACE}(?:\.svc(?:\.cluster\.local)?)?)?"
            text = re.sub(
                rf"(?<![\w.-]){dns}:(\d+)",
                lambda m, svc=svc: self._service_target(svc, int(m.group(1))),
                text,
            )
        text = text.replace("0.0.0.0", LOOPBACK)
        m = _TRAILING_PORT.search(text)
        if m and int(m.group(2)) in pod.ports:
            text = text[: m.start(2)] + str(pod.ports[int(m.group(2))])
        return text

    # -- env and argv ---------------------------------------------------------------------

    def env_of(self, pod: Pod, container: dict) -> dict[str, str]:
        """The container's env as the kubelet resolves it, in order, ``$(VAR)`` expanded."""
        env: dict[str, str] = {}
        for var in container.get("env", []):
            if "value" in var:
                value = expand(var["value"], env)
            else:
                value = self._value_from(pod, container, var["valueFrom"])
            env[var["name"]] = self._mounted(pod, container, self.rewrite(pod, value))
        return env

    # -- volumes ----------------------------------------------------------------------------

    def volume_dir(self, pod: Pod, volume: str) -> Path:
        """Where the pod's Secret or ConfigMap volume ``volume`` is written."""
        return self.log_dir / "volumes" / pod.name / volume

    def _volume_files(self, volume: dict) -> dict[str, str] | None:
        """{path: text} of a Secret or ConfigMap volume (its items, or every key); None for
        another kind (an emptyDir needs nothing, a hostPath is the same path here)."""
        if "secret" in volume:
            source, data = volume["secret"], self.secrets[volume["secret"]["secretName"]]
        elif "configMap" in volume:
            source, data = volume["configMap"], self.config_maps[volume["configMap"]["name"]]
        else:
            return None
        items = source.get("items") or [{"key": k, "path": k} for k in data]
        return {item["path"]: data[item["key"]] for item in items}

    def _write_volumes(self, pod: Pod) -> None:
        for volume in pod.spec.get("volumes", []):
            files = self._volume_files(volume)
            if files is None:
                continue
            folder = self.volume_dir(pod, volume["name"])
            folder.mkdir(parents=True, exist_ok=True)
            for path, text in files.items():
                (folder / path).write_text(text)

    def _mounted(self, pod: Pod, container: dict, text: str) -> str:
        """``text`` (a path, or ``--flag=PATH``) with the mount path of a Secret or ConfigMap
        volume made that volume's directory."""
        written = {
            v["name"] for v in pod.spec.get("volumes", []) if "secret" in v or "configMap" in v
        }
        flag, eq, path = text.partition("=") if text.startswith("--") else ("", "", text)
        for mount in container.get("volumeMounts", []):
            mount_path = mount["mountPath"]
            if mount["name"] in written and (
                path == mount_path or path.startswith(mount_path.rstrip("/") + "/")
            ):
                local = str(self.volume_dir(pod, mount["name"]))
                return flag + eq + local + path[len(mount_path) :]
        return text

    def _value_from(self, pod: Pod, container: dict, source: dict) -> str:
        if "fieldRef" in source:
            field_path = source["fieldRef"]["fieldPath"]
            return {
                "status.podIP": LOOPBACK,
                "metadata.name": pod.name,
                "metadata.namespace": NAMESPACE,
            }[field_path]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            return self.secrets[ref["name"]][ref["key"]]
        if "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            kind, resource = ref["resource"].split(".")
            quantity = container.get("resources", {}).get(kind, {}).get(resource)
            if quantity is None:
                return str(os.cpu_count())
            return str(math.ceil(cpu_cores(quantity) / cpu_cores(ref.get("divisor", "1"))))
        raise AssertionError(f"{pod.name}: env source {source} is not emulated")

    def argv_of(self, pod: Pod, container: dict, env: dict[str, str]) -> list[str]:
        words = [*container.get("command", []), *container.get("args", [])]
        return [self._mounted(pod, container, self.rewrite(pod, expand(w, env))) for w in words]

    # -- processes --------------------------------------------------------------------------

    def start(self, timeout: float, later: tuple[str, ...] = ()) -> None:
        """Start every pod's containers at once (as a cluster does) and return once each
        pod's readinessProbe passes; StartFailed names one that exited or never got ready.
        The pods of the components in ``later`` wait for ``start_later`` (a pool whose
        nodes come up last), and gateways are then not waited for (their readiness needs a
        decode worker)."""
        started = [
            r for pod in self.pods if pod.component not in later for r in self._start_pod(pod)
        ]
        waited = [r for r in started if not later or r.pod.component != "gateway"]
        self.launcher.wait_ready([r.child for r in waited], timeout)
        self._later = later

    def start_later(self, timeout: float) -> None:
        """Start the pods ``start`` held back, and return once they and every gateway are
        ready."""
        held = [p for p in self.pods if p.component in self._later]
        children = [r.child for p in held for r in self._start_pod(p)]
        children += [r.child for r in self.running if r.pod.component == "gateway"]
        self.launcher.wait_ready(children, timeout)
        self._later = ()

    def _start_pod(self, pod: Pod) -> list[Running]:
        if pod.spec.get("initContainers"):
            raise AssertionError(f"{pod.name}: init containers are not emulated")
        self._write_volumes(pod)
        started = []
        for container in pod.spec["containers"]:
            env = self.env_of(pod, container)
            child = self.launcher.start(
                f"{pod.name}-{container['name']}",
                self.argv_of(pod, container, env),
                probe=_throttled(self._probe(pod, container)),
                env=env,
            )
            started.append(Running(pod, container, child, env))
        self.running += started
        return started

    def roll(self, component: str, timeout: float) -> list[Pod]:
        """A rolling update of ``component``'s Deployment as its strategy (maxSurge 1,
        maxUnavailable 0) runs it: for each old pod in turn a new one starts, and once its
        readinessProbe passes the old one gets SIGTERM and its termination grace period to
        drain. The new pods; the old ones' processes stay in ``running`` (exit codes)."""
        old = [p for p in self.pods if p.component == component]
        rolling = old[0].deployment["spec"]["strategy"]["rollingUpdate"]
        assert (rolling["maxSurge"], rolling["maxUnavailable"]) == (1, 0), rolling
        grace = old[0].spec["terminationGracePeriodSeconds"]
        new = []
        for k, pod in enumerate(old):
            fresh = Pod(f"{pod.deployment['metadata']['name']}-new{k}", pod.deployment)
            for c in fresh.spec["containers"]:
                for p in c.get("ports", []):
                    fresh.ports[p["containerPort"]] = free_port()
            self.pods.append(fresh)
            self.launcher.wait_ready([r.child for r in self._start_pod(fresh)], timeout)
            self.pods.remove(pod)
            self.launcher.stop([r.child for r in self.running if r.pod is pod], grace)
            new.append(fresh)
        return new

    def exec_env(self, component: str) -> dict[str, str]:
        """The env a ``kubectl exec`` into the first pod of ``component`` would see."""
        running = next(r for r in self.running if r.pod.component == component)
        return {**self.launcher.env, **running.env}

    def _probe(self, pod: Pod, container: dict):
        probe = container.get("readinessProbe")
        if probe is None:
            return None
        for kind in ("grpc", "httpGet", "tcpSocket"):
            if kind in probe:
                check = probe[kind]
                break
        else:
            raise AssertionError(f"{pod.name}: probe {probe} is not emulated")
        port = check["port"]
        local = pod.ports[pod.port_named(port) if isinstance(port, str) else port]
        if kind == "grpc":
            return lambda: _grpc_serving(local, check.get("service", ""))
        if kind == "httpGet":
            return lambda: _http_ok(local, check.get("path", "/"))
        return lambda: _tcp_open(local)

    def stop(self) -> None:
        """Every process, by PID: SIGTERM (each drains), then SIGKILL after 15 s."""
        self.launcher.stop_all()


def _admits(policy: dict, pod_labels: dict, port: str, peer: dict) -> bool:
    """Whether ``policy`` selects a pod of ``pod_labels`` and admits ``peer`` to ``port``."""
    selector = policy["spec"]["podSelector"]
    if any(pod_labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        inside = pod_labels.get(e["key"]) in e["values"]
        if inside != (e["operator"] == "In"):
            return False
    return any(
        any(p["port"] == port for p in rule.get("ports", [])) and peer in rule.get("from", [])
        for rule in policy["spec"].get("ingress", [])
    )


def scrape_every_pod(cluster: LocalCluster) -> dict[str, str]:
    """GET /metrics on every pod's port named metrics, as Prometheus does, each through a
    NetworkPolicy rule that admits the monitoring namespace to it: {pod: its base URL}."""
    monitoring = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    }
    policies = [m for m in cluster.manifests if m["kind"] == "NetworkPolicy"]
    scraped = {}
    for pod in cluster.pods:
        try:
            port = pod.ports[pod.port_named("metrics")]
        except KeyError:
            continue
        assert any(_admits(p, pod.labels, "metrics", monitoring) for p in policies), pod.name
        url = f"http://127.0.0.1:{port}"
        answer = httpx.get(f"{url}/metrics", timeout=10)
        assert answer.status_code == 200 and "pdserve:" in answer.text, pod.name
        scraped[pod.name] = url
    return scraped


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: a defined variable is replaced, others stay."""
    return _VAR_REF.sub(lambda m: env.get(m.group(1), m.group(0)), text)


def cpu_cores(quantity: str | int | float) -> float:
    """A CPU quantity ("2", "500m", 1.5) in cores."""
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _secrets(manifests: list[dict]) -> dict[str, dict[str, str]]:
    out = {}
    for d in manifests:
        if d["kind"] == "Secret":
            data = {k: base64.b64decode(v).decode() for k, v in d.get("data", {}).items()}
            out[d["metadata"]["name"]] = {**data, **d.get("stringData", {})}
    return out


def _throttled(probe: Callable[[], bool] | None, every_s: float = 0.5):
    """``probe`` tried at most every ``every_s`` seconds (a kubelet's period, shortened)."""
    if probe is None:
        return None
    last = [0.0]

    def throttled() -> bool:
        now = time.monotonic()
        if now - last[0] < every_s:
            return False
        last[0] = now
        return probe()

    return throttled


def _grpc_serving(port: int, service: str) -> bool:
    with grpc.insecure_channel(f"{LOOPBACK}:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=1.0
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _http_ok(port: int, path: str) -> bool:
    try:
        return httpx.get(f"http://{LOOPBACK}:{port}{path}", timeout=1.0).status_code < 400
    except httpx.HTTPError:
        return False


def _tcp_open(port: int) -> bool:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=1.0):
            return True
    except OSError:
        return False
