"""The model engine shared by prefill and decode workers (torch; no gRPC).

The embedded API, like vLLM's offline one::

    from services.engine import LLM, SamplingParams

inductor's compile cache goes to ``$PDSERVE_HOME/inductor`` unless TORCHINDUCTOR_CACHE_DIR
says otherwise; torch reads the variable once, when its compiler is first imported, so it
is set here, before the engine imports anything that imports it.
"""

import os

from services.common.model import pdserve_home

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(pdserve_home() / "inductor"))

from services.common.config import EngineArgs  # noqa: E402
from services.common.sampling import SamplingParams  # noqa: E402
from services.engine.engine import LLMEngine  # noqa: E402
from services.engine.llm import LLM, RequestOutput  # noqa: E402
from services.engine.outputs import EngineStats  # noqa: E402

__all__ = ["LLM", "EngineArgs", "EngineStats", "LLMEngine", "RequestOutput", "SamplingParams"]
