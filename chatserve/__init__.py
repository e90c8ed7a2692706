"""chatserve: a small, fast LLM chat inference engine built around prefix reuse."""

from __future__ import annotations

from chatserve.engine.async_engine import AsyncLLMEngine
from chatserve.engine.llm_engine import EngineArgs, LLMEngine
from chatserve.llm import LLM
from chatserve.outputs import CompletionOutput, Logprob, RequestOutput, RequestStats
from chatserve.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "AsyncLLMEngine", "EngineArgs", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "RequestStats", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
