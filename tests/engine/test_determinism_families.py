"""Batch- and thread-invariance of the whole engine, family by family (issue 51), at 1 and 2 threads.

tests/engine/test_determinism.py holds the promise for the default model (SmolLM2, a Llama); this module holds
it for the other forward paths, on tiny random models (bf16, the kernel tier forced): Llama with an
intermediate size that is not a multiple of 16 (the silu kernel's tail), Gemma 2 (GeGLU, the 1 + w norms
in fp32, attention and final soft-caps, a sliding window), Phi-3 (long-rope, a window over every layer)
and Qwen3-MoE (routed experts, per-head q/k norms). For each, one engine with speculative decoding on
(plain decoding opts out per request) and small prefill chunks, and the same 8 requests (4 prompts,
greedy with logprobs and seeded at temperature 0.8):

- the reference: each request alone, plain, at 1 compute thread;
- all 8 in one batch, plain, at 1 and at 2 threads (chunked prefills beside decodes; the prefix cache warm);
- all 8 in one batch with speculative decoding (verification rows), at 1 and at 2 threads, the drafts
  from an oracle that knows the reference and spoils every other draft's last token (a random model
  repeats too little for prompt lookup to draft reliably), so verifications accept and reject;

each the reference's tokens and logprob bits. The thread count is forced here (torch.set_num_threads,
which the kernels split their work by), whatever the xdist worker was given. The host's tier and AVX2
run in `make test`, the tiers between in `make test-all` (slow). Each engine reports a batch-invariant
forward path (LayerOps.batch_invariant) with no fallback that breaks it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from chatserve import LLM, SamplingParams
from tests.conftest import ENGINE_TIER_PARAMS, compute_threads, require_kernels

pytestmark = pytest.mark.timeout(1200)

FAMILIES = ("llama", "gemma2", "phi3", "qwen3_moe")
NEW_TOKENS = 12
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None}


class OracleDrafter:
    """Drafts the reference's next tokens for a sequence whose output so far is a prefix of one of its
    prompt's reference outputs; every other call spoils the last draft (a rejection), and a sequence off
    every reference (it would be a bug) gets no drafts."""

    def __init__(self, references: dict[tuple[int, ...], list[list[int]]]) -> None:
        self.references = references
        self.calls = 0

    def propose(self, seq_id, token_ids, num_prompt_tokens, max_tokens):
        prompt, out = tuple(token_ids[:num_prompt_tokens]), list(token_ids[num_prompt_tokens:])
        for ref in self.references.get(prompt, []):
            if ref[: len(out)] == out and len(ref) > len(out):
                drafts = ref[len(out) : len(out) + max_tokens]
                self.calls += 1
                if self.calls % 2 == 0:
                    drafts[-1] = (drafts[-1] + 1) % 1000
                return drafts
        return []

    def finish(self, seq_id, token_ids, num_prompt_tokens) -> None:
        pass


def _write_llama(folder: Path, tokenizer) -> Path:
    """A tiny Llama whose MLP width (72) is not a multiple of 16: the silu*up kernel's partial vector
    (a torch fallback before issue 51) on every tier, and head_dim 32 (the paged attention kernel)."""
    import torch
    import transformers

    from chatserve.models.loader import save_tokenizer

    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=72, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
        initializer_range=0.2, tie_word_embeddings=True,
    )
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    save_tokenizer(tokenizer, folder)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, smollm_tokenizer):
    made: dict[str, Path] = {}

    def make(family: str) -> Path:
        if family not in made:
            folder = tmp_path_factory.mktemp(f"det-{family}")
            if family == "llama":
                made[family] = _write_llama(folder, smollm_tokenizer)
            elif family == "qwen3_moe":
                from tests.helpers.moe_models import write_tiny_moe

                made[family] = write_tiny_moe(folder, family, smollm_tokenizer)
            else:
                from tests.helpers.tiny_families import write_family_checkpoint

                made[family] = write_family_checkpoint(folder, family, smollm_tokenizer)
        return made[family]

    return make


def _prompts(vocab: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(5)
    rand = [torch.randint(100, vocab - 100, (n,), generator=gen).tolist() for n in (45, 7, 23)]
    motif = rand[1][:5]
    return [*rand, motif * 6]  # the last repeats itself: the ngram drafter finds matches in it


def _params() -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    return [greedy] * 4 + [SamplingParams(temperature=0.8, seed=100 + i, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
                           for i in range(4)]


def _with_spec(params: list[SamplingParams], on: bool) -> list[SamplingParams]:
    import dataclasses

    return [dataclasses.replace(p, speculative_decoding=on) for p in params]


def _results(outputs) -> list[tuple[list[int], list[float]]]:
    """Tokens and the logprob of each (the bits: float equality)."""
    return [(list(o.outputs[0].token_ids), [e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outputs]


@pytest.mark.parametrize("tier", ENGINE_TIER_PARAMS)
@pytest.mark.parametrize("family", FAMILIES)
def test_batch_threads_and_speculation_give_the_same_bits(family, tier, checkpoint, smollm_tokenizer):
    require_kernels(tier)
    llm = LLM(model=str(checkpoint(family)), dtype="bfloat16", cpu_kernel_tier=tier, max_model_len=256,
              block_size=16, max_num_batched_tokens=32, speculative_config=SPEC)
    engine = llm.engine
    ops = engine.runner.ops
    assert ops.cpu is not None and ops.cpu.tier == tier
    assert engine.batch_invariant, ops.invariance()
    assert engine.stats()["batch_invariant"] and engine.stats()["spec_decode"]["exact"]
    prompts = [{"prompt_token_ids": ids} for ids in _prompts(len(smollm_tokenizer))]
    requests, params = prompts * 2, _params()
    plain = _with_spec(params, False)

    with compute_threads(1):
        reference = []
        for r, p in zip(requests, plain):
            engine.reset_prefix_cache()
            reference += _results(llm.generate([r], p))
    assert len({tuple(t) for t, _ in reference[:4]}) == 4, "a degenerate model: prompts give the same tokens"
    assert [t for t, _ in reference[4:]] != [t for t, _ in reference[:4]], "the seeded requests do not sample"

    assert engine.stats()["spec_decode"]["num_drafts"] == 0  # opted out: plain decoding
    references: dict[tuple[int, ...], list[list[int]]] = {}
    for r, (tokens, _) in zip(requests, reference):
        references.setdefault(tuple(r["prompt_token_ids"]), []).append(tokens)
    engine.spec.drafter = OracleDrafter(references)
    for threads in (1, 2):
        with compute_threads(threads):
            assert _results(llm.generate(requests, plain)) == reference, f"plain batch at {threads} threads"
            engine.reset_prefix_cache()
            assert _results(llm.generate(requests, _with_spec(params, True))) == reference, f"speculative at {threads} threads"
    spec = engine.stats()["spec_decode"]
    assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"], spec  # drafts accepted and rejected
    engine.check_integrity()
