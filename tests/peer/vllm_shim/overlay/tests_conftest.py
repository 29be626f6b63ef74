"""vLLM's tests/conftest.py for the pdserve peer run: the fixtures the OpenAI-server tests
use, without vLLM, torch or GPUs. Fixtures that need vLLM's runners are placeholders."""

from __future__ import annotations

import http.server
import mimetypes
import os
import socket
import threading
from collections.abc import Generator

import pytest
from pdserve_peer_shim import vllm_stub

_TEST_DIR = os.path.dirname(__file__)


def pytest_addoption(parser):
    parser.addoption("--optional", action="store_true", default=False, help="run optional test")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--optional"):
        return
    skip_optional = pytest.mark.skip(reason="need --optional option to run")
    for item in items:
        if "optional" in item.keywords:
            item.add_marker(skip_optional)


@pytest.fixture
def sample_json_schema():
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "skills": {"type": "array", "items": {"type": "string"}},
            "grade": {"type": "string", "pattern": "^[A-D]$"},
            "email": {
                "type": "string",
                "pattern": "^[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\\.[a-zA-Z]{2,}$",
            },
            "work_history": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "company": {"type": "string"},
                        "duration": {"type": "number", "minimum": 0.0, "maximum": 100.0},
                        "position": {"type": "string"},
                    },
                    "required": ["company", "duration", "position"],
                    "additionalProperties": False,
                },
                "minItems": 0,
                "maxItems": 3,
            },
        },
        "required": ["name", "age", "skills", "grade", "email", "work_history"],
        "additionalProperties": False,
        "minProperties": 1,
        "maxProperties": 10,
    }


@pytest.fixture
def example_prompts() -> list[str]:
    with open(os.path.join(_TEST_DIR, "prompts", "example.txt")) as f:
        return [line for line in f.read().splitlines() if line]


@pytest.fixture(scope="session")
def num_gpus_available() -> int:
    return 0


@pytest.fixture(scope="session")
def hf_runner():
    return vllm_stub.placeholder("tests.conftest.HfRunner")


@pytest.fixture(scope="session")
def vllm_runner():
    return vllm_stub.placeholder("tests.conftest.VllmRunner")


class AssetHandler(http.server.BaseHTTPRequestHandler):
    """Serves vLLM's image assets (vllm.assets: a placeholder here, so every image is 500)."""

    def log_message(self, *args, **kwargs):
        pass

    def do_GET(self):
        filename = self.path.lstrip("/")
        if not filename or "." not in filename:
            self.send_error(404, "Missing filename (expected /<name>.<ext>)")
            return
        base, ext = filename.rsplit(".", 1)
        ext = ext.lower()
        if ext not in ["jpg", "png"]:
            self.send_error(404, f"Unsupported extension: .{ext}")
            return
        try:
            from vllm.assets.image import ImageAsset

            data = ImageAsset(base).read_bytes(ext=ext)
        except Exception as e:
            self.send_error(500, f"Failed to load asset: {ext} {base} {e} ")
            return
        ctype, _ = mimetypes.guess_type(filename)
        self.send_response(200)
        self.send_header("Content-Type", ctype or f"image/{ext}")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _find_free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalAssetServer:
    def __init__(self, address: str = "127.0.0.1") -> None:
        self.address = address
        self.port = -1
        self.server = None
        self.thread = None

    def __enter__(self):
        self.port = _find_free_port()
        self.server = http.server.ThreadingHTTPServer((self.address, self.port), AssetHandler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        if self.server:
            self.server.shutdown()
        if self.thread:
            self.thread.join()
        return False

    @property
    def base_url(self) -> str:
        return f"http://{self.address}:{self.port}"

    def url_for(self, name: str) -> str:
        return f"{self.base_url}/{name}"

    def get_image_asset(self, name: str):
        raise vllm_stub.VllmInternalError("vLLM-internal: image assets need vllm.multimodal")


@pytest.fixture(scope="session")
def local_asset_server() -> Generator[LocalAssetServer, None, None]:
    with LocalAssetServer() as srv:
        yield srv


@pytest.fixture
def image_url(request, local_asset_server) -> str:
    return local_asset_server.url_for(request.param)


@pytest.fixture
def image_urls(request, local_asset_server) -> list[str]:
    return [local_asset_server.url_for(name) for name in request.param]
