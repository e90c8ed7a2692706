"""Request body -> `SamplingParams`: the server's limits, session defaults, and the room in the context.

The order of precedence is the request's own field, then the session's default, then OpenAI's
default. The limits (`ServerSettings.max_n`, stop sequences) bound what one request may ask for,
so they are checked here, before any work. Whether the prompt fits is not: the engine's input
processor checks that, once; here max_tokens is only fitted to the room it leaves.
"""

from __future__ import annotations

from typing import Any

from chatserve.sampling_params import SamplingParams
from chatserve.server.chat.protocol import SamplingFields
from chatserve.server.errors import bad_request
from chatserve.server.settings import ServerSettings


def check_limits(settings: ServerSettings, body: SamplingFields) -> None:
    if body.n > settings.max_n:
        raise bad_request(f"n must be at most {settings.max_n}, got {body.n}", param="n")
    check_stop_list(settings, body.stop_list())


def check_stop_list(settings: ServerSettings, stops: list[str], param: str = "stop") -> None:
    if len(stops) > settings.max_stop_sequences:
        raise bad_request(f"at most {settings.max_stop_sequences} stop sequences are allowed, got {len(stops)}",
                          param=param)
    if any(len(x) > settings.max_stop_length for x in stops):
        raise bad_request(f"each stop sequence may have at most {settings.max_stop_length} characters", param=param)
    if any(x == "" for x in stops):
        raise bad_request("stop sequences must not be empty", param=param)


def build_sampling_params(body: SamplingFields, max_tokens: int | None, logprobs: int | None,
                          defaults: dict[str, Any] | None = None) -> SamplingParams:
    """Request fields override session defaults, which override OpenAI's defaults."""
    defaults = defaults or {}

    def pick(name: str, fallback: Any) -> Any:
        value = getattr(body, name, None)
        if value is not None:
            return value
        return defaults.get(name, fallback)

    try:
        return SamplingParams(
            n=body.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            presence_penalty=pick("presence_penalty", 0.0),
            frequency_penalty=pick("frequency_penalty", 0.0),
            seed=pick("seed", None),
            stop=body.stop_list() or defaults.get("stop"),
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            max_tokens=max_tokens if max_tokens is not None else defaults.get("max_tokens"),
            min_tokens=body.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            speculative_decoding=getattr(body, "speculative_decoding", True),
            priority=body.priority,
            logit_bias={int(k): v for k, v in body.logit_bias.items()} if body.logit_bias else None,
            allowed_token_ids=body.allowed_token_ids,
            bad_words=body.bad_words,
            prompt_logprobs=getattr(body, "prompt_logprobs", None),
            output_kind="delta",
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from None


def cap_max_tokens(params: SamplingParams, max_model_len: int, num_prompt_tokens: int) -> None:
    """Cap max_tokens to the room left in the context (an explicit one that cannot fit was already
    refused by the input processor, so only an implicit or session-default one is lowered here)."""
    room = max_model_len - num_prompt_tokens
    if params.max_tokens is None or params.max_tokens > room:
        params.max_tokens = room
    if params.min_tokens > params.max_tokens:
        raise bad_request(f"min_tokens={params.min_tokens} exceeds the room left in the context ({room} tokens)",
                          param="min_tokens")
