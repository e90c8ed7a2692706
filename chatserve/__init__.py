"""chatserve: a small, fast LLM chat inference engine built around prefix reuse.

The public names are imported on first use (PEP 562), so a module that needs none of the engine
(`chatserve bench serve`, a client of any OpenAI-compatible server) does not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chatserve.engine.async_engine import AsyncLLMEngine
    from chatserve.engine.llm_engine import EngineArgs, LLMEngine
    from chatserve.llm import LLM
    from chatserve.outputs import CompletionOutput, Logprob, RequestOutput, RequestStats
    from chatserve.sampling_params import SamplingParams, StructuredOutputsParams

_WHERE = {
    "AsyncLLMEngine": "chatserve.engine.async_engine",
    "EngineArgs": "chatserve.engine.llm_engine",
    "LLMEngine": "chatserve.engine.llm_engine",
    "LLM": "chatserve.llm",
    "CompletionOutput": "chatserve.outputs",
    "Logprob": "chatserve.outputs",
    "RequestOutput": "chatserve.outputs",
    "RequestStats": "chatserve.outputs",
    "SamplingParams": "chatserve.sampling_params",
    "StructuredOutputsParams": "chatserve.sampling_params",
}

__all__ = ["LLM", "LLMEngine", "AsyncLLMEngine", "EngineArgs", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "RequestStats", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'chatserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
