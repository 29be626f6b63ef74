"""Shared fixtures: real checkpoints (the prepared SmolLM2, tiny random Llama/Qwen2) and HF references."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The suite's processes (two xdist workers, the servers the tests start) share the
# machine's cores, each with its own OpenMP pool: threads that spin between parallel
# regions take the cores another process's pool waits for. Two eager engines side by
# side on 2 cores ran 155 s each with libgomp's default wait, 20 s with a passive one.
# libgomp reads this when torch loads it, so it is set before anything imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


# Triton kernels run in its interpreter on machines without a GPU; this must be set
# before anything imports triton.
if _no_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
    import shutil

    model = tmp_path_factory.mktemp("tiny-chat") / "tiny"
    shutil.copytree(tiny_llama_path, model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    )
    return model
