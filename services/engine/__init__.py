"""The model engine shared by prefill and decode workers (torch; no gRPC).

The embedded API, like vLLM's offline one::

    from pdserve.engine import LLM, SamplingParams

inductor's compile cache goes to ``$PDSERVE_HOME/inductor`` unless TORCHINDUCTOR_CACHE_DIR
says otherwise; torch reads the variable once, when its compiler is first imported, so it
is set here, before the engine imports anything that imports it.
"""

import os

from pdserve.core.model import pdserve_home

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(pdserve_home() / "inductor"))

from pdserve.core.sampling import SamplingParams  # noqa: E402
from pdserve.engine.engine import LLMEngine  # noqa: E402
from pdserve.engine.llm import LLM, RequestOutput  # noqa: E402
from pdserve.engine.outputs import EngineStats  # noqa: E402
from pdserve.settings.engine import EngineArgs  # noqa: E402

__all__ = ["LLM", "EngineArgs", "EngineStats", "LLMEngine", "RequestOutput", "SamplingParams"]
