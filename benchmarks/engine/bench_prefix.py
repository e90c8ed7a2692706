#!/usr/bin/env python3
"""Prefix-cache benchmark: the same chat workloads with the prefix cache ON and OFF.

    python benchmarks/engine/bench_prefix.py                         # defaults: SmolLM2-135M GGUF, bf16, 2 threads
    python benchmarks/engine/bench_prefix.py --json bench_results/prefix.json
    python benchmarks/engine/bench_prefix.py --threads 1 --num-requests 4 --max-tokens 4 \\
        --system-tokens 200 --mt-conversations 2 --mt-turns 2 --mt-max-tokens 4     # a quick smoke run
    python benchmarks/engine/bench_prefix.py --worker on             # one mode in-process (debugging, pdb)

Each mode (cache ON, cache OFF) runs in its own subprocess, so memory and allocator state of one
engine cannot disturb the other; the worker prints its results as one JSON line and the parent prints
a markdown table and optionally writes --json. Both workers build the workload the same deterministic
way from the model's tokenizer, so both see identical prompt token ids (multi-turn prompts from turn 2
on contain the model's own replies; they are identical too unless the two modes' greedy outputs
diverge, which the report flags).

Method. The engine (`LLM(...).engine`) is driven step by step: requests are added with
`engine.add_request`, then `engine.step()` is called until nothing is unfinished. TTFT of a request =
wall time (perf_counter) from just before its `add_request` to the return of the first `step()` whose
output for it carries a non-empty token list (cumulative output kind, so that is the first token).
All requests are greedy (temperature 0) with ignore_eos, so every request makes exactly max_tokens
tokens. Before any measurement each worker warms up on unrelated text (a ~1k-token prefill and a small
batch decode), then empties the prefix cache; the cache is emptied again before every scenario
(`engine.reset_prefix_cache()`), so each scenario starts cold. Counters are deltas of
`engine.stats()` over the scenario: prefill tokens computed (`num_prefill_tokens_computed`), hit rate
= `prefix_cache_hits_tokens` / `prefix_cache_queries_tokens`.

Workload. The shared system prompt is the chat template's system turn
`<|im_start|>system\\n{text}<|im_end|>\\n` rendered to exactly --system-tokens ids (default 1000,
template tokens included): {text} is deterministic, non-repetitive English (sentences drawn from a
seeded grammar), cut to fit. Each user turn is `<|im_start|>user\\n{question}<|im_end|>\\n
<|im_start|>assistant\\n` with a distinct ~30-token question. Ids are concatenated, and checked once
against `tokenizer.apply_chat_template` of the same messages.

  (a) shared system prompt, sequential: N (16) requests = system turn + distinct question, each sent
      after the previous one finished; max_tokens --max-tokens (16). Reports per-request TTFT, the
      median TTFT of requests 2..N (hits) against request 1 (miss), prefill tokens computed, hit rate.
  (b) multi-turn: C (8) conversations x T (4) turns, each conversation opening with the same shared
      system prompt. Turn k+1's prompt = turn k's prompt ids + its reply ids + the ids of
      `<|im_end|>\\n<|im_start|>user\\n{msg}<|im_end|>\\n<|im_start|>assistant\\n` (exactly what
      the SmolLM2 template renders for the history; the reply is kept as ids, never re-tokenized).
      Turn k of all C conversations is one concurrent batch; then turn k+1. max_tokens 32.
      Reports median TTFT per turn, prefill tokens computed, hit rate (overall and per turn).
  (c) burst: the N requests of (a) all added before the first step, cache cold. Reports the time
      until all finish, prefill tokens computed, the time for one such request alone (cold; median
      of --single-repeats runs) and burst/single; the same with N/2 (8) users. For the ON mode it
      also checks that the shared prefix was computed only once: "duplicate prefix tokens" = prefill
      computed - (all tokens of the first prompt + every other prompt's tokens past the shared full
      blocks); any value > 0 means some request recomputed blocks another request was computing.
  (c+) burst after warm-up traffic (issue 22): as a server runs, not cold. The cache is emptied, then one
      unrelated chat (another system prompt: only the template's opening `<|im_start|>system\n` is
      shared) runs alone, then the burst: N and N/2 users with a new system prompt whose shared prefix
      (system turn + `<|im_start|>user\n`) ends on a block boundary, and one that ends 7 tokens past
      one. Reports total time / one request alone (c's cold single), prefill tokens, duplicate prefix
      tokens and each request's num_cached_tokens; every request but the first should be served the
      shared prefix less at most one block.

Targets (cache ON; "x" ratios are OFF/ON): hit TTFT median <= 15% of the miss (a); burst of N and of
N/2 users <= 2.5x one request alone (c, and c+ after warm-up traffic); prefill tokens computed reduced
>= 5x (a) and >= 4x (c, burst of N); hit rate >= 90% (a) and >= 80% (b). --scenarios picks a subset.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_common
import bench_common as bc  # noqa: E402  (stdlib-only at import time)

RESULT_MARKER = "BENCH_PREFIX_RESULT_JSON: "
MODES = ("on", "off")

# --------------------------------------------------------------------------------------------------
# Workload: deterministic, varied English text
# --------------------------------------------------------------------------------------------------

_SUBJECTS = [
    "The harbour master", "A young engineer", "The village council", "An old fisherman", "The schoolteacher",
    "A travelling merchant", "The retired doctor", "Our customer support team", "The night nurse",
    "A visiting botanist", "The railway surveyor", "The head librarian", "A curious student",
    "The county archivist", "The baker's daughter", "A group of volunteers", "The ferry captain",
    "The museum curator", "A local historian", "The weather observer",
]
_VERBS = [
    "recorded", "questioned", "repaired", "described", "measured", "catalogued", "inspected", "sketched",
    "argued about", "carefully explained", "rebuilt", "photographed", "translated", "summarised",
    "collected", "compared", "tested", "defended", "questioned the cost of", "planned",
]
_OBJECTS = [
    "the tide tables", "the broken lantern", "a ledger of grain prices", "the northern sea wall",
    "the map of the old mill", "a box of letters from 1890", "the water pump", "the signal flags",
    "the roof of the chapel", "a list of missing boats", "the telescope lens", "the accounts of the fair",
    "the new timetable", "a crate of apple saplings", "the school's only globe", "the flood markers",
    "the bridge foundations", "the harvest records", "a sample of river clay", "the lighthouse log",
]
_PLACES = [
    "near the quay", "behind the market hall", "on the hill above the valley", "in the reading room",
    "beside the stone bridge", "at the edge of the barley fields", "inside the customs house",
    "under the railway arches", "by the salmon weir", "in the back office", "on the windy headland",
    "at the crossroads inn", "in the cellar of the town hall", "along the coast road",
]
_TIMES = [
    "before dawn", "late on a Thursday", "during the spring storms", "after the harvest festival",
    "in the dry summer of 1868", "on the first frosty morning", "while the mail coach was late",
    "at the turn of the century", "during the long winter", "soon after the flood", "every second week",
    "on the eve of the election",
]
_REASONS = [
    "because nobody else trusted the figures", "so that the insurance claim could be settled",
    "to settle a quarrel between two families", "since the old method kept failing",
    "hoping to win a grant from the county", "to prepare for the inspector's visit",
    "because the children kept asking questions", "to prove that the river had moved",
    "after a complaint from the shipping company", "so the records would survive another century",
]
_RULES = [
    "Always answer in plain language and name the source note you relied on.",
    "If two notes disagree, say so and give both versions.",
    "Keep answers short unless the user asks for detail.",
    "Never invent dates that are not in the notes.",
    "When a number is uncertain, give a range rather than a single value.",
    "Refer to people by their role when their name is unknown.",
]

_Q_TOPICS = [
    "the sea wall", "the grain prices", "the missing boats", "the railway survey", "the chapel roof",
    "the flood markers", "the telescope", "the mill map", "the harvest records", "the ferry timetable",
    "the apple saplings", "the customs house", "the signal flags", "the lighthouse log", "the salmon weir",
    "the market hall", "the school globe", "the letters from 1890", "the river clay", "the water pump",
]
_Q_GROUPS = [
    "the fishermen", "the farmers", "the children", "the merchants", "the council", "the doctor",
    "the teacher", "the ferry crew", "the archivist", "the volunteers",
]
_Q_FORMS = [
    "Based on the notes, why did {t} matter so much to {g}, and what changed after {p}?",
    "Could you summarise what the notes say about {t}, especially how {g} reacted {p}?",
    "Who was responsible for {t} {p}, and did {g} agree with the decision that was taken?",
    "What do we actually know about {t}, and which details would {g} most likely dispute?",
    "Please list two facts about {t} that {g} would find surprising, with the note each comes from.",
    "How did {t} affect daily life for {g}, and is there any sign it was still a problem {p}?",
]
_Q_PERIODS = [
    "in the spring", "after the storm", "during the survey", "the following year", "that winter",
    "before the railway came", "at the next market day", "in the years that followed",
]


def _sentences(rng: random.Random) -> Any:
    """An endless stream of varied sentences (a rule every so often)."""
    n = 0
    while True:
        n += 1
        if n % 9 == 0:
            yield rng.choice(_RULES)
            continue
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_PLACES)}"
        if rng.random() < 0.6:
            s += f" {rng.choice(_TIMES)}"
        if rng.random() < 0.5:
            s += f", {rng.choice(_REASONS)}"
        yield s + "."


def _text(seed: int, min_tokens: int, tokenizer: Any, header: str = "") -> str:
    rng = random.Random(seed)
    gen = _sentences(rng)
    parts = [header] if header else []
    # ~12 tokens per sentence; overshoot, the caller trims.
    while True:
        parts.extend(next(gen) for _ in range(max(8, min_tokens // 10)))
        text = " ".join(parts)
        if len(bc.encode(tokenizer, text)) >= min_tokens + 16:
            return text


def _question(i: int, target_tokens: int, tokenizer: Any) -> str:
    rng = random.Random(10_000 + i)
    q = f"Question {i + 1}: " + rng.choice(_Q_FORMS).format(
        t=rng.choice(_Q_TOPICS), g=rng.choice(_Q_GROUPS), p=rng.choice(_Q_PERIODS)
    )
    # Pad with a clause until ~target tokens, then cut at a word boundary.
    extras = [" Please keep it brief.", " Mention any dates you find.", " Say if the notes are unclear.",
              " Answer for a newcomer to the village.", " Quote the note if you can."]
    j = 0
    while len(bc.encode(tokenizer, q)) < target_tokens and j < 10:
        q += extras[(i + j) % len(extras)]
        j += 1
    words = q.split(" ")
    while len(words) > 4 and len(bc.encode(tokenizer, " ".join(words))) > target_tokens + 3:
        words.pop()
    return " ".join(words)


def system_turn(tokenizer: Any, num_tokens: int, seed: int = 1234,
                header: str = ("You are the archive assistant of a small harbour village. Answer questions using "
                               "only the background notes below.")) -> tuple[list[int], str]:
    """The templated system turn rendered to exactly `num_tokens` ids, and its text."""
    head = bc.encode(tokenizer, "<|im_start|>system\n")
    tail = bc.encode(tokenizer, "<|im_end|>\n")
    n_content = num_tokens - len(head) - len(tail)
    if n_content < 8:
        raise SystemExit(f"a system turn of {num_tokens} tokens is too small")
    text = _text(seed, n_content, tokenizer, header)
    content_ids = bc.encode(tokenizer, text)[:n_content]
    system_ids = head + content_ids + tail
    assert len(system_ids) == num_tokens
    return system_ids, tokenizer.decode(content_ids)


def build_workload(tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Token-id prompts, built identically in every worker."""
    system_ids, system_text = system_turn(tokenizer, args.system_tokens)

    def user_turn(msg: str) -> list[int]:
        return bc.encode(tokenizer, f"<|im_start|>user\n{msg}<|im_end|>\n<|im_start|>assistant\n")

    n_q = max(args.num_requests, args.mt_conversations * args.mt_turns)
    questions = [_question(i, args.question_tokens, tokenizer) for i in range(n_q)]
    prompts = [system_ids + user_turn(q) for q in questions[: args.num_requests]]

    # Does the concatenation equal what the chat template renders? (It must, for a server to hit.)
    checks = []
    for q, p in zip(questions[:2], prompts[:2]):
        rendered = tokenizer.apply_chat_template(
            [{"role": "system", "content": system_text}, {"role": "user", "content": q}],
            tokenize=False, add_generation_prompt=True,
        )
        checks.append(bc.encode(tokenizer, rendered) == p)

    # Multi-turn messages: conversation c, turn t asks question c * turns + t.
    mt_msgs = [
        [questions[(c * args.mt_turns + t) % n_q] for t in range(args.mt_turns)] for c in range(args.mt_conversations)
    ]
    return {
        "system_ids": system_ids,
        "system_text": system_text,
        "prompts": prompts,
        "questions": questions,
        "mt_msgs": mt_msgs,
        "template_roundtrip_ok": all(checks),
        "warmup_text": bc.PASSAGE,
    }


