"""pdserve: open-weight LLMs served with prefill and decode disaggregated into gRPC services.

The embedded API, as vLLM's offline one::

    from pdserve import LLM, SamplingParams

    llm = LLM(model="/path/to/checkpoint", dtype="float32")
    outputs = llm.generate(["Once upon a time"], SamplingParams(max_tokens=32))

This package is the repository's ``services/`` folder, and ``pdserve.kernels`` its
``kernels/`` folder (pyproject.toml maps them). ``LLM`` loads torch, so it is imported on
first use: the gateway and the kvstore import ``pdserve.*`` without torch.
"""

from __future__ import annotations

if __name__ != "pdserve":  # e.g. `python -m services.decode` from the checkout's root
    raise ImportError(
        f"this folder is the package `pdserve`, not `{__name__}`: import pdserve "
        "(python -m pdserve.decode, from pdserve.engine import ...)"
    )

import sys
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.core.sampling import SamplingParams

if TYPE_CHECKING:
    from pdserve.engine.llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "RequestOutput"):
        from pdserve import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")


class _CheckoutKernels:
    """``pdserve.kernels`` in a source checkout: the top-level ``kernels/`` folder.

    The folder has no ``__init__.py`` on purpose, so that a bare ``import kernels`` (Hugging
    Face's package, which transformers imports) never finds ours even where the checkout is
    on ``sys.path``; setuptools' editable finder maps only folders with one, so this maps it.
    A wheel holds it as ``pdserve/kernels/`` and needs none of this.
    """

    FOLDER = Path(__file__).resolve().parent.parent / "kernels"

    @classmethod
    def find_spec(cls, name: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if name != "pdserve.kernels":
            return None
        spec = ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(cls.FOLDER)]
        return spec


if not (Path(__file__).parent / "kernels").is_dir() and _CheckoutKernels.FOLDER.is_dir():
    sys.meta_path.append(_CheckoutKernels)
