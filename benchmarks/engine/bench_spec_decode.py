#!/usr/bin/env python
"""Speculative decoding (ngram, suffix) on vs off, three workloads, batch 1 and concurrency 8 (issue #32).

Workloads: (a) code edit: repeat a ~300-token function with one identifier renamed; (b) an agent
turn whose tool-call arguments (JSON, schema-constrained) quote the user's message; (c) free chat.
Each engine (plain, speculative) is loaded once in this process; every prompt is run once untimed
first so that both measure decode over a warm prefix cache, then the engines' timed runs alternate
``--repeats`` times. Prints the median decode tok/s (output tokens / wall time of the generate
call), the median of the paired ratios, the acceptance, and whether the tokens are identical
to plain greedy decoding (they must be). Methods: ngram; suffix with its per-request trees only
(``suffix_decoding_max_cached_requests`` 0, so the timed run cannot copy the warm-up's output);
suffix_repeat with the global tree on, which after the warm-up is what a repeated request sees.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/engine/bench_spec_decode.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from chatserve import LLM, SamplingParams
from chatserve.sampling_params import StructuredOutputsParams

FIELDS = ["order_id", "customer_name", "shipping_address", "billing_address", "items", "discount_code",
          "gift_message", "delivery_window", "phone_number", "email_address"]


def code_function(name: str) -> str:
    body = "\n".join(f"    {f} = record.get('{f}')\n    if {f} is None:\n        errors.append('missing {f}')" for f in FIELDS)
    return f"def {name}(record, errors):\n{body}\n    return errors\n"


Workload = tuple[list[dict], str, SamplingParams]  # conversation, the assistant reply's start, params


def workloads(count: int) -> dict[str, list[Workload]]:
    out: dict[str, list] = {"code_edit": [], "tool_args": [], "free_chat": []}
    people = ["Alice Smith", "Bob Jones", "Carla Diaz", "Dev Patel", "Eve Moreau", "Farid Khan", "Gina Rossi", "Hugo Berg"]
    topics = ["the sea", "a mountain town", "autumn leaves", "a night train", "an old library", "the desert", "a city at dawn", "rain"]
    schema = {"type": "object", "properties": {"to": {"type": "string"}, "body": {"type": "string"}},
              "required": ["to", "body"]}
    for i in range(count):
        fn = code_function(f"validate_order_{i}")
        out["code_edit"].append((
            [{"role": "user", "content": f"Repeat this function exactly, renaming validate_order_{i} to check_order_{i}:\n\n{fn}"}],
            # the reply is started for the model, as an editor integration does (a 135M model asked
            # to repeat code otherwise often explains it instead)
            "```python\n", SamplingParams(temperature=0, max_tokens=256)))
        message = (f"Hi, this is {people[i]}. My order 10{i}42 arrived with two broken mugs and a missing teapot; "
                   f"please send a replacement to 1{i} Oak Street, Springfield, before Friday. Thanks!")
        out["tool_args"].append((
            [{"role": "user", "content": f"Forward this customer message word for word to support@example.com "
                                         f"with the send_email tool (arguments to and body):\n\n{message}"}],
            "", SamplingParams(temperature=0, max_tokens=160, structured_outputs=StructuredOutputsParams(json=schema))))
        out["free_chat"].append((
            [{"role": "user", "content": f"Write a short poem about {topics[i]}."}],
            "", SamplingParams(temperature=0, max_tokens=128)))
    return out


def prompts_of(llm: LLM, batch: list[Workload]) -> tuple[list[str], list[SamplingParams]]:
    tokenizer = llm.engine.get_tokenizer()
    prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) + start for c, start, _ in batch]
    return prompts, [p for _, _, p in batch]


def timed(llm: LLM, batch: list[Workload]) -> tuple[float, list[list[int]]]:
    """Output tokens per second of one generate call over ``batch``, and its tokens."""
    prompts, params = prompts_of(llm, batch)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return sum(len(t) for t in tokens) / wall, tokens


METHODS = {
    "ngram": lambda k: {"method": "ngram", "num_speculative_tokens": k},
    # per-request trees only: the timed run cannot draft from the warm-up run's identical output
    "suffix": lambda k: {"method": "suffix", "num_speculative_tokens": max(k, 8), "suffix_decoding_max_cached_requests": 0},
    # the global tree on: the warm-up's outputs are in it, which is what a repeated request sees
    "suffix_repeat": lambda k: {"method": "suffix", "num_speculative_tokens": max(k, 8)},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-speculative-tokens", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--methods", default="ngram,suffix,suffix_repeat", help=f"comma-separated, of {', '.join(METHODS)}")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per engine, alternated; medians reported")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        if m not in METHODS:
            ap.error(f"--methods: unknown method {m!r} (known: {', '.join(METHODS)})")
    plain = LLM(max_model_len=2048)
    specs = {m: LLM(max_model_len=2048, speculative_config=METHODS[m](args.num_speculative_tokens)) for m in methods}
    print(f"kernels: {plain.engine_info().kernels}")
    loads = workloads(args.concurrency)
    rows = []
    for name, items in loads.items():
        for conc in (1, args.concurrency):
            batch = items[:conc]
            engines = {"plain": plain, **specs}
            for llm in engines.values():  # warm: prefix cache and grammar compile
                llm.generate(*prompts_of(llm, batch))
            before = {m: dict(spec.engine.stats()["spec_decode"]) for m, spec in specs.items()}
            speeds: dict[str, list[float]] = {m: [] for m in engines}
            tokens: dict[str, list[list[int]]] = {}
            for _ in range(args.repeats):  # alternated, so a noisy moment hits every engine alike
                for m, llm in engines.items():
                    tps, tokens[m] = timed(llm, batch)
                    speeds[m].append(tps)
            plain_tps = statistics.median(speeds["plain"])
            for method, spec in specs.items():
                after = spec.engine.stats()["spec_decode"]
                drafts = after["num_draft_tokens"] - before[method]["num_draft_tokens"]
                accepted = after["num_accepted_tokens"] - before[method]["num_accepted_tokens"]
                spec_tps = statistics.median(speeds[method])
                ratios = [s / p for s, p in zip(speeds[method], speeds["plain"])]
                row = {"workload": name, "concurrency": conc, "method": method, "plain_tok_s": round(plain_tps, 1),
                       "spec_tok_s": round(spec_tps, 1), "speedup": round(statistics.median(ratios), 2),
                       "speedups": [round(r, 2) for r in ratios],
                       "draft_tokens": drafts, "accepted_tokens": accepted,
                       "acceptance": round(accepted / drafts, 3) if drafts else None,
                       "output_tokens": sum(len(t) for t in tokens[method]), "identical": tokens[method] == tokens["plain"]}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("\n| workload | concurrency | method | plain tok/s | spec tok/s | speedup (runs) | acceptance (draft tokens) | identical |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workload']} | {r['concurrency']} | {r['method']} | {r['plain_tok_s']} | {r['spec_tok_s']} | "
              f"{r['speedup']}x ({', '.join(map(str, r['speedups']))}) | "
              f"{r['acceptance']} ({r['draft_tokens']}) | {r['identical']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
