"""The Helm chart (helm/pdserve), rendered by the real helm binary with its default values and
each value set of helm/pdserve/ci: `helm lint --strict`, every object valid for Kubernetes 1.35,
what the schema refuses, scaling by replicas alone, and every pdserve command line it writes
accepted by pdserve's own parsers."""

from __future__ import annotations

import base64
import copy
import hashlib
import re

import pytest

from pdserve.settings.commands import PrepareModelSettings, known_env
from pdserve.settings.flags import parse_settings
from pdserve.settings.planner import PlannerSettings
from pdserve.settings.services import (
    DecodeSettings,
    GatewaySettings,
    KVStoreSettings,
    PrefillSettings,
)
from tests.helpers.chart_pods import expand
from tests.helpers.helm_chart import (
    CHART,
    CI_VALUES,
    component,
    helm,
    of_kind,
    render,
    template,
    values_args,
)
from tests.helpers.k8s_validate import validate

VALUE_SETS = [None, *CI_VALUES]
SET_IDS = ["default", *(f.name.removesuffix("-values.yaml") for f in CI_VALUES)]
SETTINGS = {
    "gateway": GatewaySettings,
    "prefill": PrefillSettings,
    "decode": DecodeSettings,
    "kvstore": KVStoreSettings,
    "prepare-model": PrepareModelSettings,
    "planner": PlannerSettings,
}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    """Every value set, rendered once."""
    return {i: render([f] if f else []) for i, f in zip(SET_IDS, VALUE_SETS, strict=True)}


def containers(doc: dict) -> list[dict]:
    spec = doc["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


def flag(container: dict, name: str) -> str | None:
    """The value of ``--name=VALUE`` in a container's args."""
    for arg in container.get("args", []):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
    return None


def labels_match(selector: dict, labels: dict) -> bool:
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        present = labels.get(e["key"])
        if e["operator"] == "In" and present not in e["values"]:
            return False
        if e["operator"] == "NotIn" and present in e["values"]:
            return False
    return True


def pod_labels(deployment: dict) -> dict:
    return deployment["spec"]["template"]["metadata"]["labels"]


@pytest.mark.parametrize("values", VALUE_SETS, ids=SET_IDS)
def test_helm_lint_strict(values):
    done = helm("lint", "--strict", str(CHART), *(["-f", str(values)] if values else []))
    assert "[WARNING]" not in done.stdout and "[ERROR]" not in done.stdout, done.stdout


@pytest.mark.parametrize("set_id", SET_IDS)
def test_every_rendered_object_is_valid_for_kubernetes_1_35(rendered, set_id):
    docs = rendered[set_id]
    for doc in docs:
        validate(doc)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "NetworkPolicy", "PodDisruptionBudget"} <= kinds


