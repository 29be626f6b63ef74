"""Every fixture tests share, registered by tests/conftest.py as a pytest plugin: the models
(the prepared SmolLM2, tiny random Llama and Qwen2), Redis-compatible servers, a cluster and
a launcher of a test's own, and the tiny Llama's engine in this process.

A module that serves one cluster to all its tests names its own module-scoped ``cluster``
(or ``gateway``) fixture, built with tests.helpers.clusters."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.local.launcher import Launcher
from pdserve.local.redis_server import RedisServer, start_redis
from pdserve.testing.cluster import Cluster

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The default model, converted once into $PDSERVE_HOME (or ~/.cache/pdserve)."""
    from pdserve.engine.prepare_model import prepare_default_model

    return prepare_default_model(progress=False)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory) -> Path:
    from pdserve.testing.tiny_models import build_tiny_checkpoint

    return build_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory) -> Path:
    from pdserve.testing.tiny_models import build_tiny_checkpoint

    return build_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def tiny_chat_llama_path(tiny_llama_path, tmp_path_factory) -> Path:
    """The tiny Llama with a minimal chat template (its tokenizer has none), named `tiny`."""
    model = tmp_path_factory.mktemp("tiny-chat") / "tiny"
    shutil.copytree(tiny_llama_path, model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    )
    return model


@pytest.fixture(scope="module")
def prefill_engine(tiny_llama_path):
    """The tiny Llama's engine in this process, as a prefill worker runs it (float32, 64 KV
    blocks): what it exports is what such a worker would push."""
    from pdserve.engine import LLM

    return LLM(model=str(tiny_llama_path), dtype="float32", num_kv_blocks=64, enforce_eager=True)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A Redis-compatible server of this test's own."""
    server = start_redis()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def shared_redis_server() -> Iterator[RedisServer]:
    """A Redis-compatible server for all the module's tests (each under its own prefix)."""
    server = start_redis()
    yield server
    server.stop()


@pytest.fixture
def cluster(tmp_path) -> Iterator[Cluster]:
    """A Cluster of this test's own, nothing started yet; stopped when the test ends."""
    c = Cluster(tmp_path)
    yield c
    c.stop_all()


@pytest.fixture
def launcher(tmp_path) -> Iterator[Launcher]:
    """A Launcher of this test's own, in the repository's root; stopped when the test ends."""
    launcher = Launcher(tmp_path, cwd=ROOT)
    yield launcher
    launcher.stop_all()
