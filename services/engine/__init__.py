"""The model engine shared by prefill and decode workers."""

from services.engine.config import EngineArgs
from services.engine.engine import EngineStats, LLMEngine
from services.engine.llm import LLM, RequestOutput
from services.engine.sampling_params import SamplingParams

__all__ = ["LLM", "EngineArgs", "EngineStats", "LLMEngine", "RequestOutput", "SamplingParams"]
