"""The request sets of `chatserve bench serve`, generated from a seed: nothing is downloaded.

vLLM's benchmark reads ShareGPT or samples random token ids through a tokenizer; a client here has
neither, so every dataset is built from chatserve/bench/text.py's sentences with a
`random.Random(seed)`: the same seed gives the same requests on every machine and against every
server, which is what makes two servers' results comparable. Lengths are approximate tokens
(`prompt_len` is the estimate; the server's `usage.prompt_tokens` replaces it when reported).

- `random`: unrelated prompts of `--random-input-len` tokens (`--random-range-ratio` spreads them
  uniformly over [L(1-r), L(1+r)], as vLLM's), each asking for `--random-output-len` tokens.
- `sharegpt-like`: conversations of varied shape, as ShareGPT's: 0-3 earlier exchanges, a user
  message and an output length each drawn from log-normals (medians `--sharegpt-input-len` and
  128 tokens; `--sharegpt-output-len` fixes the output as vLLM's flag does).
- `prefix`: `--prefix-num-prefixes` shared prefixes of `--prefix-len` tokens (a system message on
  the chat endpoint) cycled over the requests, each followed by a distinct question of
  `--prefix-question-len` tokens: what a prefix cache is for.
- `sessions`: conversations of `--session-turns` turns (`--num-prompts` counts turns): a first
  message of `--random-input-len` tokens, follow-ups of `--session-turn-len`; the serve benchmark
  sends each turn through chatserve's session API, only the new message.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from chatserve.bench.text import CHARS_PER_TOKEN, FOLLOW_UPS, QUESTIONS, cap, fill, question, text_of_length, text_of_tokens

DATASETS = ("random", "sharegpt-like", "prefix", "sessions")


@dataclass
class SampleRequest:
    """One request: its messages (chat; for the session API the last one is what is sent), the same
    as a plain-text prompt (completions), the approximate prompt tokens and the tokens asked for."""

    messages: list[dict[str, str]]
    prompt_len: int
    expected_output_len: int
    conversation: int | None = None  # sessions: which conversation, and which turn of it
    turn: int | None = None
    history: list[dict[str, str]] = field(default_factory=list)  # sharegpt-like: earlier exchanges

    @property
    def prompt(self) -> str:
        """The conversation as one text for /v1/completions (no chat template there)."""
        msgs = [*self.history, *self.messages]
        if len(msgs) == 1 and msgs[0]["role"] == "user":
            return msgs[0]["content"]
        return "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in msgs) + "Assistant:"

    def chat_messages(self) -> list[dict[str, str]]:
        return [*self.history, *self.messages]


def _tokens(text: str) -> int:
    return max(1, round(len(text) / CHARS_PER_TOKEN))


def _spread(rng: random.Random, length: int, ratio: float) -> int:
    if ratio <= 0:
        return length
    return max(1, rng.randint(max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))))


def random_requests(num: int, input_len: int, output_len: int, seed: int = 0, range_ratio: float = 0.0) -> list[SampleRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        n_in, n_out = _spread(rng, input_len, range_ratio), _spread(rng, output_len, range_ratio)
        text = text_of_length(rng, n_in)
        out.append(SampleRequest([{"role": "user", "content": text}], _tokens(text), n_out))
    return out


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(rng.lognormvariate(math.log(max(1.0, median)), sigma)))))


def sharegpt_like_requests(num: int, input_median: int = 256, output_len: int | None = None, seed: int = 0,
                           max_input_len: int = 1536) -> list[SampleRequest]:
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        history: list[dict[str, str]] = []
        for _ in range(rng.choice((0, 0, 0, 1, 1, 2, 3))):
            history.append({"role": "user", "content": cap(fill(rng.choice(QUESTIONS), rng))})
            history.append({"role": "assistant", "content": text_of_tokens(rng, _lognormal(rng, 60, 0.6, 8, 200))})
        n_in = _lognormal(rng, input_median, 0.8, 8, max_input_len)
        content = f"{cap(fill(rng.choice(QUESTIONS), rng))} {text_of_length(rng, n_in)}"
        n_out = output_len if output_len is not None else _lognormal(rng, 128, 0.7, 8, 512)
        req = SampleRequest([{"role": "user", "content": content}], 0, n_out, history=history)
        req.prompt_len = sum(_tokens(m["content"]) for m in req.chat_messages())
        out.append(req)
    return out


def prefix_requests(num: int, prefix_len: int, question_len: int, output_len: int, seed: int = 0,
                    num_prefixes: int = 1) -> list[SampleRequest]:
    rng = random.Random(seed)
    prefixes = [("You are the assistant of the archive of a small coastal village. Answer questions using the "
                 f"records below; be brief and precise.\n\nRecords ({k + 1}):\n" + text_of_length(rng, prefix_len))
                for k in range(max(1, num_prefixes))]
    out = []
    for i in range(num):
        system = prefixes[i % len(prefixes)]
        q = question(rng, i, question_len)
        out.append(SampleRequest([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                 _tokens(system) + _tokens(q), output_len))
    return out


def session_requests(num: int, turns: int, first_len: int, turn_len: int, output_len: int,
                     seed: int = 0) -> list[SampleRequest]:
    """`num` turns in all, `turns` per conversation (the last one may be shorter), in order."""
    rng = random.Random(seed)
    turns = max(1, turns)
    out = []
    for i in range(num):
        conv, k = divmod(i, turns)
        if k == 0:
            content = (f"Conversation {conv + 1}. Here are my notes: {text_of_length(rng, first_len)}\n"
                       f"{cap(fill(rng.choice(QUESTIONS), rng))}")
        else:
            content = fill(rng.choice(FOLLOW_UPS), rng) + " " + text_of_length(rng, turn_len)
        out.append(SampleRequest([{"role": "user", "content": content}], _tokens(content), output_len,
                                 conversation=conv, turn=k))
    return out


def conversations(requests: list[SampleRequest]) -> list[list[SampleRequest]]:
    """Requests grouped into what runs one after another: a conversation's turns, else one each."""
    units: list[list[SampleRequest]] = []
    by_conv: dict[int, list[SampleRequest]] = {}
    for r in requests:
        if r.conversation is None:
            units.append([r])
        elif r.conversation in by_conv:
            by_conv[r.conversation].append(r)
        else:
            by_conv[r.conversation] = [r]
            units.append(by_conv[r.conversation])
    return units


def get_samples(args: object) -> list[SampleRequest]:
    """The dataset `args.dataset_name` names, with the sizes its flags give (see the module docstring)."""
    a: Any = args
    name = a.dataset_name
    if name == "random":
        return random_requests(a.num_prompts, a.random_input_len, a.random_output_len, a.seed, a.random_range_ratio)
    if name == "sharegpt-like":
        return sharegpt_like_requests(a.num_prompts, a.sharegpt_input_len, a.sharegpt_output_len, a.seed)
    if name == "prefix":
        return prefix_requests(a.num_prompts, a.prefix_len, a.prefix_question_len, a.random_output_len, a.seed,
                               a.prefix_num_prefixes)
    if name == "sessions":
        return session_requests(a.num_prompts, a.session_turns, a.random_input_len, a.session_turn_len,
                                a.random_output_len, a.seed)
    raise ValueError(f"unknown dataset {name!r}; one of {', '.join(DATASETS)}")
