"""Our forward pass and greedy decoding against transformers on the same weights (float32)."""

from __future__ import annotations

import pytest
import torch

from chatserve import LLM, SamplingParams
from chatserve.llm import apply_chat_template
from tests.conftest import TINY_ARCHS

CONVERSATIONS = {
    "english": [{"role": "user", "content": "Explain in a few sentences why the sky is blue."}],
    "chinese": [{"role": "user", "content": "介绍一下北京的旅游景点"}],
    "system": [
        {"role": "system", "content": "You are a pirate. Always answer like a pirate, at length."},
        {"role": "user", "content": "Describe your ship and your crew."},
    ],
}


def hf_greedy(model, ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False,
        )
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_default_model_greedy_matches_transformers(name, llm_fp32, hf_default):
    model, tok = hf_default
    ids = apply_chat_template(tok, CONVERSATIONS[name])
    ours = llm_fp32.chat(CONVERSATIONS[name], SamplingParams(temperature=0.0, max_tokens=32))[0]
    assert ours.prompt_token_ids == ids
    theirs = hf_greedy(model, ids, 32)
    # transformers keeps the EOS token in its output; so do we (in token_ids)
    assert ours.outputs[0].token_ids == theirs
    assert len(theirs) >= 24, "pick prompts whose answers are long enough to compare 24 tokens"
    text = ours.outputs[0].text
    assert text == tok.decode(ours.outputs[0].token_ids, skip_special_tokens=True)
    assert "\ufffd" not in text
    if name == "chinese":
        assert any("\u4e00" <= ch <= "\u9fff" for ch in text)


def test_default_model_logits_match(llm_fp32, hf_default):
    model, tok = hf_default
    ids = apply_chat_template(tok, CONVERSATIONS["system"])
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    ours = llm_fp32.generate({"prompt_token_ids": ids}, params)[0].outputs[0]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
    entry = ours.logprobs[0]
    top = torch.topk(ref, 5)
    assert ours.token_ids[0] == int(top.indices[0])
    for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
        assert tid in entry
        assert entry[tid].logprob == pytest.approx(lp, abs=1e-4)


def test_batch_equals_one_at_a_time(llm_fp32, hf_default):
    _, tok = hf_default
    convs = [
        [{"role": "user", "content": "Hi!"}],
        [{"role": "user", "content": "Write a haiku about the ocean and the moon, then explain it."}],
        CONVERSATIONS["chinese"],
        [{"role": "user", "content": "List three prime numbers."}],
        CONVERSATIONS["system"],
    ]
    # 10 tokens: the batch's bookkeeping (slots, positions, each row's KV) is what differs from one at
    # a time, and it is exercised from the first decode step; float32 torch decodes ~15 tok/s on AVX2
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    alone = [llm_fp32.chat(c, params)[0].outputs[0].token_ids for c in convs]
    steps_before = llm_fp32.engine.num_steps
    together = [o.outputs[0].token_ids for o in llm_fp32.chat(convs, params)]
    assert together == alone
    # batched: all five prompts share forward passes (10 tokens each -> about 10 steps, not 5 x 10)
    assert llm_fp32.engine.num_steps - steps_before <= 12


@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_tiny_architectures_match_transformers(arch, tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    folder = tiny_checkpoint(arch, shard=(arch == "mistral"))
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, enable_prefix_caching=False)
    assert llm.engine.model_config.architecture == hf.config.architectures[0]
    prompts = [
        [5, 17, 300, 4000, 12, 9, 77, 1024, 3, 3, 8, 15000, 41, 2500, 99, 6, 7, 21, 33],  # > one 16-token block
        [42, 43, 44],
    ]
    for ids in prompts:
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=1, logprobs=0))[0]
        with torch.no_grad():
            ref_logits = hf(torch.tensor([ids])).logits[0, -1]
        ref_lp = torch.log_softmax(ref_logits.float(), -1)
        ours_lp = out.outputs[0].logprobs[0][out.outputs[0].token_ids[0]].logprob
        assert out.outputs[0].token_ids[0] == int(ref_logits.argmax())
        assert ours_lp == pytest.approx(float(ref_lp.max()), rel=1e-4, abs=1e-5)
        # full final-position logits, through the model directly
        logits = final_logits(llm, ids)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4 * float(ref_logits.abs().max()))
        greedy = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=24))[0]
        assert greedy.outputs[0].token_ids == hf_greedy(hf, ids, 24)


def final_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Run one prefill through our model runner into free blocks and return the last position's logits."""
    from chatserve.forward_batch import build_forward_batch

    runner = llm.engine.runner
    bm = llm.engine.block_manager
    blocks = bm.allocator.allocate(bm.blocks_for(len(ids)))
    try:
        batch = build_forward_batch(
            decode_tokens=[], decode_positions=[], decode_block_tables=[],
            extend_tokens=[ids], extend_start_positions=[0], extend_block_tables=[blocks],
            extend_need_logits=[True], block_size=bm.block_size, device=runner.device, backend=runner.attention_backend,
        )
        return runner.model(batch, runner.kv_cache)[0]
    finally:
        bm.allocator.decref(blocks)
