"""`pdserve planner --dry-run` as a process: it reads a gateway's metrics (a stand-in that
serves rising counters), the pools from a real Redis (signed entries of one prefill and one
decode worker, and one entry signed with another token, refused), decides for each pool,
exports its decisions on its own /metrics, loads neither torch nor numpy (it runs in the
slim image), and stops on SIGTERM; and the same loop patching a stand-in Kubernetes scale
API (tests/helpers/kube_api.py), only its own pools' Deployments."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from pdserve.controlplane.publisher import RegistryPublisher
from pdserve.controlplane.registry import WorkerInfo
from pdserve.controlplane.signing import registry_key
from pdserve.planner.model import Curve, Profile
from tests.helpers.import_trace import imported_modules
from tests.helpers.kube_api import ScaleAPI, serve

TOKEN = "planner-test-token"

METRICS = """\
pdserve:request_success_total{{finished_reason="length",model_name="m",role="gateway"}} {done}
pdserve:num_requests_running{{model_name="m",role="gateway"}} 3
pdserve:num_requests_waiting{{model_name="m",role="gateway"}} 0
pdserve:request_prompt_tokens_sum{{model_name="m",role="gateway"}} {prompt}
pdserve:request_prompt_tokens_count{{model_name="m",role="gateway"}} {done}
pdserve:request_generation_tokens_sum{{model_name="m",role="gateway"}} {output}
pdserve:request_generation_tokens_count{{model_name="m",role="gateway"}} {done}
"""


class _Gateway(BaseHTTPRequestHandler):
    """Counters of 20 requests a second of 512-token prompts and 64-token outputs."""

    began = time.monotonic()

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        done = int((time.monotonic() - self.began) * 20)
        body = METRICS.format(done=done, prompt=512 * done, output=64 * done).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def profile() -> Profile:
    return Profile(
        model="m",
        dtype="float32",
        hardware={"class": "avx2", "cores_per_worker": 1},
        prefill=Curve((64.0, 512.0), (40.0, 200.0)),
        handover=Curve((64.0, 512.0), (2.0, 6.0)),
        decode=Curve((1.0, 8.0, 32.0), (10.0, 14.0, 30.0)),
        context=56,
        attention_ms_per_token=0.001,
    )


async def _register(url: str) -> list[RegistryPublisher]:
    key = registry_key(TOKEN)
    pubs = [
        RegistryPublisher(url, WorkerInfo("p0", "prefill", "127.0.0.1:1", model="m"), key=key),
        RegistryPublisher(url, WorkerInfo("d0", "decode", "127.0.0.1:2", model="m"), key=key),
        RegistryPublisher(
            url, WorkerInfo("d9", "decode", "127.0.0.1:3"), key=registry_key("another token")
        ),
    ]
    for pub in pubs:
        await pub.start()
    return pubs


def test_dry_run_decides_for_each_pool_and_exports_it(launcher, redis_server, tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    path = tmp_path / "profile.json"
    profile().save(path)
    (tmp_path / "token").write_text(TOKEN + "\n")
    loop = asyncio.new_event_loop()
    pubs = loop.run_until_complete(_register(redis_server.url))
    try:
        argv = [
            sys.executable, "-X", "importtime", "-m", "pdserve.cli", "planner", "--dry-run",
            "--profile", str(path), "--redis-url", redis_server.url,
            "--internal-token-file", str(tmp_path / "token"),
            "--gateway-metrics", f"http://localhost:{server.server_port}/metrics",
            "--interval", "0.5", "--window", "5", "--host", "127.0.0.1", "--metrics-port", "0",
            "--ttft-p90-ms", "1000", "--itl-p90-ms", "40", "--max-decode", "6",
        ]  # fmt: skip
        child = launcher.start_ready("planner", argv, ["planner"], timeout=60)
        base = f"http://{child.address}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            log = child.log_text()
            if "decode: up 1 ->" in log and "prefill: " in log:
                break
            time.sleep(0.3)
        log = child.log_text()
        # 20 req/s of 512-token prompts: more than one prefill worker's 5 a second (200 ms
        # each) and than one decode worker's batch: both pools out, from the registry's
        # one signed worker each (the entry signed with another token is not counted).
        assert "decode: up 1 ->" in log, log[-3000:]
        assert "prefill: up 1 ->" in log, log[-3000:]
        rates = [
            float(r) for r in re.findall(r"([\d.]+) req/s, prompts 512, outputs 64 tokens", log)
        ]
        assert rates and all(18 < r < 22 for r in rates), rates
        assert "dry run: decode pool would be set to" in log
        assert httpx.get(f"{base}/health", timeout=5).status_code == 200
        text = httpx.get(f"{base}/metrics", timeout=5).text
        for pool in ("prefill", "decode"):
            line = next(
                x
                for x in text.splitlines()
                if x.startswith("pdserve:planner_desired_replicas{") and f'pool="{pool}"' in x
            )
            assert float(line.split()[-1]) > 1
        decisions = [
            x for x in text.splitlines() if x.startswith("pdserve:planner_decisions_total")
        ]
        assert any('direction="up"' in x and 'pool="decode"' in x for x in decisions)
        assert "pdserve:planner_predicted_ttft_seconds" in text
        child.signal(signal.SIGTERM)
        assert child.proc.wait(30) == 0
        modules = imported_modules(child.log_text())
        assert "httpx" in modules and len(modules) > 100
        heavy = sorted(m for m in modules if m.split(".")[0] in ("torch", "numpy", "transformers"))
        assert heavy == [], heavy[:5]
    finally:
        for pub in pubs:
            loop.run_until_complete(pub.stop())
        loop.close()
        server.shutdown()


def test_planner_patches_only_its_own_pools_deployments(launcher, redis_server, tmp_path):
    """The whole loop against a stand-in scale API: the traffic asks for more of both
    pools; the planner reads and patches the scale of the two Deployments it was given, and
    no other (the gateway's, the kvstore's, another namespace's)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    own = {"prefill": "t-pdserve-prefill", "decode": "t-pdserve-decode"}
    api = ScaleAPI(
        token=None,  # no service account outside a pod: the stand-in asks for none
        replicas={
            ("pdserve", own["prefill"]): 1,
            ("pdserve", own["decode"]): 1,
            ("pdserve", "t-pdserve-gateway"): 2,
            ("pdserve", "t-pdserve-kvstore"): 1,
            ("other", own["decode"]): 1,
        },
        allowed={(v, "pdserve", name) for v in ("get", "patch") for name in own.values()},
    )
    kube = serve(api)
    path = tmp_path / "profile.json"
    profile().save(path)
    (tmp_path / "token").write_text(TOKEN + "\n")
    try:
        argv = [
            sys.executable, "-m", "pdserve.cli", "planner", "--profile", str(path),
            "--redis-url", redis_server.url, "--internal-token-file", str(tmp_path / "token"),
            "--gateway-metrics", f"http://127.0.0.1:{server.server_port}/metrics",
            "--interval", "0.5", "--window", "5", "--host", "127.0.0.1", "--metrics-port", "0",
            "--ttft-p90-ms", "1000", "--itl-p90-ms", "40", "--max-decode", "6",
            "--actuator", "kubernetes", "--kubernetes-api", api.url, "--namespace", "pdserve",
            "--prefill-deployment", own["prefill"], "--decode-deployment", own["decode"],
        ]  # fmt: skip
        child = launcher.start_ready("planner-k8s", argv, ["planner"], timeout=60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            grown = min(api.replicas["pdserve", name] for name in own.values()) > 1
            if grown and "decode: hold" in child.log_text():
                break
            time.sleep(0.3)
        child.signal(signal.SIGTERM)
        assert child.proc.wait(30) == 0
        log = child.log_text()
        assert api.replicas["pdserve", own["decode"]] > 1, log[-3000:]
        assert api.replicas["pdserve", own["prefill"]] > 1, log[-3000:]
        untouched = {
            k: v for k, v in api.replicas.items() if k[1] not in own.values() or k[0] != "pdserve"
        }
        assert untouched == {
            ("pdserve", "t-pdserve-gateway"): 2,
            ("pdserve", "t-pdserve-kvstore"): 1,
            ("other", own["decode"]): 1,
        }
        paths = {f"/apis/apps/v1/namespaces/pdserve/deployments/{n}/scale" for n in own.values()}
        assert {r.path for r in api.requests} == paths
        assert {r.method for r in api.requests} == {"GET", "PATCH"}
        # Once patched, the Deployments' scale is what the planner reads back: it holds.
        assert "decode: hold" in log
    finally:
        kube.shutdown()
        server.shutdown()


def test_up_autoscale_refuses_a_missing_or_bad_profile_before_starting(tmp_path):
    up = [sys.executable, "-m", "pdserve.cli", "up", "--autoscale", "--log-dir", str(tmp_path)]
    missing = subprocess.run(up, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "--autoscale needs --profile" in missing.stderr
    (tmp_path / "bad.json").write_text('{"version": 1}')
    bad = subprocess.run(
        [*up, "--profile", str(tmp_path / "bad.json")], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "not a pdserve profile" in bad.stderr, bad.stderr
    assert "logs in" not in bad.stdout  # nothing started
