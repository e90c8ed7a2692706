"""Offline batch inference shaped like vLLM's `LLM`, so users' habits carry over."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, cast

from chatserve.engine.input_processor import ProcessedPrompt
from chatserve.engine.input_processor import apply_chat_template as apply_chat_template  # tests and scripts import it here
from chatserve.engine.llm_engine import EngineArgs, LLMEngine, PromptType
from chatserve.outputs import EngineInfo, RequestOutput
from chatserve.reasoning import ReasoningConfig, detect_reasoning_parser, reasoning_config_for, reasoning_parser_named
from chatserve.sampling_params import SamplingParams, StructuredOutputsParams
from chatserve.tools import FunctionTool, ToolChoice, parse_tool_calls, tool_grammar

Message = dict[str, str]


class LLM:
    """Load a model once, then run batches of prompts through it.

    All prompts of one `generate` call run batched together: their prefills
    and decodes share forward passes (continuous batching), not one after another.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """`kwargs` are `EngineArgs` fields (dtype, max_num_seqs, ...); their defaults are EngineArgs' own,
        so there is no second copy here to drift. The fields the process environment sets
        (`EngineArgs.from_env`: $CHATSERVE_MAX_CPU_TIER, $CHATSERVE_CACHE_DIR, ...)
        come from it where `kwargs` leave them out."""
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise TypeError(f"LLM() got unexpected options {sorted(unknown)}; valid: {sorted(EngineArgs.field_names())}")
        self.engine_args = EngineArgs.from_env(model=model, **kwargs)
        self.engine = LLMEngine(self.engine_args)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def engine_info(self) -> EngineInfo:
        """What the engine was built with: kernels, KV pool, load times (outputs.EngineInfo)."""
        return self.engine.info()

    def close(self) -> None:
        """Stop the engine's background threads; with the KV tiers on (``kv_offload_dir`` /
        ``kv_offload_redis_url``) and the write-back policy, this is when the tree's blocks are written
        down, so the next process starts warm. Also ``with LLM(...) as llm:``."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict, ProcessedPrompt)):
            prompts = [prompts]
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts")
        # Every prompt is processed (and so refused) before any is added: a bad one leaves nothing behind.
        processed = [self.engine.input_processor.process(p, truncate_prompt_tokens=params.truncate_prompt_tokens)
                     for p, params in zip(prompts, params_list)]
        # Grammars too (compiled and cached now): a bad schema is a ValueError naming the field, before anything runs.
        for params in {id(p): p for p in params_list}.values():
            self.engine.input_processor.check_params(params)  # token ids, priority, bad words
            self.engine.check_structured_outputs(params)
        return self._run(processed, params_list)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] = "auto",
        parallel_tool_calls: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        reasoning_effort: str | None = None,
        reasoning_budget_tokens: int | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, through the chat template.

        `tools` are OpenAI function tools: they are rendered into the prompt (the model's template if it
        renders tools, else the shipped xLAM one), `tool_choice` "required" / {"type": "function",
        "function": {"name": ...}} constrains the reply to well-formed calls ("auto": text or a call),
        and each output's `tool_calls` holds the calls parsed from its text (`chatserve.tools.ToolCall`); an
        output cut by max_tokens (finish_reason "length") inside a call holds it partial (`complete` False).
        `tool_call_parser` forces a call format as `chatserve serve --tool-call-parser` does (default: the
        template's own).

        `reasoning_parser` (vLLM's names: "qwen3", "deepseek_r1", "mistral"; "auto": the one the chat
        template shows, if any) splits each output into `reasoning` and the answer in `text` (tool calls
        are parsed from the answer alone); `reasoning_effort` (OpenAI's values, docs/reasoning.md's
        table) or `reasoning_budget_tokens` bounds the reasoning, the end marker forced when it is
        spent; `chat_template_kwargs={"enable_thinking": False}` turns thinking off where the template
        knows the switch.
        """
        if not messages:
            raise ValueError("messages is empty")
        conversations = cast(
            list[Sequence[Message]], [messages] if isinstance(messages[0], dict) else list(messages)
        )
        processor = self.engine.input_processor
        specs = [FunctionTool.from_openai(t) for t in tools or []]
        choice = ToolChoice.from_openai(tool_choice)
        if choice.mode == "named" and not choice.allowed(specs):
            raise ValueError(f"tool_choice names {choice.name!r}, which is not in tools")
        offered = [t.to_template() for t in specs] if choice.allowed(specs) else None
        template_kwargs = dict(chat_template_kwargs or {})
        texts = [
            processor.render_chat_text(
                conv, add_generation_prompt=add_generation_prompt, chat_template=chat_template, tools=offered,
                tool_parser=tool_call_parser, **template_kwargs)
            for conv in conversations
        ]
        prompts = [processor.process({"prompt_token_ids": list(processor.tokenizer.encode(t, add_special_tokens=False))})
                   for t in texts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} conversations")
        parser = self._reasoning_parser(reasoning_parser, chat_template)
        if parser is not None:
            enable_thinking = template_kwargs.get("enable_thinking")
            configs = [reasoning_config_for(parser, text, effort=reasoning_effort, budget_tokens=reasoning_budget_tokens,
                                            enable_thinking=enable_thinking if isinstance(enable_thinking, bool) else None)
                       for text in texts]
            params_list = [_with_reasoning(p, c) for p, c in zip(params_list, configs)]
        if not offered:
            return self.generate(prompts, params_list)
        fmt = processor.tool_rendering(chat_template, tool_call_parser).format
        grammar = tool_grammar(fmt, specs, choice, parallel_tool_calls)
        if grammar is not None:
            params_list = [_with_grammar(p, grammar) for p in params_list]
        outputs = self.generate(prompts, params_list)
        names = {t.name: t.arguments_schema for t in choice.allowed(specs)}
        for out in outputs:
            for o in out.outputs:
                o.tool_calls = parse_tool_calls(o.text, fmt, names, truncated=o.finish_reason == "length").tool_calls
        return outputs

    def _reasoning_parser(self, name: str | None, chat_template: str | None) -> str | None:
        """The parser's checked name; "auto": the one the chat template (given, else the model's) shows."""
        if name is None:
            return None
        if name == "auto":
            template = chat_template if chat_template is not None else getattr(self.engine.tokenizer, "chat_template", None)
            return detect_reasoning_parser(template if isinstance(template, str) else None)
        return reasoning_parser_named(name).name

    def _run(self, prompts: list[ProcessedPrompt], params_list: list[SamplingParams]) -> list[RequestOutput]:
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


def _with_reasoning(params: SamplingParams, config: ReasoningConfig | None) -> SamplingParams:
    """The conversation's reasoning config, unless the caller set one on the params themselves."""
    if config is None or params.reasoning is not None:
        return params
    p = params.clone()
    p.reasoning = config
    return p


def _with_grammar(params: SamplingParams, grammar: dict[str, Any]) -> SamplingParams:
    """The tools' grammar, unless the caller constrained the output themselves."""
    if params.structured_outputs is not None:
        return params
    p = params.clone()
    p.structured_outputs = StructuredOutputsParams(structural_tag=grammar)
    return p
