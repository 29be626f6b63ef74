"""``RemoteOpenAIServer`` for vLLM's tests, started as a pdserve cluster: one decode worker
and a gateway that prefills on it too (``--disaggregation off``), serving pdserve's model
(PEER_VLLM_MODEL, SmolLM2-135M-Instruct) under the name the test asks for.

The ``vllm serve`` flags pdserve has are passed on (to the gateway, the worker or both);
the others are ignored and listed in the servers' log (``<logs>/servers.log``).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

import httpx
import openai
import requests

from pdserve.testing.cluster import Cluster

# Gateway flags whose vLLM name and meaning are pdserve's too (booleans).
GATEWAY_SWITCHES = (
    "--enable-auto-tool-choice",
    "--enable-prompt-tokens-details",
    "--return-tokens-as-token-ids",
    "--enable-tokenizer-info-endpoint",
    "--enable-force-include-usage",
)
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
PDSERVE_MAX_LOGPROBS = 20
# vLLM switches that take no value (anything else takes the words up to the next flag).
_VLLM_SWITCHES = {
    "--enforce-eager",
    "--trust-remote-code",
    "--enable-chunked-prefill",
    "--no-enable-chunked-prefill",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--enable-lora",
    "--enable-prompt-embeds",
    "--trust-request-chat-template",
    "--skip-tokenizer-init",
    "--no-async-scheduling",
    "--exclude-tools-when-tool-choice-none",
    "--enable-per-request-metrics",
    "--enable-server-load-tracking",
    "--enable-request-id-headers",
    "--enable-metrics",
    "--disable-log-requests",
    "--enable-log-requests",
    "--disable-frontend-multiprocessing",
    *GATEWAY_SWITCHES,
}

_SERVERS_LOCK = threading.Lock()
_COUNTER = [0]


def parse_vllm_args(args: list[str]) -> dict[str, list[str]]:
    """``vllm serve`` flags as ``{"--flag": [values]}`` (a switch: ``[]``); a later repeat wins."""
    out: dict[str, list[str]] = {}
    i = 0
    while i < len(args):
        word = args[i]
        if not word.startswith("-") or _is_number(word):
            i += 1  # a stray value: nothing to pin it on
            continue
        if "=" in word and word.startswith("--"):
            flag, value = word.split("=", 1)
            out[flag] = [value]
            i += 1
            continue
        flag = {"-p": "--port", "-tp": "--tensor-parallel-size"}.get(word, word)
        values = []
        i += 1
        if flag not in _VLLM_SWITCHES:
            while i < len(args) and (not args[i].startswith("-") or _is_number(args[i])):
                values.append(args[i])
                i += 1
        out[flag] = values
    return out


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def get_open_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first(flags: dict[str, list[str]], name: str) -> str | None:
    values = flags.get(name)
    return values[0] if values else None


def pdserve_commands(
    model: str, flags: dict[str, list[str]], env: dict[str, str], examples_root: Path
) -> tuple[list[str], list[str], list[str]]:
    """(decode worker flags, gateway flags, the vLLM flags ignored) for one ``vllm serve``."""
    worker = [
        *("--dtype", "float32", "--enforce-eager"),
        *("--kv-cache-memory", os.environ.get("PEER_VLLM_KV_CACHE", "512MiB")),
    ]
    name = _first(flags, "--served-model-name") or model
    gateway = ["--disaggregation", "off", "--served-model-name", name]
    used = {"--port", "--seed", "--served-model-name", "--model", "--host", "--uds"}
    if "--seed" in flags:
        worker += ["--seed", _first(flags, "--seed") or "0"]
    if "--host" in flags and _first(flags, "--host"):
        gateway += ["--host", _first(flags, "--host")]
    if _first(flags, "--max-model-len"):
        value = _first(flags, "--max-model-len")
        worker += ["--max-model-len", value]
        gateway += ["--max-model-len", value]
        used.add("--max-model-len")
    for switch in GATEWAY_SWITCHES:
        if switch in flags:
            gateway.append(switch)
            used.add(switch)
    parser = _first(flags, "--tool-call-parser")
    if parser in TOOL_CALL_PARSERS:
        gateway += ["--tool-call-parser", parser]
        used.add("--tool-call-parser")
    template = _first(flags, "--chat-template")
    if template:
        path = Path(template)
        if not path.is_absolute():
            path = examples_root / template
        if path.is_file():
            gateway += ["--chat-template", str(path)]
            used.add("--chat-template")
    if _first(flags, "--max-logprobs"):
        asked = int(_first(flags, "--max-logprobs"))
        gateway += ["--max-logprobs", str(max(0, min(asked, PDSERVE_MAX_LOGPROBS)))]
        used.add("--max-logprobs")
    if _first(flags, "--root-path"):
        gateway += ["--root-path", _first(flags, "--root-path")]
        used.add("--root-path")
    key = _first(flags, "--api-key") or env.get("VLLM_API_KEY")
    if key:
        gateway += ["--api-key", key]
        used.add("--api-key")
    ignored = [f for f in flags if f not in used]
    return worker, gateway, ignored


class RemoteOpenAIServer:
    """vLLM's test server interface, backed by a pdserve decode worker and gateway."""

    DUMMY_API_KEY = "token-abc123"
    _active: ClassVar[set[RemoteOpenAIServer]] = set()

    def __init__(
        self,
        model: str,
        vllm_serve_args: list[str],
        *,
        env_dict: dict[str, str] | None = None,
        seed: int | None = 0,
        auto_port: bool = True,
        max_wait_seconds: float | None = None,
        override_hf_configs: dict[str, Any] | None = None,
    ) -> None:
        if auto_port:
            if "-p" in vllm_serve_args or "--port" in vllm_serve_args:
                raise ValueError("You have manually specified the port when `auto_port=True`.")
            if "--uds" not in vllm_serve_args:
                vllm_serve_args = vllm_serve_args + ["--port", str(get_open_port())]
        if seed is not None:
            if "--seed" in vllm_serve_args:
                raise ValueError(f"You have manually specified the seed when `seed={seed}`.")
            vllm_serve_args = vllm_serve_args + ["--seed", str(seed)]
        if override_hf_configs is not None:
            vllm_serve_args = vllm_serve_args + ["--hf-overrides", json.dumps(override_hf_configs)]

        flags = parse_vllm_args(["--model", model, *vllm_serve_args])
        self.model = model
        self.uds = _first(flags, "--uds")
        self.show_hidden_metrics = "--show-hidden-metrics-for-version" in flags
        env = dict(env_dict or {})
        examples_root = Path(os.environ.get("PEER_VLLM_VLLM_ROOT", "."))
        worker, gateway, ignored = pdserve_commands(model, flags, env, examples_root)
        if self.uds:
            self.host, self.port = None, None
            http_port = "0"
        else:
            self.host = _first(flags, "--host") or "127.0.0.1"
            self.port = int(_first(flags, "--port") or get_open_port())
            http_port = str(self.port)
        gateway += ["--http-port", http_port]

        with _SERVERS_LOCK:
            _COUNTER[0] += 1
            number = _COUNTER[0]
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", model)[-60:]
        logs = Path(os.environ.get("PEER_VLLM_LOGS", "peer-logs"))
        self.log_dir = logs / f"server-{number:03d}-{slug}"
        served = ["--model", os.environ["PEER_VLLM_MODEL"]]
        _note(
            logs,
            f"server {number}: {model} {' '.join(vllm_serve_args)}\n"
            f"  decode: {' '.join(worker)}\n  gateway: {' '.join(gateway)}\n"
            f"  ignored vLLM flags: {' '.join(ignored) or '-'}\n",
        )
        self.cluster = Cluster(self.log_dir)
        self._closed = False
        RemoteOpenAIServer._active.add(self)
        timeout = max_wait_seconds or 480
        try:
            decode = self.cluster.start(
                "decode", "pdserve.decode", *served, *worker, timeout=timeout, env=env
            )
            self.gateway = self.cluster.start(
                "gateway",
                "pdserve.gateway",
                "--decode",
                decode.address,
                *gateway,
                *served,
                timeout=timeout,
                env=env,
            )
            self.http_address = self.gateway.addresses["gateway-http"]
            self.proc = self.gateway.proc
            self._wait_for_health(timeout)
        except BaseException:
            self._shutdown()
            raise

    def _wait_for_health(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://{self.http_address}/health"
        while True:
            with contextlib.suppress(Exception):
                if requests.get(url, timeout=5).status_code == 200:
                    return
            if self.proc.poll() is not None:
                raise RuntimeError("Server exited unexpectedly.")
            if time.monotonic() > deadline:
                raise RuntimeError("Server failed to start in time.")
            time.sleep(0.5)

    def __enter__(self) -> RemoteOpenAIServer:
        return self

    def __exit__(self, exc_type, exc_value, traceback) -> None:
        self._shutdown()

    def _shutdown(self) -> None:
        """Stop the cluster; one interrupted (a test's timeout) stays listed, for
        ``shutdown_all`` at the session's end to stop again."""
        if self._closed:
            return
        self.cluster.stop_all()
        self._closed = True
        RemoteOpenAIServer._active.discard(self)

    @classmethod
    def shutdown_many(cls, servers) -> None:
        for server in servers:
            server._shutdown()

    @classmethod
    def shutdown_all(cls) -> None:
        for server in list(cls._active):
            with contextlib.suppress(Exception):
                server._shutdown()

    @property
    def url_root(self) -> str:
        if self.uds:
            return f"http://{self.uds.split('/')[-1]}"
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        path = "/".join(part.strip("/") for part in parts if part)
        return f"{self.url_root}/{path}"

    def get_client(self, **kwargs: Any) -> openai.OpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(
            base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs
        )

    def get_async_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(
            base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs
        )

    def get_client_anthropic(self, **kwargs: Any):
        import anthropic

        kwargs.setdefault("timeout", 600)
        return anthropic.Anthropic(
            base_url=self.url_for(), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs
        )

    def get_async_client_anthropic(self, **kwargs: Any):
        import anthropic

        kwargs.setdefault("timeout", 600)
        return anthropic.AsyncAnthropic(
            base_url=self.url_for(), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs
        )

    def uds_client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=self.uds))


def _note(logs: Path, text: str) -> None:
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / "servers.log", "a") as f:
        f.write(text)


atexit.register(RemoteOpenAIServer.shutdown_all)
