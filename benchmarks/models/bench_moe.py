#!/usr/bin/env python3
"""Decode (batch 1) and prefill (1,000 tokens) speed of a ~1B-parameter mixture-of-experts model (#33),
of each MoE family chatserve loads from GGUF: Qwen3-MoE, Mixtral and OLMoE.

    python benchmarks/models/bench_moe.py --out /tmp/qwen3moe-1b-q8_0.gguf            # write the file once, then measure
    python benchmarks/models/bench_moe.py --out /tmp/qwen3moe-1b-q8_0.gguf --runs 3   # the file exists: measure only
    python benchmarks/models/bench_moe.py --family mixtral --out /tmp/mixtral-1b-q8_0.gguf
    python benchmarks/models/bench_moe.py --family olmoe --out /tmp/olmoe-1b-q8_0.gguf --llamacpp .venv-llamacpp/bin/python

The file is written in llama.cpp's own layout for its family (what convert_hf_to_gguf.py writes, the
layout tests/helpers/moe_models.py's `write_moe_gguf` uses), so llama.cpp loads the same file:

- qwen3moe (the default; architecture `qwen3moe`): hidden 1024, 16 layers, 16 heads of 64 with 4 KV
  heads, per-head q/k norms (head_dim values), 8 experts of width 2816 (`expert_feed_forward_length`),
  2 per token: 1.25B parameters, 0.42B active per token.
- mixtral (architecture `llama` with `expert_count`): hidden 1024, 16 layers, 16 heads of 64
  (head_dim = hidden / heads, as llama's loader derives it) with 4 KV heads, no q/k norms, 8 experts
  of width 2816 (`feed_forward_length`), 2 per token: 1.25B parameters, 0.42B active.
- olmoe (architecture `olmoe`): hidden 1024, 16 layers, 16 heads of 64 and as many KV heads
  (llama.cpp's olmoe loader takes both q/k norms over the whole hidden width, so KV heads = heads),
  q/k norms over the whole q and k projections, 16 experts of width 1408 (`feed_forward_length`),
  2 per token: 1.27B parameters, 0.31B active.

Parameter counts are the file's tensors (embedding table and output head included); "active" leaves
out the experts a token does not use. --hidden, --layers, --heads, --kv-heads, --experts, --used and
--expert-ffn change the shape (mixtral and olmoe: heads default to hidden / 64, so heads stay 64
wide; qwen3moe keeps 16 heads of 64 whatever the hidden size). Weights are random normal (fixed seed)
in the chosen ggml type (router and norms F32, as llama.cpp's converter leaves them); the tokenizer
is the default model's (SmolLM2). The text is noise, which is all a speed measurement needs (EOS is
ignored).

Measured: decode tokens/s of one stream (64 tokens after a 16-token prompt) and prefill tokens/s of
a 1,000-token prompt (time to its first token), each the median of `--runs` alternated runs, through
`LLM` in-process with the default kernel tier and `quantization="auto"` (the file's blocks kept).
The last line is one JSON object: family, architecture, shape, parameters (total, active), load
seconds and the medians (and llama.cpp's, with --llamacpp).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

TYPES = {"q4_0": 2, "q8_0": 8, "f16": 1}

# family -> llama.cpp architecture and the family's own defaults (the rest: hidden 1024, 16 layers, 2 experts
# per token; heads 16 for qwen3moe, hidden / 64 otherwise)
FAMILIES = {
    "qwen3moe": {"arch": "qwen3moe", "experts": 8, "expert_ffn": 2816, "rope_base": 1e6, "rms_eps": 1e-6},
    "mixtral": {"arch": "llama", "experts": 8, "expert_ffn": 2816, "rope_base": 1e6, "rms_eps": 1e-5},
    "olmoe": {"arch": "olmoe", "experts": 16, "expert_ffn": 1408, "rope_base": 1e4, "rms_eps": 1e-5},
}
ARCH_FAMILY = {spec["arch"]: family for family, spec in FAMILIES.items()}  # llama + expert_count is Mixtral


def resolve_heads(family: str, hidden: int, heads: int | None, kv_heads: int | None) -> tuple[int, int]:
    """(heads, KV heads), the family's defaults where not given: Qwen3-MoE 16 of 64 with 4 KV heads
    (head_dim is a key of its own); Mixtral and OLMoE heads of 64 (head_dim = hidden / heads), Mixtral
    with a quarter as many KV heads (as its 32 / 8), OLMoE with as many (llama.cpp's olmoe wants
    attn_k_norm over the whole hidden width)."""
    if family == "qwen3moe":
        return heads or 16, kv_heads or 4
    heads = heads or max(1, hidden // 64)
    return heads, kv_heads or (max(1, heads // 4) if family == "mixtral" else heads)


def write_random_moe_gguf(path: Path, default_gguf: str, *, hidden: int, layers: int, heads: int, kv_heads: int,
                          head_dim: int, experts: int, used: int, expert_ffn: int, qtype: int, seed: int = 0,
                          family: str = "qwen3moe") -> Path:
    """A random-weight MoE GGUF of `family` in llama.cpp's layout for it (see the module docstring)."""
    import gguf

    from tests.helpers.tiny_gguf import _tokenizer_fields, add_default_tokenizer

    arch = FAMILIES[family]["arch"]
    if family != "qwen3moe" and head_dim * heads != hidden:
        raise ValueError(f"{family}: llama.cpp's {arch} takes head_dim = hidden / heads ({hidden} / {heads}), "
                         f"not {head_dim}")
    if family == "olmoe" and kv_heads != heads:
        raise ValueError(f"olmoe: llama.cpp's loader takes attn_k_norm of the hidden width, so KV heads = heads "
                         f"({kv_heads} != {heads})")
    if heads % kv_heads:
        raise ValueError(f"{heads} heads do not share {kv_heads} KV heads evenly")
    rng = np.random.default_rng(seed)
    vocab = len(_tokenizer_fields(default_gguf)["tokenizer.ggml.tokens"])
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"random-{family}")
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(expert_ffn)  # Mixtral's and OLMoE's expert width; Qwen3-MoE's has its own key
    if family == "qwen3moe":
        w.add_expert_feed_forward_length(expert_ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    if family == "qwen3moe":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    else:
        w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(FAMILIES[family]["rope_base"])
    w.add_layer_norm_rms_eps(FAMILIES[family]["rms_eps"])
    w.add_expert_count(experts)
    w.add_expert_used_count(used)
    add_default_tokenizer(w, default_gguf)
    t = gguf.GGMLQuantizationType(qtype)

    def matmul(name: str, shape: tuple[int, ...], fan_in: int) -> None:
        a = rng.standard_normal(shape, dtype=np.float32) * fan_in**-0.5
        if qtype == 1:
            w.add_tensor(name, a.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(a, t), raw_dtype=t)

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    # q/k norms: Qwen3-MoE's per head (head_dim), OLMoE's over the whole projection, none in Mixtral
    qk_norms = {"qwen3moe": (head_dim, head_dim), "olmoe": (heads * head_dim, kv_heads * head_dim)}.get(family)
    matmul("token_embd.weight", (vocab, hidden), 1)
    norm("output_norm.weight", hidden)
    matmul("output.weight", (vocab, hidden), hidden)
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight", hidden)
        norm(f"blk.{i}.ffn_norm.weight", hidden)
        if qk_norms:
            norm(f"blk.{i}.attn_q_norm.weight", qk_norms[0])
            norm(f"blk.{i}.attn_k_norm.weight", qk_norms[1])
        matmul(f"blk.{i}.attn_q.weight", (heads * head_dim, hidden), hidden)
        matmul(f"blk.{i}.attn_k.weight", (kv_heads * head_dim, hidden), hidden)
        matmul(f"blk.{i}.attn_v.weight", (kv_heads * head_dim, hidden), hidden)
        matmul(f"blk.{i}.attn_output.weight", (hidden, heads * head_dim), heads * head_dim)
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", (rng.standard_normal((experts, hidden)) * hidden**-0.5).astype(np.float32))
        matmul(f"blk.{i}.ffn_gate_exps.weight", (experts, expert_ffn, hidden), hidden)
        matmul(f"blk.{i}.ffn_up_exps.weight", (experts, expert_ffn, hidden), hidden)
        matmul(f"blk.{i}.ffn_down_exps.weight", (experts, hidden, expert_ffn), expert_ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def describe_gguf(path: Path) -> dict:
    """Family, shape and parameter counts of a MoE GGUF, read from the file itself (so a file written
    earlier is described as it is, whatever the flags say)."""
    import gguf

    reader = gguf.GGUFReader(str(path))

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    experts, used = int(field(f"{arch}.expert_count", 0)), int(field(f"{arch}.expert_used_count", 0))
    total = sum(int(t.n_elements) for t in reader.tensors)
    expert_params = sum(int(t.n_elements) for t in reader.tensors if "_exps." in t.name)
    types = sorted({t.tensor_type.name for t in reader.tensors if "_exps." in t.name})
    return {
        "family": ARCH_FAMILY.get(arch, arch) if experts else arch, "arch": arch,
        "hidden": int(field(f"{arch}.embedding_length")), "layers": int(field(f"{arch}.block_count")),
        "heads": int(field(f"{arch}.attention.head_count")), "kv_heads": int(field(f"{arch}.attention.head_count_kv")),
        "experts": experts, "experts_used": used,
        "expert_ffn": int(field(f"{arch}.expert_feed_forward_length", field(f"{arch}.feed_forward_length"))),
        "expert_type": ",".join(types),
        "params_total": total, "params_active": total - expert_params * (experts - used) // max(experts, 1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the .gguf to measure (written first where missing)")
    p.add_argument("--family", choices=sorted(FAMILIES), default="qwen3moe", help="which MoE family's layout to write")
    p.add_argument("--type", choices=sorted(TYPES), default="q8_0")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=None, help="default: 16 (qwen3moe), hidden / 64 (mixtral, olmoe)")
    p.add_argument("--kv-heads", type=int, default=None, help="default: 4 (qwen3moe), heads / 4 (mixtral), heads (olmoe)")
    p.add_argument("--experts", type=int, default=None, help="default: 8 (qwen3moe, mixtral), 16 (olmoe)")
    p.add_argument("--used", type=int, default=2)
    p.add_argument("--expert-ffn", type=int, default=None, help="default: 2816 (qwen3moe, mixtral), 1408 (olmoe)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--prefill-tokens", type=int, default=1000)
    p.add_argument("--llamacpp", default="", metavar="PYTHON", help="then run benchmarks/peers/llamacpp_bench.py on the same "
                   "file under this interpreter (e.g. .venv-llamacpp/bin/python): one run, side by side")
    args = p.parse_args()

    out = Path(args.out)
    if not out.exists():
        from chatserve.models.loader import default_model_path

        spec = FAMILIES[args.family]
        heads, kv_heads = resolve_heads(args.family, args.hidden, args.heads, args.kv_heads)
        head_dim = 64 if args.family == "qwen3moe" else args.hidden // heads
        t0 = time.perf_counter()
        write_random_moe_gguf(out, default_model_path(), family=args.family, hidden=args.hidden, layers=args.layers,
                              heads=heads, kv_heads=kv_heads, head_dim=head_dim, experts=args.experts or spec["experts"],
                              used=args.used, expert_ffn=args.expert_ffn or spec["expert_ffn"], qtype=TYPES[args.type])
        print(f"wrote {out} ({out.stat().st_size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.0f} s", flush=True)
    info = describe_gguf(out)
    if info["family"] != args.family:
        print(f"{out} is family {info['family']} (architecture {info['arch']}), not {args.family}: "
              f"pass --family {info['family']} or another --out", file=sys.stderr)
        return 2
    print(f"{info['family']} (llama.cpp architecture {info['arch']}): hidden {info['hidden']}, {info['layers']} layers, "
          f"{info['heads']} heads / {info['kv_heads']} KV, {info['experts']} experts of {info['expert_ffn']} "
          f"({info['experts_used']} per token, {info['expert_type']}): {info['params_total'] / 1e9:.3f}B parameters, "
          f"{info['params_active'] / 1e9:.3f}B active per token", flush=True)

    from chatserve import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(str(out), max_model_len=2048, enable_prefix_caching=False)
    load_s = time.perf_counter() - t0
    built = llm.engine_info()  # plain_parameters: what is left as torch tensors (norms, router, embeddings)
    print(f"loaded in {load_s:.1f} s: {built.architecture}, {built.num_layers} layers; {built.kernels}; "
          f"{built.plain_parameters / 1e6:.0f}M plain parameters besides the packed matmuls", flush=True)

    rng = np.random.default_rng(1)
    decode_prompt = [int(t) for t in rng.integers(200, 40000, 16)]
    decode = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    prefill = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate({"prompt_token_ids": decode_prompt}, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm
    decode_tps, prefill_tps = [], []
    for run in range(args.runs):  # alternated: decode, prefill, decode, prefill ...
        t0 = time.perf_counter()
        llm.generate({"prompt_token_ids": decode_prompt}, prefill)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        llm.generate({"prompt_token_ids": decode_prompt}, decode)
        decode_tps.append((args.decode_tokens - 1) / (time.perf_counter() - t0 - first))
        prompt = [int(t) for t in np.random.default_rng(100 + run).integers(200, 40000, args.prefill_tokens)]
        t0 = time.perf_counter()
        llm.generate({"prompt_token_ids": prompt}, prefill)
        prefill_tps.append(args.prefill_tokens / (time.perf_counter() - t0))
        print(f"run {run}: decode {decode_tps[-1]:.1f} tok/s, prefill {prefill_tps[-1]:.0f} tok/s", flush=True)
    print(f"median of {args.runs}: decode batch 1 {statistics.median(decode_tps):.1f} tok/s, "
          f"prefill {args.prefill_tokens} tokens {statistics.median(prefill_tps):.0f} tok/s")
    report = {**info, "file": str(out), "engine": "chatserve", "load_s": round(load_s, 2), "runs": args.runs,
              "decode_tok_s": round(statistics.median(decode_tps), 2), "prefill_tokens": args.prefill_tokens,
              "prefill_tok_s": round(statistics.median(prefill_tps), 1)}
    rc = 0
    if args.llamacpp:
        del llm
        import subprocess

        cmd = [args.llamacpp, os.path.join(ROOT, "benchmarks", "peers", "llamacpp_bench.py"), str(out), "--prefill",
               str(args.prefill_tokens), "--decode", str(args.decode_tokens), "--runs", str(args.runs)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            print(f"llama.cpp failed: {done.stderr.strip()[-800:]}", flush=True)
            report["llamacpp"] = {"error": done.stderr.strip()[-800:]}
            rc = 1
        else:
            got = json.loads(done.stdout.strip().splitlines()[-1])
            seconds = got[f"prefill_{args.prefill_tokens}_s"]  # rounded to 0.01 s: 0 for a tiny model
            rate = round(args.prefill_tokens / seconds, 1) if seconds else None
            print(f"llama.cpp {got['version']} (median of {args.runs}): decode batch 1 {got['decode_tok_s']:.1f} tok/s, "
                  f"prefill {args.prefill_tokens} tokens " + (f"{rate:.0f} tok/s" if rate else "in under 0.01 s")
                  + f", load {got['load_s']} s")
            report["llamacpp"] = {"version": got["version"], "load_s": got["load_s"], "decode_tok_s": got["decode_tok_s"],
                                  "prefill_tok_s": rate}
    print(json.dumps(report), flush=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
