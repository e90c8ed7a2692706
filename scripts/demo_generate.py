#!/usr/bin/env python3
"""Short offline generation with chatserve's LLM API (what `make serve` runs until the HTTP server lands).

    python scripts/demo_generate.py                                  # "What is the capital of France?"
    python scripts/demo_generate.py "Tell me a joke" --max-tokens 64
    python scripts/demo_generate.py --model path/to/model.gguf "Hi"  # or an HF folder with safetensors
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")  # no weight-conversion progress bar in the demo


def chat_prompt_ids(tokenizer: Any, question: str, system: str | None) -> list[int]:
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": question})
    # Render to text, then encode: the text path has the same meaning across tokenizer versions
    # (tokenize=True returns a dict in some transformers releases).
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("question", nargs="?", default="What is the capital of France?")
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"))
    p.add_argument("--system", default=None, help="optional system prompt")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args()

    from chatserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype)
    tokenizer = llm.get_tokenizer()
    print(f"[demo] model loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr)

    ids = chat_prompt_ids(tokenizer, args.question, args.system)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids}], params)[0]
    dt = time.perf_counter() - t0

    completion = out.outputs[0]
    text = getattr(completion, "text", None)
    if not text:  # fall back to decoding the ids ourselves
        text = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    print(f"Q: {args.question}")
    print(f"A: {text.strip()}")
    n = len(completion.token_ids)
    finish = getattr(completion, "finish_reason", None)
    print(f"[demo] {len(ids)} prompt tokens, {n} generated in {dt:.2f}s ({n / dt:.1f} tok/s)"
          + (f", finish_reason={finish}" if finish else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
