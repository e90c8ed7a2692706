#!/usr/bin/env python3
"""Session KV leases under churn: chat sessions with think-time vs a stream of one-off requests.

    python benchmarks/engine/bench_leases.py                       # defaults: SmolLM2-135M GGUF, float32, 2 threads
    python benchmarks/engine/bench_leases.py --json bench_results/leases.json
    python benchmarks/engine/bench_leases.py --sessions 2 --turns 2 --think-s 0.2 --oneoff-tokens 64   # a quick smoke run

Method. One engine per mode (leases ON: every session turn leases its branch for --lease-seconds;
OFF: the same turns with lease 0, plain LRU), driven step by step in real time. S (8) sessions, each
with its own system prompt, run T (6) turns: a turn is added when the session's previous reply
finished plus --think-s seconds (the user typing), its prompt the previous prompt + reply + a new
user message (exact ids, as the session API builds them). Meanwhile a one-off request (a fresh
random prompt of --oneoff-tokens ids, 2 new tokens) is started whenever fewer than
--oneoff-concurrency of them run (closed loop, so the stream adapts to the host's speed instead of
queueing without bound), so the KV pool (--num-kv-blocks) is filled and churned while the users think. Token ids are random
(ids, not text: the model's speed does not depend on them), seeded, identical in both modes.

Reported per mode, over session turns 2..T (turn 1 cannot hit): the hit rate (cached prompt tokens /
prompt tokens looked up), how many turns found their whole stored history cached
(`session_history_matched`), TTFT p50 and p90 (add -> first token), one-off TTFT p50, evicted blocks,
leased blocks evicted (the lease is soft: those went because nothing unleased was left), preemptions.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: bench_common
import bench_common as bc  # noqa: E402  (stdlib-only at import time)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(200, 30_000) for _ in range(n)]


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def run_mode(lease_on: bool, args: argparse.Namespace) -> dict[str, Any]:
    from chatserve import LLM, SamplingParams
    from chatserve.core.session_kv import SessionKV

    model = bc.resolve_model(args.model)
    llm = LLM(model=model.path, dtype=args.dtype, num_threads=args.threads, num_kv_blocks=args.num_kv_blocks,
              block_size=16, max_num_seqs=args.sessions + 4, max_model_len=2048)
    engine = llm.engine
    warm = _ids(random.Random(1), 300)  # warm-up, then start cold
    engine.add_request("warm", {"prompt_token_ids": warm}, SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()

    rng = random.Random(args.seed)
    lease_s = args.lease_seconds if lease_on else 0.0
    reply = SamplingParams(temperature=0.0, max_tokens=args.reply_tokens, ignore_eos=True)
    oneoff = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    systems = [_ids(rng, args.system_tokens) for _ in range(args.sessions)]
    messages = [[_ids(rng, args.message_tokens) for _ in range(args.turns)] for _ in range(args.sessions)]
    oneoffs = [_ids(rng, args.oneoff_tokens) for _ in range(10_000)]

    t0 = time.perf_counter()
    history: list[list[int]] = [[] for _ in range(args.sessions)]
    turn = [0] * args.sessions
    next_at = [t0 + i * args.think_s / args.sessions for i in range(args.sessions)]  # staggered starts
    busy: dict[str, tuple[int, list[int], float]] = {}  # request id -> (session, prompt, added at)
    oneoff_added: dict[str, float] = {}
    oneoff_live: set[str] = set()
    n_oneoff = 0
    turns_out: list[dict[str, Any]] = []
    oneoff_ttft: list[float] = []
    seen_first: set[str] = set()
    before = engine.stats()
    while any(t < args.turns for t in turn) or busy:
        now = time.perf_counter()
        for s in range(args.sessions):
            rid = f"s{s}-t{turn[s]}"
            if turn[s] < args.turns and now >= next_at[s] and not any(b[0] == s for b in busy.values()):
                prompt = (systems[s] if not history[s] else history[s]) + messages[s][turn[s]]
                engine.add_request(rid, {"prompt_token_ids": prompt}, reply,
                                   session=SessionKV(f"sess-{s}", lease_s, len(history[s])))
                busy[rid] = (s, prompt, now)
        while len(oneoff_live) < args.oneoff_concurrency and any(t < args.turns for t in turn):
            rid = f"oneoff-{n_oneoff}"
            engine.add_request(rid, {"prompt_token_ids": oneoffs[n_oneoff % len(oneoffs)]}, oneoff)
            oneoff_added[rid] = now
            oneoff_live.add(rid)
            n_oneoff += 1
        if not engine.has_unfinished_requests():
            time.sleep(0.01)
            continue
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            rid = out.request_id
            if rid not in seen_first and out.outputs and out.outputs[0].token_ids:
                seen_first.add(rid)
                if rid in oneoff_added:
                    oneoff_ttft.append(now - oneoff_added[rid])
                elif rid in busy:
                    turns_out.append({"rid": rid, "ttft_s": now - busy[rid][2]})
            if out.finished:
                oneoff_live.discard(rid)
            if out.finished and rid in busy:
                s, prompt, _ = busy.pop(rid)
                st = out.stats
                rec = next(r for r in turns_out if r["rid"] == rid)
                rec.update({"session": s, "turn": turn[s] + 1, "prompt_tokens": len(prompt),
                            "cached_tokens": out.num_cached_tokens, "history_matched": st.session_history_matched,
                            "lease_hit": st.cache_lease_hit, "miss_reason": st.cache_miss_reason})
                history[s] = prompt + list(out.outputs[0].token_ids)
                turn[s] += 1
                next_at[s] = now + args.think_s
    wall = time.perf_counter() - t0
    while engine.has_unfinished_requests():  # the last one-offs
        engine.step()
    after = engine.stats()
    engine.check_integrity()
    later = [r for r in turns_out if r.get("turn", 1) >= 2]
    looked_up = sum(r["prompt_tokens"] - 1 for r in later)
    return {
        "leases": lease_on,
        "wall_s": wall,
        "session_turns": len(turns_out),
        "oneoff_requests": n_oneoff,
        "hit_rate_turns_2plus": sum(r["cached_tokens"] for r in later) / looked_up if looked_up else None,
        "history_matched_turns_2plus": sum(bool(r["history_matched"]) for r in later),
        "turns_2plus": len(later),
        "ttft_p50_turns_2plus_s": _pct([r["ttft_s"] for r in later], 0.5),
        "ttft_p90_turns_2plus_s": _pct([r["ttft_s"] for r in later], 0.9),
        "oneoff_ttft_p50_s": _pct(oneoff_ttft, 0.5),
        "evicted_blocks": after["prefix_cache_evicted_blocks"] - before["prefix_cache_evicted_blocks"],
        "leased_evicted_blocks": after["prefix_cache_leased_evicted_blocks"] - before["prefix_cache_leased_evicted_blocks"],
        "lease_hits": after["prefix_cache_lease_hits"] - before["prefix_cache_lease_hits"],
        "preemptions": after["num_preemptions"] - before["num_preemptions"],
        "miss_reasons_turns_2plus": {k: sum(r["miss_reason"] == k for r in later)
                                     for k in ("none", "new", "evicted", "diverged")},
        "turns": turns_out,
    }


def format_report(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    rows = [["metric"] + [("leases ON" if r["leases"] else "leases OFF") for r in results]]

    def row(label: str, key: str, spec: str = "{:.3f}") -> None:
        rows.append([label] + [bc.fmt(r[key], spec) for r in results])

    row("session turns 2..T: hit rate", "hit_rate_turns_2plus", "{:.1%}")
    row("session turns 2..T: whole history cached", "history_matched_turns_2plus", "{:d}")
    row("session turns 2..T", "turns_2plus", "{:d}")
    row("session turns 2..T: TTFT p50 (s)", "ttft_p50_turns_2plus_s")
    row("session turns 2..T: TTFT p90 (s)", "ttft_p90_turns_2plus_s")
    row("one-off requests", "oneoff_requests", "{:d}")
    row("one-off TTFT p50 (s)", "oneoff_ttft_p50_s")
    row("blocks evicted", "evicted_blocks", "{:d}")
    row("leased blocks evicted (nothing else left)", "leased_evicted_blocks", "{:d}")
    row("hits on a leased branch", "lease_hits", "{:d}")
    row("preemptions", "preemptions", "{:d}")
    row("wall time (s)", "wall_s", "{:.1f}")
    head = (f"## Session leases under churn: {args.sessions} sessions x {args.turns} turns, think {args.think_s}s, "
            f"one-offs of {args.oneoff_tokens} ids, {args.oneoff_concurrency} at a time, pool {args.num_kv_blocks} blocks "
            f"of 16, {args.dtype}, {args.threads} thread(s)")
    return head + "\n\n" + bc.markdown_table(rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--think-s", type=float, default=2.0, help="seconds between a reply and the next turn")
    p.add_argument("--system-tokens", type=int, default=128)
    p.add_argument("--message-tokens", type=int, default=16)
    p.add_argument("--reply-tokens", type=int, default=8)
    p.add_argument("--oneoff-tokens", type=int, default=192)
    p.add_argument("--oneoff-concurrency", type=int, default=1, help="one-off requests in flight at any time")
    p.add_argument("--num-kv-blocks", type=int, default=160, help="KV pool: too small for sessions + one-offs")
    p.add_argument("--lease-seconds", type=float, default=300.0)
    p.add_argument("--modes", default="on,off", help="leases on, off or on,off")
    p.add_argument("--seed", type=int, default=22)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        res = run_mode(mode == "on", args)
        bc.log(mode, f"hit rate {res['hit_rate_turns_2plus']:.1%}, TTFT p50 {res['ttft_p50_turns_2plus_s']:.3f}s, "
                     f"{res['oneoff_requests']} one-offs, {res['wall_s']:.1f}s")
        results.append(res)
    print(format_report(results, args))
    if args.json:
        bc.write_json(args.json, {"config": vars(args), "host": bc.env_info(), "results": results}, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
