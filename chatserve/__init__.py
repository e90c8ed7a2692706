"""chatserve: a small, fast LLM chat inference engine built around prefix reuse."""

from __future__ import annotations

from .async_engine import AsyncLLMEngine
from .engine import EngineArgs, LLMEngine
from .llm import LLM
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "AsyncLLMEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
