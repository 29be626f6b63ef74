"""The model engine shared by prefill and decode workers (torch; no gRPC).

The embedded API, like vLLM's offline one::

    from services.engine import LLM, SamplingParams
"""

from services.common.config import EngineArgs
from services.common.sampling import SamplingParams
from services.engine.engine import LLMEngine
from services.engine.llm import LLM, RequestOutput
from services.engine.outputs import EngineStats

__all__ = ["LLM", "EngineArgs", "EngineStats", "LLMEngine", "RequestOutput", "SamplingParams"]
