"""What `chatserve bench latency` and `chatserve bench throughput` share: the in-process engine
and its prompts.

Both drive `chatserve.LLM` directly (no HTTP, no server), as vLLM's offline benchmarks drive its
`LLM`: every EngineArgs flag of `chatserve serve` works here too, and prompts are random token ids
(fed as ids, so their length is exact), greedy or not, with ignore_eos so every request generates
exactly --output-len tokens. torch is imported only when a command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
from typing import Any


def make_llm(args: argparse.Namespace) -> Any:
    from chatserve import LLM
    from chatserve.config import EngineArgs

    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs) if hasattr(args, f.name)}
    return LLM(**kwargs)


def random_token_prompts(llm: Any, num: int, input_len: int, seed: int) -> list[dict[str, list[int]]]:
    """`num` prompts of exactly `input_len` random ids from the vocabulary (special ids avoided)."""
    tok = llm.get_tokenizer()
    special = set(getattr(tok, "all_special_ids", []) or [])
    vocab = len(tok)
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        ids: list[int] = []
        while len(ids) < input_len:
            t = rng.randrange(min(100, vocab - 1), vocab)
            if t not in special:
                ids.append(t)
        prompts.append({"prompt_token_ids": ids})
    return prompts


def check_fits(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    limit = getattr(args, "max_model_len", None)
    if limit is not None and args.input_len + args.output_len > limit:
        parser.error(f"argument --input-len: --input-len {args.input_len} + --output-len {args.output_len} exceeds "
                     f"--max-model-len {limit}")


def write_json(path: str, payload: dict[str, Any]) -> None:
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(payload, fh, indent=4)
