"""A stand-in of the Kubernetes API server's scale subresource, for the planner's tests: a
real HTTP(S) server on 127.0.0.1 that holds a few Deployments, checks the bearer token (when
it has one) and an RBAC rule like the chart's planner Role, and records every request."""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pdserve.planner.kubernetes import MERGE_PATCH

SCALE_PATH = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)/scale$")
ACCOUNT = "system:serviceaccount:pdserve:t-pdserve-planner"


@dataclass
class Request:
    method: str
    path: str
    authorization: str | None
    content_type: str | None
    body: dict | None


@dataclass
class ScaleAPI:
    """The scale subresource of the Deployments it holds, as the API server serves it."""

    token: str | None  # None: no token asked for (as behind `kubectl proxy`)
    replicas: dict[tuple[str, str], int]
    # (verb, namespace, name) the caller's Role allows: the chart's planner Role
    allowed: set[tuple[str, str, str]] = field(default_factory=set)
    requests: list[Request] = field(default_factory=list)
    url: str = ""

    def answer(self, req: Request) -> tuple[int, dict]:
        self.requests.append(req)
        if self.token is not None and req.authorization != f"Bearer {self.token}":
            return 401, _status(401, "Unauthorized", "Unauthorized")
        m = SCALE_PATH.match(req.path)
        if not m:
            return 404, _status(404, "NotFound", "the server could not find the requested resource")
        ns, name = m.groups()
        verb = {"GET": "get", "PATCH": "patch"}[req.method]
        if (verb, ns, name) not in self.allowed:
            message = (
                f'deployments.apps "{name}" is forbidden: User "{ACCOUNT}" cannot {verb} '
                f'resource "deployments/scale" in API group "apps" in the namespace "{ns}"'
            )
            return 403, _status(403, "Forbidden", message)
        if (ns, name) not in self.replicas:
            return 404, _status(404, "NotFound", f'deployments.apps "{name}" not found')
        if req.method == "PATCH":
            if req.content_type != MERGE_PATCH:
                return 415, _status(415, "UnsupportedMediaType", str(req.content_type))
            self.replicas[ns, name] = req.body["spec"]["replicas"]
        return 200, _scale(ns, name, self.replicas[ns, name])


def _status(code: int, reason: str, message: str) -> dict:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _scale(ns: str, name: str, replicas: int) -> dict:
    spec = {"replicas": replicas} if replicas else {}  # omitempty, as the API server has it
    return {
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
        "status": {"replicas": replicas},
    }


class Handler(BaseHTTPRequestHandler):
    server: Server

    def _serve(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        req = Request(
            self.command,
            self.path,
            self.headers.get("Authorization"),
            self.headers.get("Content-Type"),
            json.loads(raw) if raw else None,
        )
        code, body = self.server.api.answer(req)
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_PATCH = _serve

    def log_message(self, *args) -> None:
        pass


class Server(ThreadingHTTPServer):
    daemon_threads = True
    api: ScaleAPI


def serve(api: ScaleAPI, wrap=None) -> Server:
    """Serve ``api`` on 127.0.0.1 from a thread (``wrap(socket)``: TLS); ``api.url`` set."""
    server = Server(("127.0.0.1", 0), Handler)
    server.api = api
    scheme = "http"
    if wrap is not None:
        server.socket = wrap(server.socket)
        scheme = "https"
    api.url = f"{scheme}://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    return server