def test_the_validation_can_fail(rendered):
    decode = copy.deepcopy(of_kind(rendered["default"], "Deployment")["t-pdserve-decode"])
    decode["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # not "resources"
    with pytest.raises(AssertionError, match="resource"):
        validate(decode)
    scaled = copy.deepcopy(of_kind(rendered["autoscaling-monitoring"], "ScaledObject"))
    so = scaled["t-pdserve-prefill"]
    so["spec"]["triggers"][0]["metadata"]["threshold"] = 4  # KEDA wants strings
    with pytest.raises(AssertionError, match="threshold"):
        validate(so)


@pytest.mark.parametrize(
    ("values", "names"),
    [
        ({"decode.replicsa": 2}, "replicsa"),
        ({"gatway": {"replicas": 2}}, "gatway"),
        ({"decode.replicas": -1}, "/decode/replicas"),
        ({"prefill.replicas": -3}, "/prefill/replicas"),
        ({"engine.dtype": "fp8"}, "/engine/dtype"),
        # A pool cannot take its own dtype: prefill and decode must agree on it.
        ({"decode.engine.dtype": "float32"}, "dtype"),
        ({"engine.blockSize": 24}, "/engine/blockSize"),
        ({"decode.engine.kvCacheMemory": "lots"}, "kvCacheMemory"),
        ({"model.source": "s3"}, "/model/source"),
        ({"model.source": "pvc"}, "claimName"),
        ({"internalToken.value": "short"}, "/internalToken/value"),
        ({"decode.autoscaling.keda.enabled": True}, "query"),
        ({"listenAddress": "127.0.0.1"}, "listenAddress"),
        ({"decode.priorityClasName": "high"}, "priorityClasName"),
        ({"decode.image.digest": "latest"}, "/decode/image/digest"),
        ({"prefill.probes.readyness": {"periodSeconds": 2}}, "readyness"),
        ({"gateway.probes.liveness.timeoutSeconds": 0}, "/gateway/probes/liveness/timeoutSeconds"),
        ({"redis.password": "has space"}, "/redis/password"),
        ({"autoscaling.mode": "keda"}, "/autoscaling/mode"),
        ({"planner.headroom": -0.1}, "/planner/headroom"),
        ({"planner.targets.ttftP90Ms": 0}, "/planner/targets/ttftP90Ms"),
        ({"planner.serviceAccount": "x"}, "serviceAccount"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_schema_refuses(values, names):
    done = template(set_values=values, check=False)
    assert done.returncode != 0, f"{values} rendered"
    assert "schema" in done.stderr and names in done.stderr, done.stderr


@pytest.mark.parametrize("pool", ["decode", "prefill", "kvstore", "gateway"])
def test_scaling_a_pool_is_its_replicas_alone(pool):
    # The secrets given: made at random, they would differ per render (and the checksums).
    secrets = {"apiKey.value": "k", "redis.password": "p", "internalToken.value": "t" * 16}
    one = render(set_values={**secrets, f"{pool}.replicas": 1})
    five = render(set_values={**secrets, f"{pool}.replicas": 5})
    diffs = [(a["kind"], a["metadata"]["name"]) for a, b in zip(one, five, strict=True) if a != b]
    assert diffs == [("Deployment", f"t-pdserve-{pool}")]
    a = of_kind(one, "Deployment")[f"t-pdserve-{pool}"]
    b = copy.deepcopy(of_kind(five, "Deployment")[f"t-pdserve-{pool}"])
    assert (a["spec"]["replicas"], b["spec"]["replicas"]) == (1, 5)
    b["spec"]["replicas"] = 1
    assert a == b


def test_an_autoscaled_pool_leaves_its_replicas_to_the_autoscaler(rendered):
    docs = rendered["autoscaling-monitoring"]
    deployments = of_kind(docs, "Deployment")
    targets = {d["spec"]["scaleTargetRef"]["name"] for d in docs if d["kind"] == "ScaledObject"}
    hpas = of_kind(docs, "HorizontalPodAutoscaler")
    targets |= {h["spec"]["scaleTargetRef"]["name"] for h in hpas.values()}
    assert targets == {f"t-pdserve-{p}" for p in ("gateway", "prefill", "decode", "kvstore")}
    for name in targets:
        assert "replicas" not in deployments[name]["spec"], name
    decode = hpas["t-pdserve-decode"]["spec"]["metrics"]
    assert [m["type"] for m in decode] == ["Resource", "Pods"]  # CPU, then the pool's signal
    assert "t-pdserve-prefill" not in hpas  # KEDA owns that one


def resolved_env(container: dict) -> dict[str, str]:
    """A container's env with placeholders where the cluster fills it in."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
        elif "fieldRef" in var["valueFrom"]:
            env[var["name"]] = "10.1.2.3"
        elif "resourceFieldRef" in var["valueFrom"]:
            env[var["name"]] = "2"
        elif var["name"] == "PDSERVE_REDIS_URL":
            env[var["name"]] = "redis://:pw@redis.example:6379/0"
        else:
            env[var["name"]] = "x" * 32
    return env


@pytest.mark.parametrize("set_id", SET_IDS)
def test_pdserve_accepts_every_command_line_the_chart_writes(rendered, set_id, monkeypatch):
    seen = set()
    for deployment in of_kind(rendered[set_id], "Deployment").values():
        for c in containers(deployment):
            if c.get("command", [""])[0] != "pdserve":
                continue
            env = resolved_env(c)
            unknown = sorted(n for n in env if n.startswith("PDSERVE_") and n not in known_env())
            assert unknown == [], f"{c['name']}: pdserve reads no {unknown}"
            for name, value in env.items():
                monkeypatch.setenv(name, value)
            args = [expand(a, env) for a in c["args"]]
            command = c["command"][1]
            try:
                parse_settings(SETTINGS[command], args, prog=f"pdserve {command}", description="")
            except SystemExit:
                pytest.fail(f"pdserve {command} refuses {args} (stderr above)")
            for name in env:
                monkeypatch.delenv(name)
            seen.add(command)
    assert {"gateway", "decode"} <= seen


@pytest.mark.parametrize("set_id", SET_IDS)
def test_probes_ports_and_grace_fit_each_container(rendered, set_id):
    docs = rendered[set_id]
    for deployment in of_kind(docs, "Deployment").values():
        spec = deployment["spec"]["template"]["spec"]
        c = spec["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c.get(kind)
            if probe is None:
                continue
            (check,) = (probe[k] for k in ("grpc", "httpGet", "tcpSocket") if k in probe)
            assert check["port"] in (*ports, *ports.values()), (c["name"], kind)
        if c.get("command", [""])[0] != "pdserve" or component(deployment) == "planner":
            continue  # the planner serves no gRPC and drains nothing (its own test)
        port = flag(c, "port")
        assert port and int(port) in ports.values()
        if component(deployment) != "gateway":
            assert flag(c, "advertise-address") == f"$(POD_IP):{port}"
            if "grpc" in c["readinessProbe"]:
                assert c["readinessProbe"]["grpc"]["port"] == int(port)
        drain = float(flag(c, "drain-timeout"))
        pause = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert spec["terminationGracePeriodSeconds"] > drain + pause
    for svc in of_kind(docs, "Service").values():
        pods = [d for d in of_kind(docs, "Deployment").values()]
        (target,) = [
            d for d in pods if labels_match({"matchLabels": svc["spec"]["selector"]}, pod_labels(d))
        ]
        names = {p["name"] for p in target["spec"]["template"]["spec"]["containers"][0]["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= names


@pytest.mark.parametrize("set_id", SET_IDS)
def test_network_policies_expose_only_the_gateway(rendered, set_id):
    docs = rendered[set_id]
    policies = of_kind(docs, "NetworkPolicy").values()
    release = {"app.kubernetes.io/instance": "t", "app.kubernetes.io/name": "pdserve"}
    for deployment in of_kind(docs, "Deployment").values():
        labels = pod_labels(deployment)
        mine = [p for p in policies if labels_match(p["spec"]["podSelector"], labels)]
        assert mine, f"{component(deployment)} has no NetworkPolicy"
        rules = [rule for p in mine for rule in p["spec"]["ingress"]]
        if component(deployment) == "gateway":
            continue
        # The release's pods on any port; Prometheus' namespace on the metrics port only.
        peers = [peer for rule in rules if "ports" not in rule for peer in rule["from"]]
        assert peers and all(set(peer) == {"podSelector"} for peer in peers), peers
        assert all(peer["podSelector"]["matchLabels"] == release for peer in peers)
        for rule in rules:
            if "ports" in rule:
                assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}], rule
                assert rule["from"] == [
                    {
                        "namespaceSelector": {
                            "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}
                        }
                    }
                ]


@pytest.mark.parametrize("set_id", SET_IDS)
def test_no_two_containers_of_a_pod_take_one_port(rendered, set_id):
    for name, deployment in of_kind(rendered[set_id], "Deployment").items():
        ports = [
            p["containerPort"]
            for c in deployment["spec"]["template"]["spec"]["containers"]
            for p in c.get("ports", [])
        ]
        assert len(ports) == len(set(ports)), (name, ports)


@pytest.mark.parametrize("set_id", SET_IDS)
def test_every_pool_loads_one_model_from_one_volume(rendered, set_id):
    models, volumes = set(), []
    for deployment in of_kind(rendered[set_id], "Deployment").values():
        spec = deployment["spec"]["template"]["spec"]
        for c in spec["containers"]:
            if c.get("command", [""])[0] == "pdserve" and flag(c, "model"):
                models.add(flag(c, "model"))
                volumes.append(next(v for v in spec["volumes"] if v["name"] == "model"))
    assert len(models) == 1 and len(volumes) >= 2
    assert all(v == volumes[0] for v in volumes)


def test_secrets_stay_out_of_the_pod_specs(rendered):
    docs = rendered["external-redis"]
    secret = of_kind(docs, "Secret")["t-pdserve"]
    assert set(secret["data"]) == {"internal-token", "redis-url"}  # the API key is the user's
    text = str([d for d in docs if d["kind"] != "Secret"])
    assert "s3cret" not in text
    assert "t-pdserve-redis" not in of_kind(docs, "Deployment")
    default = of_kind(rendered["default"], "Secret")["t-pdserve"]
    assert set(default["data"]) == {"internal-token", "api-key", "redis-password", "redis-url"}


def test_the_built_in_redis_asks_for_the_password_the_pods_get(rendered):
    docs = rendered["default"]
    data = {
        k: base64.b64decode(v).decode()
        for k, v in of_kind(docs, "Secret")["t-pdserve"]["data"].items()
    }
    password = data["redis-password"]
    assert len(password) >= 32
    assert data["redis-url"] == f"redis://:{password}@t-pdserve-redis:6379/0"
    deployments = of_kind(docs, "Deployment")
    (valkey,) = deployments["t-pdserve-redis"]["spec"]["template"]["spec"]["containers"]
    args = valkey["args"]
    assert args[args.index("--requirepass") + 1] == "$(VALKEY_PASSWORD)"
    assert "--protected-mode" not in args and password not in str(deployments)
    (env,) = [e for e in valkey["env"] if e["name"] == "VALKEY_PASSWORD"]
    assert env["valueFrom"]["secretKeyRef"] == {"name": "t-pdserve", "key": "redis-password"}
    for name, deployment in deployments.items():
        for c in deployment["spec"]["template"]["spec"]["containers"]:
            for e in c.get("env", []):
                if e["name"] == "PDSERVE_REDIS_URL":
                    ref = e["valueFrom"]["secretKeyRef"]
                    assert ref == {"name": "t-pdserve", "key": "redis-url"}, name


def test_gpu_decode_pool_beside_a_cpu_prefill_pool(rendered):
    """The GPU pool with what GPU clusters ask: a priority, the NVIDIA runtime, a larger
    /dev/shm, a node-local cache, a sidecar, its image by digest, a longer start."""
    deployments = of_kind(rendered["gpu-decode"], "Deployment")
    decode = deployments["t-pdserve-decode"]["spec"]["template"]["spec"]
    prefill = deployments["t-pdserve-prefill"]["spec"]["template"]["spec"]
    (d, sidecar), (p,) = decode["containers"], prefill["containers"]
    assert d["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert re.fullmatch(r"pdserve:[^@]+-cuda@sha256:[0-9a-f]{64}", d["image"])  # pinned
    assert sidecar["name"] == "dcgm-exporter"
    assert "nvidia.com/gpu" not in str(p["resources"]) and not re.search(
        r"-(cuda|slim)$", p["image"]
    )
    assert (flag(d, "device"), flag(p, "device")) == ("cuda", "cpu")
    assert (decode["priorityClassName"], decode["runtimeClassName"]) == ("inference-high", "nvidia")
    assert "priorityClassName" not in prefill and "runtimeClassName" not in prefill
    (shm,) = [v for v in decode["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    mounts = {m["mountPath"]: m["name"] for m in d["volumeMounts"]}
    assert mounts["/dev/shm"] == "dshm" and mounts["/var/cache/triton"] == "triton-cache"
    assert (
        d["startupProbe"]["failureThreshold"] == 120 and d["livenessProbe"]["timeoutSeconds"] == 10
    )
    assert d["readinessProbe"]["timeoutSeconds"] == 3  # the defaults where not overridden
    assert flag(d, "dtype") == flag(p, "dtype") and flag(d, "block-size") == flag(p, "block-size")


@pytest.mark.parametrize(("set_id", "host", "redis_bind"), [("default", "0.0.0.0", ["0.0.0.0"]),
                                                          ("ipv6", "::", ["*", "::*"])])  # fmt: skip
def test_every_server_listens_on_the_listen_address(rendered, set_id, host, redis_bind):
    deployments = of_kind(rendered[set_id], "Deployment").values()
    for deployment in deployments:
        c = deployment["spec"]["template"]["spec"]["containers"][0]
        if c.get("command", [""])[0] == "pdserve":
            assert flag(c, "host") == host, c["name"]
        elif c.get("command") == ["valkey-server"]:
            args = c["args"]
            at = args.index("--bind") + 1
            assert args[at : at + len(redis_bind)] == redis_bind
            assert args[at + len(redis_bind)].startswith("--")
    assert any(c == "redis" for c in map(component, deployments))


def test_notes_tell_how_to_reach_the_gateway_and_run_status():
    done = helm("install", "t", str(CHART), "--dry-run=client", "--namespace", "pdserve")
    notes = done.stdout.split("NOTES:", 1)[1]
    assert "port-forward svc/t-pdserve-gateway 8000:80" in notes
    assert "exec deploy/t-pdserve-gateway -- pdserve status" in notes
    assert "get secret t-pdserve -o jsonpath='{.data.api-key}'" in notes


def test_the_gateway_is_ready_when_it_can_route_and_alive_when_it_serves(rendered):
    deployments = of_kind(rendered["default"], "Deployment")
    (c,) = deployments["t-pdserve-gateway"]["spec"]["template"]["spec"]["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert (
        c["livenessProbe"]["httpGet"]["path"] == c["startupProbe"]["httpGet"]["path"] == "/health"
    )


def test_under_tls_workers_are_probed_over_http_on_their_metrics_port(rendered):
    for name, deployment in of_kind(rendered["colocated-tls"], "Deployment").items():
        (c,) = deployment["spec"]["template"]["spec"]["containers"]
        if component(deployment) in ("decode", "prefill", "kvstore"):
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                assert c[kind]["httpGet"] == {"path": "/health", "port": "metrics"}, name


def test_the_gateway_shows_clients_its_public_certificate_never_the_internal_one(rendered):
    for set_id, public in (("default", False), ("colocated-tls", True)):
        gateway = of_kind(rendered[set_id], "Deployment")["t-pdserve-gateway"]
        spec = gateway["spec"]["template"]["spec"]
        (c,) = spec["containers"]
        secrets = {v["name"]: v.get("secret", {}).get("secretName") for v in spec["volumes"]}
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        service = of_kind(rendered[set_id], "Service")["t-pdserve-gateway"]
        grpc_port = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
        if public:
            assert flag(c, "ssl-certfile") == "/etc/pdserve/public-tls/tls.crt"
            assert flag(c, "ssl-keyfile") == "/etc/pdserve/public-tls/tls.key"
            assert secrets["public-tls"] == "pdserve-public-tls"
            assert mounts["public-tls"] == "/etc/pdserve/public-tls"
            assert "appProtocol" not in grpc_port  # TLS, not h2c
            # The internal certificate stays the gateway's identity towards the workers.
            assert flag(c, "tls-cert") == "/etc/pdserve/tls/tls.crt"
        else:
            assert flag(c, "ssl-certfile") is None and "public-tls" not in secrets
            assert grpc_port["appProtocol"] == "kubernetes.io/h2c"
        scheme = "HTTPS" if public else "HTTP"
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[kind]["httpGet"]["scheme"] == scheme, (set_id, kind)


def _checksums(docs: list[dict]) -> dict[str, str]:
    return {
        component(d): d["spec"]["template"]["metadata"]["annotations"]["checksum/secrets"]
        for d in of_kind(docs, "Deployment").values()
    }


def test_pools_roll_when_what_they_read_at_start_changes(rendered):
    """The API key and the Redis URL are read once at start: a change of either rolls the
    pods that read it (their template's checksum changes); the internal token is followed
    in place, so rotating it rolls nothing."""
    base = {"apiKey.value": "key-1", "redis.password": "pass-1"}
    base["internalToken.value"] = "token-1-0123456789abcdef"
    before = _checksums(render(set_values=base))
    changed = {
        "apiKey.value": {"gateway"},
        "redis.password": {"gateway", "prefill", "decode", "kvstore", "redis"},
        "internalToken.value": set(),
    }
    for key, rolled in changed.items():
        after = _checksums(render(set_values={**base, key: base[key].replace("1", "2")}))
        assert {c for c in after if after[c] != before[c]} == rolled, key
    # Made at random in one render: the pods' checksum is of the values the Secret holds.
    docs = rendered["default"]
    data = of_kind(docs, "Secret")["t-pdserve"]["data"]
    plain = {k: base64.b64decode(v).decode() for k, v in data.items()}
    want = f"redis-url={plain['redis-url']}\napi-key={plain['api-key']}"
    assert _checksums(docs)["gateway"] == hashlib.sha256(want.encode()).hexdigest()


def test_every_pod_is_scraped_once_on_its_metrics_port(rendered):
    docs = rendered["autoscaling-monitoring"]
    (monitor,) = of_kind(docs, "PodMonitor").values()
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]
    for name, deployment in of_kind(docs, "Deployment").items():
        if component(deployment) == "redis":
            continue
        (c,) = deployment["spec"]["template"]["spec"]["containers"]
        assert "metrics" in {p["name"] for p in c["ports"]}, name
    gateway = of_kind(docs, "Deployment")["t-pdserve-gateway"]
    (c,) = gateway["spec"]["template"]["spec"]["containers"]
    assert flag(c, "metrics-port") == "9400"
    both = template(
        set_values={
            "monitoring.podMonitor.enabled": True,
            "monitoring.serviceMonitor.enabled": True,
        },
        check=False,
    )
    assert both.returncode != 0 and "not both" in both.stderr
    only_gateways = render(set_values={"monitoring.serviceMonitor.enabled": True})
    (sm,) = of_kind(only_gateways, "ServiceMonitor").values()
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"]
    service = of_kind(only_gateways, "Service")["t-pdserve-gateway-metrics"]
    assert all(
        v == sm["spec"]["selector"]["matchLabels"].get(k)
        for k, v in service["metadata"]["labels"].items()
        if k in sm["spec"]["selector"]["matchLabels"]
    )
    assert [p["name"] for p in service["spec"]["ports"]] == ["metrics"]


def test_keda_scales_a_pool_on_its_own_queue_with_a_fallback(rendered):
    (scaled,) = of_kind(rendered["autoscaling-monitoring"], "ScaledObject").values()
    assert component(scaled) == "prefill"
    (trigger,) = scaled["spec"]["triggers"]  # no CPU trigger beside a fallback
    assert 'role="prefill"' in trigger["metadata"]["query"]
    assert scaled["spec"]["fallback"] == {"failureThreshold": 3, "replicas": 2}


def test_every_emptydir_has_a_size_limit(rendered):
    for set_id, docs in rendered.items():
        for name, deployment in of_kind(docs, "Deployment").items():
            for volume in deployment["spec"]["template"]["spec"]["volumes"]:
                if "emptyDir" in volume:
                    assert volume["emptyDir"].get("sizeLimit"), (set_id, name, volume["name"])


PLANNER = {"autoscaling.mode": "planner", "planner.profile": '{"version": 1}'}  # not parsed
AUTOSCALERS = ("HorizontalPodAutoscaler", "ScaledObject")


def only_container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def test_the_planner_sizes_the_prefill_and_decode_pools_alone(rendered):
    docs = rendered["planner"]
    deployments = of_kind(docs, "Deployment")
    planner = deployments["t-pdserve-planner"]
    spec = planner["spec"]["template"]["spec"]
    c = only_container(planner)
    assert (planner["spec"]["replicas"], planner["spec"]["strategy"]) == (1, {"type": "Recreate"})
    assert c["command"] == ["pdserve", "planner"] and c["image"].endswith("-slim")
    # Its bounds are the pools' autoscaling bounds; its targets and pace the planner's values.
    bounds = [flag(c, f) for f in ("min-prefill", "max-prefill", "min-decode", "max-decode")]
    assert bounds == ["1", "6", "2", "12"]
    assert [flag(c, f) for f in ("ttft-p90-ms", "itl-p90-ms", "interval", "scale-down-delay")] == [
        "1500",
        "150",
        "15",
        "600",
    ]
    assert [flag(c, f) for f in ("disaggregation", "local-prefill-threshold", "actuator")] == [
        "on",
        "0",
        "kubernetes",
    ]
    assert flag(c, "dry-run") is None
    # It scales exactly the pools' Deployments, which leave their replicas to it.
    pools = [flag(c, "prefill-deployment"), flag(c, "decode-deployment")]
    assert pools == ["t-pdserve-prefill", "t-pdserve-decode"]
    for name in pools:
        assert "replicas" not in deployments[name]["spec"], name
    assert deployments["t-pdserve-kvstore"]["spec"]["replicas"] == 1
    # The gateways keep their own HPA; no autoscaler touches the planner's pools.
    hpas = of_kind(docs, "HorizontalPodAutoscaler").values()
    assert {h["spec"]["scaleTargetRef"]["name"] for h in hpas} == {"t-pdserve-gateway"}
    assert not of_kind(docs, "ScaledObject")
    # The profile, from its ConfigMap, at the path --profile names.
    config = of_kind(docs, "ConfigMap")["t-pdserve-planner-profile"]
    assert config["data"]["profile.json"].startswith('{"version": 1,')
    (volume,) = [v for v in spec["volumes"] if v["name"] == "profile"]
    assert volume["configMap"]["name"] == "t-pdserve-planner-profile"
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "profile"]
    assert flag(c, "profile") == f"{mount['mountPath']}/{volume['configMap']['items'][0]['path']}"
    # Redis and the internal token as every pod gets them; a pod as locked down as theirs.
    decode = deployments["t-pdserve-decode"]["spec"]["template"]["spec"]
    env = {e["name"]: e for e in c["env"]}
    for e in decode["containers"][0]["env"]:
        if e["name"].startswith(("PDSERVE_REDIS", "PDSERVE_INTERNAL_TOKEN")):
            assert env.pop(e["name"]) == e
    assert env == {}
    assert c["securityContext"] == decode["containers"][0]["securityContext"]
    assert spec["securityContext"] == decode["securityContext"]
    assert c["resources"] == {
        "requests": {"cpu": "100m", "memory": "256Mi"},
        "limits": {"memory": "256Mi"},
    }
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[kind]["httpGet"] == {"path": "/health", "port": "metrics"}
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"metrics": 9400}
    assert flag(c, "metrics-port") == "9400"
    (monitor,) = of_kind(docs, "PodMonitor").values()
    assert labels_match(monitor["spec"]["selector"], pod_labels(planner))


def test_the_planner_reads_every_gateway_pod_on_its_metrics_port(rendered):
    docs = rendered["planner"]
    deployments = of_kind(docs, "Deployment")
    c = only_container(deployments["t-pdserve-planner"])
    service = of_kind(docs, "Service")["t-pdserve-gateway-pods"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    (port,) = service["spec"]["ports"]
    assert flag(c, "gateway-metrics") == f"http://t-pdserve-gateway-pods:{port['port']}/metrics"
    gateway = deployments["t-pdserve-gateway"]
    assert labels_match({"matchLabels": service["spec"]["selector"]}, pod_labels(gateway))
    assert port["targetPort"] == "metrics"
    assert flag(only_container(gateway), "metrics-port") == str(port["port"])
    # The gateways' NetworkPolicy admits the planner there, and no other pod of the release.
    policy = of_kind(docs, "NetworkPolicy")["t-pdserve-gateway"]
    peers = [p for rule in policy["spec"]["ingress"] for p in rule.get("from", [])]
    (planner,) = [p["podSelector"] for p in peers if "podSelector" in p]
    assert planner["matchLabels"]["app.kubernetes.io/component"] == "planner"
    assert labels_match(planner, pod_labels(deployments["t-pdserve-planner"]))
    (rule,) = [
        r for r in policy["spec"]["ingress"] if {"podSelector": planner} in r.get("from", [])
    ]
    assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    default = of_kind(rendered["default"], "NetworkPolicy")["t-pdserve-gateway"]
    assert "podSelector" not in str(default["spec"]["ingress"])


def test_the_planners_account_may_scale_its_two_pools_and_nothing_else(rendered):
    docs = rendered["planner"]
    (account,) = of_kind(docs, "ServiceAccount").values()
    (role,) = of_kind(docs, "Role").values()
    (binding,) = of_kind(docs, "RoleBinding").values()
    assert account["metadata"]["name"] == "t-pdserve-planner"
    assert account["automountServiceAccountToken"] is True
    assert role["rules"] == [
        {
            "apiGroups": ["apps"],
            "resources": ["deployments/scale"],
            "verbs": ["get", "patch"],
            "resourceNames": ["t-pdserve-prefill", "t-pdserve-decode"],
        }
    ]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "t-pdserve-planner"}]
    assert not of_kind(docs, "ClusterRole") and not of_kind(docs, "ClusterRoleBinding")
    # Its pod alone runs as that account with its token; no other pod mounts one.
    for name, deployment in of_kind(docs, "Deployment").items():
        spec = deployment["spec"]["template"]["spec"]
        planner = name == "t-pdserve-planner"
        assert spec["automountServiceAccountToken"] is planner, name
        assert (spec.get("serviceAccountName") == "t-pdserve-planner") is planner, name


def test_without_a_prefill_pool_the_planner_scales_the_decode_pool_alone():
    docs = render(set_values={**PLANNER, "disaggregation": False, "planner.dryRun": True})
    for doc in docs:
        validate(doc)
    c = only_container(of_kind(docs, "Deployment")["t-pdserve-planner"])
    (role,) = of_kind(docs, "Role").values()
    assert role["rules"][0]["resourceNames"] == ["t-pdserve-decode"]
    assert (flag(c, "disaggregation"), flag(c, "dry-run")) == ("off", "on")
    assert flag(c, "decode-deployment") == "t-pdserve-decode" and flag(c, "max-decode") == "8"
    assert flag(c, "prefill-deployment") is None and flag(c, "min-prefill") is None


def test_a_profile_of_ones_own_is_mounted_from_its_configmap():
    docs = render(set_values={"autoscaling.mode": "planner", "planner.existingConfigMap": "mine"})
    assert not of_kind(docs, "ConfigMap")
    template_ = of_kind(docs, "Deployment")["t-pdserve-planner"]["spec"]["template"]
    (volume,) = [v for v in template_["spec"]["volumes"] if v["name"] == "profile"]
    items = [{"key": "profile.json", "path": "profile.json"}]
    assert volume["configMap"] == {"name": "mine", "items": items}
    assert "checksum/profile" not in template_["metadata"]["annotations"]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"decode.autoscaling.enabled": True},
            "set decode.autoscaling.enabled and decode.autoscaling.keda.enabled to false",
        ),
        (
            {
                "prefill.autoscaling.keda": {
                    "enabled": True,
                    "serverAddress": "http://p",
                    "query": "q",
                }
            },
            "autoscaling.mode planner sizes the prefill pool",
        ),
        ({"planner.profile": ""}, "needs the pools' profile: planner.profile"),
        ({"planner.existingConfigMap": "mine"}, "not both"),
        ({"planner.profile": "{not json"}, "planner.profile is not a JSON object"),
    ],
    ids=["decode-hpa", "prefill-keda", "no-profile", "two-profiles", "not-json"],
)
def test_planner_mode_refuses(values, message):
    done = template(set_values={**PLANNER, **values}, check=False)
    assert done.returncode != 0 and message in done.stderr, done.stderr


def test_planner_mode_leaves_the_gateways_and_kvstores_autoscaling_alone():
    values = {**PLANNER, "kvstore.autoscaling.enabled": True, "gateway.autoscaling.enabled": True}
    hpas = of_kind(render(set_values=values), "HorizontalPodAutoscaler")
    assert set(hpas) == {"t-pdserve-gateway", "t-pdserve-kvstore"}
    # Without a prefill pool, its autoscaling block owns nothing: no conflict.
    colocated = {**PLANNER, "disaggregation": False, "prefill.autoscaling.enabled": True}
    assert not of_kind(render(set_values=colocated), "HorizontalPodAutoscaler")


def test_mode_off_renders_no_autoscaler_whatever_the_pools_say(rendered):
    every_pool = CHART / "ci" / "autoscaling-monitoring-values.yaml"
    docs = render([every_pool], {"autoscaling.mode": "off"})
    assert not [d for d in docs if d["kind"] in AUTOSCALERS]
    deployments = of_kind(docs, "Deployment")
    assert "t-pdserve-planner" not in deployments
    for name, deployment in deployments.items():
        assert deployment["spec"]["replicas"] >= 1, name  # the chart's replicas again
    # The same values in mode hpa (the default): every pool's autoscaler, as before.
    scaled = [d for d in rendered["autoscaling-monitoring"] if d["kind"] in AUTOSCALERS]
    assert len(scaled) == 4


def test_notes_say_the_planner_sizes_the_pools():
    args = ["install", "t", str(CHART), "--dry-run=client", "--namespace", "pdserve"]
    done = helm(*args, *values_args(set_values=PLANNER))
    notes = done.stdout.split("NOTES:", 1)[1]
    assert "The planner sizes the prefill and decode pools" in notes
    assert "logs deploy/t-pdserve-planner" in notes
