"""A stand-in ``vllm`` package for running vLLM's OpenAI-server tests without vLLM.

vLLM's test modules import ``vllm.*`` at module level. An import hook answers every
``vllm`` module with a stub: the few names the end-to-end tests use work (``get_tokenizer``,
``ModelConfig(...).get_vocab_size()``, ``current_platform``, ``envs``, ``version``,
``get_open_port``), answering for the model pdserve serves whatever name the test gives;
downloads (``hf_api().snapshot_download``, ``download_weights_from_hf``: LoRA adapters and
checkpoints only passed to a server as flags) give an empty directory;
every other name is a *placeholder* class. While pytest imports and collects the modules,
a placeholder may be called, subscripted or used as a decorator (it then stands aside), so
that every module imports; once collection is over, calling one raises
``VllmInternalError``: the test needs vLLM's own objects (a unit test of vLLM's internals).

Some third-party packages that only vLLM's own features use (``openai_harmony``,
``anthropic``, ...) get the same placeholders when they are not installed; ``pybase64`` is
the standard ``base64``.
"""

from __future__ import annotations

import base64
import importlib.abc
import importlib.machinery
import importlib.util
import os
import socket
import sys
import types
from functools import cache
from typing import Any

VLLM_VERSION = "0.34.0"

# Third-party roots answered with placeholders when they are not installed (the finder for
# them sits last on sys.meta_path, so an installed one wins).
MISSING_THIRD_PARTY = (
    "anthropic",
    "openai_harmony",
    "model_hosting_container_standards",
    "lm_eval",
)

_STATE = {"strict": False}


class VllmInternalError(RuntimeError):
    """A test called a vLLM object that only a real vLLM install provides."""


class VllmPlaceholderException(Exception):
    """Base of the placeholders of vLLM's exception classes (names ending in Error/Exception)."""


def set_strict(strict: bool) -> None:
    """Strict: calling a placeholder raises (after collection); lenient: it stands aside."""
    _STATE["strict"] = strict


def _refuse(name: str) -> VllmInternalError:
    return VllmInternalError(
        f"vLLM-internal: `{name}` is a placeholder of the vllm stub (vLLM is not installed)"
    )


def _lenient_call(name: str, args: tuple, kwargs: dict) -> Any:
    if _STATE["strict"]:
        raise _refuse(name)
    # Used as a decorator at import time: leave the decorated object as it is.
    if len(args) == 1 and not kwargs and callable(args[0]):
        return args[0]
    return _PlaceholderInstance(name)


class _PlaceholderMeta(type):
    _stub_name: str

    def __getattr__(cls, item: str) -> Any:
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return placeholder(f"{cls._stub_name}.{item}")

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        return _lenient_call(cls._stub_name, args, kwargs)

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __repr__(cls) -> str:
        return f"<vllm stub {cls._stub_name}>"