def next_turn_suffix(tokenizer: Any, msg: str) -> list[int]:
    """Ids that follow a reply's ids to open the next turn (SmolLM2 / ChatML template)."""
    return bc.encode(tokenizer, f"<|im_end|>\n<|im_start|>user\n{msg}<|im_end|>\n<|im_start|>assistant\n")


# --------------------------------------------------------------------------------------------------
# Worker: one engine, all scenarios
# --------------------------------------------------------------------------------------------------


class Driver:
    def __init__(self, llm: Any, SamplingParams: Any, mode: str) -> None:
        self.llm = llm
        self.engine = llm.engine
        self.SamplingParams = SamplingParams
        self.mode = mode
        self.block_size = llm.engine_info().block_size
        self._n = 0
        self.warnings: list[str] = []

    def params(self, max_tokens: int) -> Any:
        return self.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def reset_cache(self) -> None:
        if not self.engine.reset_prefix_cache():
            raise RuntimeError("the prefix cache cannot be reset while requests run")

    def counters(self) -> dict[str, int]:
        s = self.engine.stats()
        return {k: int(s[k]) for k in ("num_prefill_tokens_computed", "prefix_cache_queries_tokens",
                                       "prefix_cache_hits_tokens", "num_preemptions", "num_steps",
                                       "prefix_cache_evicted_blocks")}

    def run_batch(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
        """Add all prompts at once, step until they finish; per-request TTFT / end times."""
        engine = self.engine
        if engine.has_unfinished_requests():
            raise RuntimeError("engine has unfinished requests before a measured batch")
        params = self.params(max_tokens)
        rids = []
        t0 = time.perf_counter()
        for p in prompts:
            rid = f"{self.mode}-{self._n}"
            self._n += 1
            engine.add_request(rid, {"prompt_token_ids": p}, params)
            rids.append(rid)
        first: dict[str, float] = {}
        done: dict[str, float] = {}
        final: dict[str, Any] = {}
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.perf_counter()
            for o in outs:
                if o.request_id not in first and o.outputs and o.outputs[0].token_ids:
                    first[o.request_id] = now
                if o.finished:
                    done[o.request_id] = now
                    final[o.request_id] = o
        t_end = time.perf_counter()
        self.check_idle()
        reqs = []
        for rid, p in zip(rids, prompts):
            o = final[rid]
            toks = list(o.outputs[0].token_ids)
            if len(toks) != max_tokens:
                self.warnings.append(f"{rid}: {len(toks)} tokens, expected {max_tokens}")
            reqs.append({
                "prompt_len": len(p),
                "ttft_s": first[rid] - t0,
                "e2e_s": done[rid] - t0,
                "num_cached_tokens": int(o.num_cached_tokens or 0),
                "token_ids": toks,
            })
        return {"total_s": t_end - t0, "requests": reqs}

    def check_idle(self) -> None:
        """After every request finished: no locks, nothing running, integrity holds."""
        try:
            self.engine.check_integrity()
        except Exception as e:  # report, keep measuring
            self.warnings.append(f"check_integrity failed: {type(e).__name__}: {e}")
        s = self.engine.stats()
        if s["num_locked_blocks"] or s["num_running"] or s["num_waiting"]:
            self.warnings.append(f"engine not idle after a batch: {s}")
        if s["num_free_blocks"] + s["num_cached_blocks"] != s["num_total_blocks"]:
            self.warnings.append(f"free + cached != total after a batch: {s}")


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, Any]:
    d = {k: after[k] - before[k] for k in before}
    q = d["prefix_cache_queries_tokens"]
    d["hit_rate"] = d["prefix_cache_hits_tokens"] / q if q else 0.0
    return d


