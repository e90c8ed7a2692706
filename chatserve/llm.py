"""Offline batch inference shaped like vLLM's `LLM`, so users' habits carry over."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from chatserve.engine.llm_engine import EngineArgs, LLMEngine, PromptType
from chatserve.outputs import RequestOutput
from chatserve.sampling_params import SamplingParams

Message = dict[str, str]


class LLM:
    """Load a model once, then run batches of prompts through it.

    All prompts of one `generate` call run batched together: their prefills
    and decodes share forward passes (continuous batching), not one after another.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        block_size: int = 16,
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = True,
        attention_backend: str = "auto",
        num_kv_blocks: int | None = None,
        kv_cache_memory_gb: float | None = None,
        device: str = "auto",
        num_threads: int | None = None,
        **kwargs: Any,
    ) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"LLM() got unexpected options {sorted(unknown)}; valid: {sorted(EngineArgs.field_names())}")
        self.engine_args = EngineArgs(
            model=model, dtype=dtype, block_size=block_size, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
            attention_backend=attention_backend, num_kv_blocks=num_kv_blocks, kv_cache_memory_gb=kv_cache_memory_gb,
            device=device, num_threads=num_threads, **kwargs,
        )
        self.engine = LLMEngine(self.engine_args)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts")
        return self._run(prompts, params_list)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, through the chat template."""
        if not messages:
            raise ValueError("messages is empty")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [
            {"prompt_token_ids": apply_chat_template(self.get_tokenizer(), conv, add_generation_prompt, chat_template)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params)

    def _run(self, prompts: list[PromptType], params_list: list[SamplingParams]) -> list[RequestOutput]:
        engine = self.engine
        ids = []
        # final_only: the offline API needs only the finished outputs
        try:
            for prompt, params in zip(prompts, params_list):
                rid = str(next(self._ids))
                p = params.clone()
                p.output_kind = "final_only"
                engine.add_request(rid, prompt, p)
                ids.append(rid)
            finals: dict[str, RequestOutput] = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finals[out.request_id] = out
        except BaseException:
            for rid in ids:
                engine.abort_request(rid)
            raise
        results = [finals[rid] for rid in ids]
        for out in results:
            out.outputs.sort(key=lambda o: o.index)
        return results


def apply_chat_template(
    tokenizer: Any, conversation: Sequence[Message], add_generation_prompt: bool = True, chat_template: str | None = None
) -> list[int]:
    """Render with the model's template, then tokenize without adding special tokens again."""
    for m in conversation:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError('each message must be a dict with "role" and "content"')
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; pass chat_template=... or use generate() with a plain prompt")
    text = tokenizer.apply_chat_template(
        list(conversation), add_generation_prompt=add_generation_prompt, tokenize=False, chat_template=chat_template
    )
    return list(tokenizer.encode(text, add_special_tokens=False))