class _PlaceholderInstance:
    """What a placeholder returns when called during collection."""

    def __init__(self, name: str) -> None:
        self._stub_name = name

    def __getattr__(self, item: str) -> Any:
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        return _PlaceholderInstance(f"{self._stub_name}().{item}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _lenient_call(self._stub_name, args, kwargs)

    def __getitem__(self, item: Any) -> Any:
        return self

    def __iter__(self):
        return iter(())

    def __repr__(self) -> str:
        return f"<vllm stub {self._stub_name}()>"

    __str__ = __repr__


@cache
def placeholder(name: str) -> type:
    """The placeholder class standing for ``name`` (e.g. ``vllm.outputs.RequestOutput``)."""
    short = name.rsplit(".", 1)[-1] or "placeholder"
    if short.endswith(("Error", "Exception")):
        # An exception class: usable in ``except`` and ``pytest.raises``; raising it needs
        # vLLM's code, which is not here.
        return type(short, (VllmPlaceholderException,), {"_stub_name": name})
    return _PlaceholderMeta(short, (), {"_stub_name": name, "__module__": name.rsplit(".", 1)[0]})


# --- the names that work ------------------------------------------------------------------


def served_model_path() -> str:
    """The checkpoint pdserve serves (the runner sets PEER_VLLM_MODEL)."""
    path = os.environ.get("PEER_VLLM_MODEL")
    if not path:
        raise RuntimeError("PEER_VLLM_MODEL is not set (run tests.peer.vllm_openai)")
    return path


@cache
def _hf_tokenizer(trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(served_model_path())


def get_tokenizer(tokenizer_name: Any = None, *args: Any, **kwargs: Any):
    """vLLM's get_tokenizer, for any name: the tokenizer of the model pdserve serves."""
    return _hf_tokenizer()


class ModelConfig:
    """vLLM's ModelConfig, as far as the end-to-end tests use it (the vocabulary size)."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        from transformers import AutoConfig

        self.model = model
        self.hf_config = AutoConfig.from_pretrained(served_model_path())
        self.max_model_len = getattr(self.hf_config, "max_position_embeddings", None)
        for key, value in kwargs.items():
            setattr(self, key, value)

    def get_vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)


class _Platform:
    """``current_platform`` of a machine vLLM's tests treat as plain (no ROCm, TPU, XPU)."""

    device_type = "cpu"
    device_name = "cpu"

    def __getattr__(self, item: str) -> Any:
        if item.startswith("__"):
            raise AttributeError(item)
        if item.startswith(("is_", "supports_", "has_", "use_")):
            return lambda *a, **k: False
        if item in ("device_count", "get_device_count"):
            return lambda *a, **k: 0
        if item.startswith("get_"):
            return lambda *a, **k: None
        return None

    def device_count(self) -> int:
        return 0


current_platform = _Platform()


def get_open_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _download_dir(name: str, cache_dir: str | None = None) -> str:
    """An empty directory standing for a download: pdserve serves its own model whatever
    path a server is given, and ignores LoRA adapters, so nothing is fetched."""
    base = cache_dir or os.path.join(os.environ.get("PEER_VLLM_VLLM_ROOT", "."), "downloads")
    path = os.path.join(base, name.replace("/", "--"))
    os.makedirs(path, exist_ok=True)
    return path


class _Hub:
    """``hf_api()``: ``snapshot_download`` gives an empty directory (see _download_dir)."""

    def snapshot_download(self, repo_id: str, *args: Any, **kwargs: Any) -> str:
        return _download_dir(repo_id)


def hf_api() -> _Hub:
    return _Hub()


def download_weights_from_hf(model_name_or_path: str, cache_dir: str | None, *a, **k) -> str:
    return _download_dir(model_name_or_path, cache_dir)


def _envs_getattr(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    if name == "VLLM_MAX_N_SEQUENCES":
        return int(os.environ.get(name, "16384"))
    return False


def _prev_minor_version() -> str:
    major, minor = VLLM_VERSION.split(".")[:2]
    return f"{major}.{max(int(minor) - 1, 0)}"


_SUBMODULES_OF_VLLM = {"envs", "version", "platforms", "config", "tokenizers", "utils"}


def _fill(module: types.ModuleType) -> None:
    """The working names of one stub module, by its name."""
    name = module.__name__
    real: dict[str, Any] = {}
    if name == "vllm":
        real["__version__"] = VLLM_VERSION
    elif name == "vllm.version":
        real.update(
            __version__=VLLM_VERSION,
            __version_tuple__=tuple(int(x) for x in VLLM_VERSION.split(".")),
            _prev_minor_version=_prev_minor_version,
        )
    elif name == "vllm.envs":
        module.__getattr__ = _envs_getattr
        return
    elif name == "vllm.platforms":
        real["current_platform"] = current_platform
    elif name in ("vllm.tokenizers", "vllm.transformers_utils.tokenizer"):
        real["get_tokenizer"] = get_tokenizer
    elif name == "vllm.config":
        real["ModelConfig"] = ModelConfig
    elif name == "vllm.utils.network_utils":
        real["get_open_port"] = get_open_port
    elif name == "vllm.transformers_utils.repo_utils":
        real["hf_api"] = hf_api
    elif name == "vllm.model_executor.model_loader.weight_utils":
        real["download_weights_from_hf"] = download_weights_from_hf
    module.__dict__.update(real)

    def module_getattr(item: str) -> Any:
        if item.startswith("__") and item.endswith("__"):
            raise AttributeError(item)
        if name == "vllm" and item in _SUBMODULES_OF_VLLM:
            return importlib.import_module(f"vllm.{item}")
        return placeholder(f"{name}.{item}")

    module.__getattr__ = module_getattr


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.__stub__ = True
        if module.__name__.split(".")[0] == "pybase64":
            module.__dict__.update(
                {k: getattr(base64, k) for k in dir(base64) if not k.startswith("__")}
            )
            return
        _fill(module)


class _StubFinder(importlib.abc.MetaPathFinder):
    def __init__(self, roots: tuple[str, ...]) -> None:
        self.roots = roots

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname.split(".")[0] not in self.roots:
            return None
        return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=True)


def install() -> None:
    """Answer ``vllm`` (first) and the missing third-party packages (last) with stubs."""
    if any(isinstance(f, _StubFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _StubFinder(("vllm",)))
    missing = tuple(
        root
        for root in (*MISSING_THIRD_PARTY, "pybase64")
        if importlib.util.find_spec(root) is None
    )
    if missing:
        sys.meta_path.append(_StubFinder(missing))