def _best_hit(prompt: list[int], sources: list[list[int]], block_size: int) -> int:
    """Tokens of `prompt` a perfect block-granular prefix cache could serve from `sources`.

    `sources` are token sequences whose KV was computed earlier (or is being computed by a request of
    the same batch). Matching is capped at len(prompt) - 1, like the engine's match_prefix.
    """
    best = 0
    head = prompt[:-1]
    for src in sources:
        n = 0
        for a, b in zip(head, src):
            if a != b:
                break
            n += 1
        best = max(best, n // block_size * block_size)
    return best


def _ideal(prompts: list[list[int]], earlier: list[list[int]], block_size: int) -> tuple[int, int]:
    """(fewest prefill tokens, most hit tokens) for a batch: each prompt may reuse `earlier` sequences
    and the prompts before it in the batch (requests of one batch share what the first computes)."""
    prefill = hits = 0
    for i, p in enumerate(prompts):
        h = _best_hit(p, earlier + prompts[:i], block_size)
        hits += h
        prefill += len(p) - h
    return prefill, hits


def _computed(prompt: list[int], reply: list[int]) -> list[int]:
    """Tokens whose KV a finished request computed: the prompt and all but the last reply token."""
    return prompt + reply[:-1]


def scenario_shared(d: Driver, work: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    d.reset_cache()
    before = d.counters()
    reqs = []
    for p in work["prompts"]:
        reqs.extend(d.run_batch([p], args.max_tokens)["requests"])
    res = _delta(before, d.counters())
    ttfts = [r["ttft_s"] for r in reqs]
    ideal_prefill = ideal_hits = 0
    done: list[list[int]] = []
    for p, r in zip(work["prompts"], reqs):
        pf, h = _ideal([p], done, d.block_size)
        ideal_prefill, ideal_hits = ideal_prefill + pf, ideal_hits + h
        done.append(_computed(p, r["token_ids"]))
    res.update({
        "ttft_s": ttfts,
        "num_cached_tokens": [r["num_cached_tokens"] for r in reqs],
        "miss_ttft_s": ttfts[0],
        "hit_ttft_median_s": bc.median(ttfts[1:]),
        "prompt_tokens": sum(r["prompt_len"] for r in reqs),
        "ideal_prefill_tokens": ideal_prefill,
        "ideal_hit_rate": ideal_hits / res["prefix_cache_queries_tokens"] if res["prefix_cache_queries_tokens"] else None,
        "token_ids": [r["token_ids"] for r in reqs],
    })
    return res


def scenario_multiturn(d: Driver, work: dict[str, Any], args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    d.reset_cache()
    before = d.counters()
    msgs = work["mt_msgs"]
    sys_ids = work["system_ids"]
    prompts = [sys_ids + bc.encode(tokenizer, f"<|im_start|>user\n{m[0]}<|im_end|>\n<|im_start|>assistant\n")
               for m in msgs]
    turns = []
    replies: list[list[list[int]]] = []
    done: list[list[int]] = []
    ideal_prefill = ideal_hits = 0
    for t in range(args.mt_turns):
        pf, h = _ideal(prompts, done, d.block_size)
        ideal_prefill, ideal_hits = ideal_prefill + pf, ideal_hits + h
        c0 = d.counters()
        out = d.run_batch(prompts, args.mt_max_tokens)
        dt = _delta(c0, d.counters())
        ttfts = [r["ttft_s"] for r in out["requests"]]
        turns.append({
            "turn": t + 1,
            "ttft_median_s": bc.median(ttfts),
            "ttft_max_s": max(ttfts),
            "total_s": out["total_s"],
            "prompt_len_mean": statistics.mean(len(p) for p in prompts),
            "prefill_tokens": dt["num_prefill_tokens_computed"],
            "hit_rate": dt["hit_rate"],
            "ideal_hit_rate": h / dt["prefix_cache_queries_tokens"] if dt["prefix_cache_queries_tokens"] else None,
        })
        reply_ids = [r["token_ids"] for r in out["requests"]]
        replies.append(reply_ids)
        done.extend(_computed(p, r) for p, r in zip(prompts, reply_ids))
        if t + 1 < args.mt_turns:
            prompts = [p + r + next_turn_suffix(tokenizer, m[t + 1]) for p, r, m in zip(prompts, reply_ids, msgs)]
    res = _delta(before, d.counters())
    q = res["prefix_cache_queries_tokens"]
    res.update({"turns": turns, "token_ids": replies, "ideal_prefill_tokens": ideal_prefill,
                "ideal_hit_rate": ideal_hits / q if q else None})
    return res


def scenario_burst(d: Driver, work: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {}
    singles = []
    for _ in range(args.single_repeats):
        d.reset_cache()
        singles.append(d.run_batch([work["prompts"][0]], args.max_tokens)["total_s"])
    res["single_s"] = bc.median(singles)
    res["single_runs_s"] = singles
    bursts = []
    for n in args.burst_sizes:
        prompts = work["prompts"][:n]
        d.reset_cache()
        before = d.counters()
        out = d.run_batch(prompts, args.max_tokens)
        dt = _delta(before, d.counters())
        ideal, _ = _ideal(prompts, [], d.block_size)
        ttfts = [r["ttft_s"] for r in out["requests"]]
        bursts.append({
            "users": n,
            "total_s": out["total_s"],
            "ratio_to_single": out["total_s"] / res["single_s"] if res["single_s"] else None,
            "ttft_median_s": bc.median(ttfts),
            "ttft_max_s": max(ttfts),
            "prefill_tokens": dt["num_prefill_tokens_computed"],
            "ideal_prefill_tokens": ideal,
            "duplicate_prefix_tokens": dt["num_prefill_tokens_computed"] - ideal,
            "num_cached_tokens": [r["num_cached_tokens"] for r in out["requests"]],
            "hit_rate": dt["hit_rate"],
            "num_steps": dt["num_steps"],
            "num_preemptions": dt["num_preemptions"],
        })
    res["bursts"] = bursts
    return res


def _shared_len(prompts: list[list[int]]) -> int:
    n = min(len(p) for p in prompts)
    for i in range(n):
        if any(p[i] != prompts[0][i] for p in prompts[1:]):
            return i
    return n


def scenario_burst_after_warmup(d: Driver, work: dict[str, Any], args: argparse.Namespace, tokenizer: Any,
                                single_s: float | None) -> dict[str, Any]:
    """(c+): bursts on a server that has already served an unrelated chat (template opening cached)."""
    bs = d.block_size
    user_head = len(bc.encode(tokenizer, "<|im_start|>user\n"))
    warm_sys, _ = system_turn(tokenizer, args.system_tokens, seed=99, header="You are a cheerful travel agent.")
    warm_prompt = warm_sys + bc.encode(tokenizer, "<|im_start|>user\nAny trains to the coast?<|im_end|>\n"
                                                  "<|im_start|>assistant\n")
    questions = work["questions"]
    runs = []
    for n in args.burst_sizes:
        for offset in (0, 7):  # the shared prefix ends on a block boundary, or 7 tokens past one
            target = (args.system_tokens + user_head) // bs * bs + offset
            sys_ids, _ = system_turn(tokenizer, target - user_head, seed=4321 + offset)
            prompts = [sys_ids + bc.encode(tokenizer, f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n")
                       for q in questions[:n]]
            shared = _shared_len(prompts)
            d.reset_cache()
            d.run_batch([warm_prompt], 4)  # the unrelated chat: caches the template opening's block
            before = d.counters()
            out = d.run_batch(prompts, args.max_tokens)
            dt = _delta(before, d.counters())
            ideal, _ = _ideal(prompts, [warm_prompt], bs)
            cached = [r["num_cached_tokens"] for r in out["requests"]]
            ttfts = [r["ttft_s"] for r in out["requests"]]
            runs.append({
                "users": n,
                "shared_prefix_tokens": shared,
                "on_block_boundary": shared % bs == 0,
                "total_s": out["total_s"],
                "ratio_to_single": out["total_s"] / single_s if single_s else None,
                "ttft_median_s": bc.median(ttfts),
                "prefill_tokens": dt["num_prefill_tokens_computed"],
                "ideal_prefill_tokens": ideal,
                "duplicate_prefix_tokens": dt["num_prefill_tokens_computed"] - ideal,
                "num_cached_tokens": cached,
                "all_but_first_served_prefix": all(c >= shared - bs for c in sorted(cached)[1:]),
                "num_steps": dt["num_steps"],
            })
    return {"runs": runs}


def worker(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    t = time.perf_counter()
    import torch

    from chatserve import LLM, SamplingParams

    import_s = time.perf_counter() - t
    model = bc.resolve_model(args.model)
    t = time.perf_counter()
    llm = LLM(model=model.path, dtype=args.dtype, enable_prefix_caching=(mode == "on"), num_threads=args.threads)
    load_s = time.perf_counter() - t
    tokenizer = llm.get_tokenizer()
    work = build_workload(tokenizer, args)
    d = Driver(llm, SamplingParams, mode)
    res: dict[str, Any] = {
        "mode": mode,
        "import_s": import_s,
        "load_s": load_s,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "block_size": d.block_size,
        "num_kv_blocks": d.engine.stats()["num_total_blocks"],
        "system_tokens": len(work["system_ids"]),
        "prompt_lens": [len(p) for p in work["prompts"]],
        "template_roundtrip_ok": work["template_roundtrip_ok"],
    }
    bc.log(mode, f"loaded in {load_s:.1f}s; prompts {min(res['prompt_lens'])}-{max(res['prompt_lens'])} tokens; "
               f"template round-trip {'ok' if work['template_roundtrip_ok'] else 'MISMATCH'}")

    # Warm-up on unrelated text (no shared prefix with the workload), then start cold.
    t = time.perf_counter()
    warm = bc.encode(tokenizer, work["warmup_text"])[: args.system_tokens + args.question_tokens]
    d.run_batch([warm], 2)
    d.run_batch([warm[i * 40 : i * 40 + 30] for i in range(4)], 4)
    d.reset_cache()
    res["warmup_s"] = time.perf_counter() - t

    if "a" in args.scenario_list:
        t = time.perf_counter()
        res["shared"] = scenario_shared(d, work, args)
        bc.log(mode, f"(a) shared prompt: miss TTFT {res['shared']['miss_ttft_s']:.3f}s, hit median "
                   f"{res['shared']['hit_ttft_median_s'] or 0:.3f}s, prefill "
                   f"{res['shared']['num_prefill_tokens_computed']} tokens, hit rate {res['shared']['hit_rate']:.1%}"
                   f"  [{time.perf_counter() - t:.1f}s]")
    if "b" in args.scenario_list:
        t = time.perf_counter()
        res["multiturn"] = scenario_multiturn(d, work, args, tokenizer)
        bc.log(mode, f"(b) multi-turn: prefill {res['multiturn']['num_prefill_tokens_computed']} tokens, hit rate "
                   f"{res['multiturn']['hit_rate']:.1%}  [{time.perf_counter() - t:.1f}s]")
    if "c" in args.scenario_list or "c+" in args.scenario_list:
        t = time.perf_counter()
        res["burst"] = scenario_burst(d, work, args)
        bc.log(mode, "(c) burst: single {:.2f}s; ".format(res["burst"]["single_s"]) + "; ".join(
            f"{b['users']} users {b['total_s']:.2f}s ({b['ratio_to_single']:.2f}x), prefill {b['prefill_tokens']}"
            for b in res["burst"]["bursts"]) + f"  [{time.perf_counter() - t:.1f}s]")
    if "c+" in args.scenario_list:
        t = time.perf_counter()
        res["burst_warm"] = scenario_burst_after_warmup(d, work, args, tokenizer, res["burst"]["single_s"])
        bc.log(mode, "(c+) burst after warm-up: " + "; ".join(
            f"{b['users']} users, prefix {b['shared_prefix_tokens']}: {b['total_s']:.2f}s ({b['ratio_to_single']:.2f}x), "
            f"duplicate {b['duplicate_prefix_tokens']}" for b in res["burst_warm"]["runs"])
            + f"  [{time.perf_counter() - t:.1f}s]")
    res["warnings"] = d.warnings
    res["peak_rss_mib"] = bc.peak_rss_mib()
    return res


# --------------------------------------------------------------------------------------------------
# Parent: run both modes, compare, print
# --------------------------------------------------------------------------------------------------


def _worker_argv(args: argparse.Namespace, mode: str) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), "--worker", mode,
            "--dtype", args.dtype, "--threads", str(args.threads),
            "--num-requests", str(args.num_requests), "--max-tokens", str(args.max_tokens),
            "--system-tokens", str(args.system_tokens), "--question-tokens", str(args.question_tokens),
            "--mt-conversations", str(args.mt_conversations), "--mt-turns", str(args.mt_turns),
            "--mt-max-tokens", str(args.mt_max_tokens), "--single-repeats", str(args.single_repeats),
            "--burst-sizes", ",".join(map(str, args.burst_sizes)), "--scenarios", ",".join(args.scenario_list)]
    if args.model:
        argv += ["--model", args.model]
    return argv


def run_worker_subprocess(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    res = bc.run_worker_process(_worker_argv(args, mode), mode, result_marker=RESULT_MARKER, timeout=args.timeout)
    if "error" in res:  # a worker reports only complete results
        raise SystemExit(f"worker {mode}: {res['error']} (see its stderr above)")
    return res


def evaluate(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    on, off = results.get("on"), results.get("off")
    checks: list[dict[str, Any]] = []

    def check(name: str, value: float | None, op: str, target: float) -> None:
        ok = None if value is None else (value <= target if op == "<=" else value >= target)
        checks.append({"name": name, "value": value, "op": op, "target": target, "pass": ok})

    if on and "shared" in on:
        a = on["shared"]
        check("(a) hit TTFT median / miss TTFT", bc.ratio(a["hit_ttft_median_s"], a["miss_ttft_s"]), "<=", 0.15)
        check("(a) hit rate", a["hit_rate"], ">=", 0.90)
    if on and "multiturn" in on:
        check("(b) hit rate", on["multiturn"]["hit_rate"], ">=", 0.80)
    if on and "burst" in on:
        for b in on["burst"]["bursts"]:
            check(f"(c) burst of {b['users']} / one request alone", b["ratio_to_single"], "<=", 2.5)
    if on and "burst_warm" in on:
        for b in on["burst_warm"]["runs"]:
            check(f"(c+) after warm-up, burst of {b['users']}, prefix {b['shared_prefix_tokens']} / one request alone",
                  b["ratio_to_single"], "<=", 2.5)
    if on and off and "shared" in on and "shared" in off:
        check("(a) prefill tokens computed OFF/ON", bc.ratio(off["shared"]["num_prefill_tokens_computed"],
                                                         on["shared"]["num_prefill_tokens_computed"]), ">=", 5.0)
    if on and off and "burst" in on and "burst" in off:
        b_on, b_off = on["burst"]["bursts"][0], off["burst"]["bursts"][0]
        check(f"(c) prefill tokens computed OFF/ON (burst of {b_on['users']})",
              bc.ratio(b_off["prefill_tokens"], b_on["prefill_tokens"]), ">=", 4.0)
    # Same greedy outputs with and without the cache?
    agree: dict[str, Any] = {}
    if on and off and "shared" in on and "shared" in off and "multiturn" in on and "multiturn" in off:
        a_on, a_off = on["shared"]["token_ids"], off["shared"]["token_ids"]
        agree["shared_same_outputs"] = sum(x == y for x, y in zip(a_on, a_off))
        agree["shared_total"] = len(a_on)
        m_on = [r for turn in on["multiturn"]["token_ids"] for r in turn]
        m_off = [r for turn in off["multiturn"]["token_ids"] for r in turn]
        agree["multiturn_same_outputs"] = sum(x == y for x, y in zip(m_on, m_off))
        agree["multiturn_total"] = len(m_on)
    return {"checks": checks, "agreement": agree}


def format_report(results: dict[str, dict[str, Any]], ev: dict[str, Any], args: argparse.Namespace) -> str:
    on, off = results.get("on") or {}, results.get("off") or {}
    g = lambda r, *ks: _get(r, ks)  # noqa: E731
    lines = []
    any_r = on or off
    lines.append(f"## Prefix cache benchmark: {args.model or bc.DEFAULT_GGUF_NAME}, {args.dtype}, "
                 f"{args.threads} thread(s), block size {any_r.get('block_size')}, "
                 f"system turn {any_r.get('system_tokens')} tokens, prompts "
                 f"{min(any_r.get('prompt_lens', [0]))}-{max(any_r.get('prompt_lens', [0]))} tokens")
    lines.append("")
    rows = [["metric", "cache ON", "cache OFF", "OFF/ON"]]

    def row(label: str, keys: tuple, spec: str = "{:.3f}", ratio: bool = True) -> None:
        a, b = g(on, *keys), g(off, *keys)
        r = bc.ratio(b, a) if ratio else None
        rows.append([label, bc.fmt(a, spec), bc.fmt(b, spec), bc.fmt(r, "{:.2f}x")])

    n = args.num_requests
    row("(a) TTFT request 1, miss (s)", ("shared", "miss_ttft_s"))
    row(f"(a) TTFT median requests 2..{n} (s)", ("shared", "hit_ttft_median_s"))
    row("(a) prefill tokens computed", ("shared", "num_prefill_tokens_computed"), "{:d}")
    row("(a) prompt tokens", ("shared", "prompt_tokens"), "{:d}", ratio=False)
    row("(a) hit rate", ("shared", "hit_rate"), "{:.1%}", ratio=False)
    row("(a) best possible hit rate (block-granular)", ("shared", "ideal_hit_rate"), "{:.1%}", ratio=False)
    for t in range(args.mt_turns):
        row(f"(b) turn {t + 1}: TTFT median (s)", ("multiturn", "turns", t, "ttft_median_s"))
    row("(b) prefill tokens computed", ("multiturn", "num_prefill_tokens_computed"), "{:d}")
    row("(b) hit rate", ("multiturn", "hit_rate"), "{:.1%}", ratio=False)
    row("(b) best possible hit rate (block-granular)", ("multiturn", "ideal_hit_rate"), "{:.1%}", ratio=False)
    for t in range(args.mt_turns):
        row(f"(b) turn {t + 1}: hit rate", ("multiturn", "turns", t, "hit_rate"), "{:.1%}", ratio=False)
    row("(c) one request alone, cold (s)", ("burst", "single_s"))
    for i, size in enumerate(args.burst_sizes):
        row(f"(c) burst {size} users: total (s)", ("burst", "bursts", i, "total_s"))
        row(f"(c) burst {size} users: / one alone", ("burst", "bursts", i, "ratio_to_single"), "{:.2f}x", ratio=False)
        row(f"(c) burst {size} users: TTFT median (s)", ("burst", "bursts", i, "ttft_median_s"))
        row(f"(c) burst {size} users: prefill tokens", ("burst", "bursts", i, "prefill_tokens"), "{:d}")
        row(f"(c) burst {size} users: duplicate prefix tokens", ("burst", "bursts", i, "duplicate_prefix_tokens"),
            "{:d}", ratio=False)
    for i, b in enumerate((on.get("burst_warm") or off.get("burst_warm") or {}).get("runs", [])):
        label = f"(c+) after warm-up, {b['users']} users, prefix {b['shared_prefix_tokens']}"
        row(f"{label}: total (s)", ("burst_warm", "runs", i, "total_s"))
        row(f"{label}: / one alone", ("burst_warm", "runs", i, "ratio_to_single"), "{:.2f}x", ratio=False)
        row(f"{label}: prefill tokens", ("burst_warm", "runs", i, "prefill_tokens"), "{:d}")
        row(f"{label}: duplicate prefix tokens", ("burst_warm", "runs", i, "duplicate_prefix_tokens"), "{:d}", ratio=False)
    row("load time (s)", ("load_s",), "{:.2f}", ratio=False)
    row("peak RSS (MiB)", ("peak_rss_mib",), "{:.0f}", ratio=False)
    lines.append(bc.markdown_table(rows))

    if on.get("shared") or off.get("shared"):
        lines.append("")
        rows = [["(a) request", "TTFT ON (s)", "TTFT OFF (s)", "cached tokens ON"]]
        for i in range(n):
            rows.append([str(i + 1), bc.fmt(g(on, "shared", "ttft_s", i)), bc.fmt(g(off, "shared", "ttft_s", i)),
                         bc.fmt(g(on, "shared", "num_cached_tokens", i), "{:d}")])
        lines.append(bc.markdown_table(rows))

    if ev["checks"]:
        lines.append("")
        rows = [["target", "value", "target", "result"]]
        for c in ev["checks"]:
            spec = "{:.1%}" if "hit rate" in c["name"] else "{:.2f}"
            tgt = spec.format(c["target"])
            if "TTFT" in c["name"]:
                spec, tgt = "{:.1%}", f"{c['target']:.0%}"
            res = "-" if c["pass"] is None else ("PASS" if c["pass"] else "FAIL")
            rows.append([c["name"], bc.fmt(c["value"], spec), f"{c['op']} {tgt}", res])
        lines.append(bc.markdown_table(rows))

    ag = ev.get("agreement") or {}
    if ag:
        lines.append("")
        lines.append(f"Greedy outputs identical ON vs OFF: (a) {ag['shared_same_outputs']}/{ag['shared_total']}, "
                     f"(b) {ag['multiturn_same_outputs']}/{ag['multiturn_total']} "
                     "(differences come from bf16 rounding of a different prefill split, not necessarily a bug).")
    for mode, r in results.items():
        if not r.get("template_roundtrip_ok", True):
            lines.append(f"WARNING ({mode}): the concatenated prompt ids differ from apply_chat_template's.")
        for w in r.get("warnings", []):
            lines.append(f"WARNING ({mode}): {w}")
        for key, label in (("shared", "(a)"), ("multiturn", "(b)")):
            sc = r.get(key) or {}
            extra = sc.get("num_prefill_tokens_computed", 0) - sc.get("ideal_prefill_tokens", 0)
            if mode == "on" and sc and extra > 0:
                lines.append(f"WARNING (on): {label} computed {extra} prefill tokens more than a perfect block-granular "
                             f"prefix cache would ({sc['ideal_prefill_tokens']}).")
        for b in (r.get("burst_warm") or {}).get("runs", []):
            lines.append(f"({mode}) (c+) {b['users']} users, shared prefix {b['shared_prefix_tokens']}: num_cached_tokens "
                         f"{b['num_cached_tokens']}")
        for b in (r.get("burst") or {}).get("bursts", []):
            if mode == "on" and b["duplicate_prefix_tokens"] > 0:
                lines.append(f"WARNING (on): burst of {b['users']} computed {b['duplicate_prefix_tokens']} tokens "
                             f"more than the ideal {b['ideal_prefill_tokens']}: a shared prefix was computed more than once.")
    return "\n".join(lines)


def _get(r: Any, keys: tuple) -> Any:
    for k in keys:
        if r is None:
            return None
        try:
            r = r[k]
        except (KeyError, IndexError, TypeError):
            return None
    return r


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--threads", type=int, default=2, help="torch threads per engine (default 2)")
    p.add_argument("--modes", default="on,off", help="which modes to run: on,off (default both)")
    p.add_argument("--num-requests", type=int, default=16, help="requests of (a) and the big burst of (c)")
    p.add_argument("--max-tokens", type=int, default=16, help="new tokens per request in (a) and (c)")
    p.add_argument("--system-tokens", type=int, default=1000, help="ids of the templated system turn")
    p.add_argument("--question-tokens", type=int, default=30, help="approximate ids per user question")
    p.add_argument("--mt-conversations", type=int, default=8)
    p.add_argument("--mt-turns", type=int, default=4)
    p.add_argument("--mt-max-tokens", type=int, default=32)
    p.add_argument("--single-repeats", type=int, default=3, help="runs of the lone cold request in (c); median")
    p.add_argument("--burst-sizes", default=None,
                   help="comma-separated user counts for (c) (default: N and N/2, e.g. 16,8)")
    p.add_argument("--scenarios", default="a,b,c,c+", help="which scenarios to run: a,b,c,c+ (default all)")
    p.add_argument("--json", default=None, help="write all results to this path")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per worker subprocess")
    p.add_argument("--in-process", action="store_true", help="run both modes in this process (no subprocesses)")
    p.add_argument("--worker", choices=MODES, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.burst_sizes is None:
        args.burst_sizes = [args.num_requests] + ([args.num_requests // 2] if args.num_requests >= 2 else [])
    elif isinstance(args.burst_sizes, str):
        args.burst_sizes = [int(x) for x in args.burst_sizes.split(",") if x.strip()]
    if any(b < 1 or b > args.num_requests for b in args.burst_sizes):
        p.error("--burst-sizes must lie in 1..--num-requests")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        p.error("--modes takes on, off or on,off")
    args.mode_list = modes
    args.scenario_list = [x.strip() for x in args.scenarios.split(",") if x.strip()]
    if not args.scenario_list or any(x not in ("a", "b", "c", "c+") for x in args.scenario_list):
        p.error("--scenarios takes a comma-separated subset of a, b, c, c+")
    if min(args.num_requests, args.max_tokens, args.mt_conversations, args.mt_turns, args.mt_max_tokens,
           args.single_repeats, args.threads) < 1:
        p.error("counts must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.worker:
        res = worker(args.worker, args)
        bc.emit_result(RESULT_MARKER, res)
        return 0
    t0 = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    for mode in args.mode_list:
        results[mode] = worker(mode, args) if args.in_process else run_worker_subprocess(args, mode)
    ev = evaluate(results, args)
    report = format_report(results, ev, args)
    print(report)
    print(f"\n(total wall time {time.perf_counter() - t0:.0f}s)")
    if args.json:
        payload = {
            "config": {k: v for k, v in vars(args).items() if k not in ("json", "worker")},
            "host": bc.env_info(),
            "results": results,
            **ev,
        }
        bc.write_json(args.json, payload, indent=1)
        print(f"wrote {args.json}")
    return 0  # targets are reported (PASS/FAIL), not enforced through the exit code


if __name__ == "__main__":
    sys.exit(main())
