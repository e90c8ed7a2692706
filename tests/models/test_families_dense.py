"""Gemma 2, Gemma 3, Phi-3 / Phi-4-mini and a windowed Mistral against transformers (issue 33).

Tiny random models written by transformers (tests/helpers/tiny_families.py: a 16-token sliding
window, soft-caps that bite, local/global rope, long-rope, partial rotary). What must hold:
greedy tokens identical to transformers' eager float32 over a prompt several windows long; bounded
logprob drift in bf16 (the C++ kernels of every tier this host runs); the paged attention kernel's
window and soft-cap against the reference; a prefix cached across the window giving a cold run's
tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch

from chatserve import LLM, SamplingParams
from chatserve.kernels.reference import paged_extend_attention, paged_masked_attention
from tests.conftest import KERNEL_TIERS
from tests.helpers.tiny_families import FAMILIES, WINDOW, build_hf_model, write_family_checkpoint

PROMPT_LEN, NEW_TOKENS = 88, 16  # the prompt spans 5.5 windows


@pytest.fixture(scope="module")
def family_checkpoint(tmp_path_factory, smollm_tokenizer):
    made = {}

    def make(name: str):
        if name not in made:
            folder = tmp_path_factory.mktemp(f"family-{name}")
            made[name] = write_family_checkpoint(folder, name, smollm_tokenizer)
        return made[name]

    return make


def prompt_ids(vocab: int, n: int = PROMPT_LEN, seed: int = 7) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n,), generator=gen).tolist()


def hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs, one full forward a token (no cache: the
    masks of the whole sequence, exactly as the model defines them)."""
    seq = list(ids)
    out, lps = [], []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([seq])).logits[0, -1].float()
            tok = int(logits.argmax())
            out.append(tok)
            lps.append(float(torch.log_softmax(logits, -1)[tok]))
            seq.append(tok)
    return out, lps


def hf_logprobs_of(model, ids: list[int], continuation: list[int]) -> list[float]:
    """transformers' float32 logprob of each token of `continuation` after `ids` (teacher-forced)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids + continuation])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[len(ids) - 1 + i, t]) for i, t in enumerate(continuation)]


@pytest.fixture(scope="module")
def engine(family_checkpoint):
    """One engine per (family, dtype, kernel tier), shared by the module's tests (a load costs more
    than a test): tests that need a cold prefix cache reset it."""
    made = {}

    def get(name: str, dtype: str, tier: str = "auto"):
        key = (name, dtype, tier)
        if key not in made:
            made[key] = LLM(model=str(family_checkpoint(name)), dtype=dtype, max_model_len=256, block_size=16,
                            cpu_kernel_tier=tier)
        llm = made[key]
        assert llm.engine.reset_prefix_cache()
        return llm

    return get


@pytest.fixture(scope="module")
def hf_models(smollm_tokenizer):
    made = {}

    def get(name: str):
        if name not in made:
            made[name] = build_hf_model(name, len(smollm_tokenizer), smollm_tokenizer.bos_token_id,
                                        smollm_tokenizer.eos_token_id)
        return made[name]

    return get


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_matches_transformers_fp32(name, engine, hf_models, smollm_tokenizer):
    ids = prompt_ids(len(smollm_tokenizer))
    llm = engine(name, "float32")
    out = llm.generate({"prompt_token_ids": ids}, GREEDY)[0].outputs[0]
    theirs, their_lps = hf_greedy(hf_models(name), ids, NEW_TOKENS)
    assert out.token_ids == theirs
    ours_lps = [e[t].logprob for e, t in zip(out.logprobs, out.token_ids)]
    assert max(abs(a - b) for a, b in zip(ours_lps, their_lps)) < 1e-3


def test_window_and_softcap_change_the_answer(hf_models, smollm_tokenizer):
    """The test models exercise what they claim: without its window and soft-caps, Gemma 2's
    greedy tokens over this prompt are not the same (else the equivalence above proves nothing)."""
    model = hf_models("gemma2")
    ids = prompt_ids(len(smollm_tokenizer))
    with_all, _ = hf_greedy(model, ids, NEW_TOKENS)
    cfg = model.config
    saved = (cfg.attn_logit_softcapping, cfg.final_logit_softcapping, [layer.self_attn.sliding_window for layer in model.model.layers])
    try:
        for layer in model.model.layers:
            layer.self_attn.sliding_window = None
            layer.self_attn.attn_logit_softcapping = None
        cfg.final_logit_softcapping = None
        cfg.layer_types = ["full_attention"] * cfg.num_hidden_layers
        without, _ = hf_greedy(model, ids, NEW_TOKENS)
    finally:
        cfg.attn_logit_softcapping, cfg.final_logit_softcapping = saved[0], saved[1]
        cfg.layer_types = ["sliding_attention", "full_attention"] * 2
        for layer, w in zip(model.model.layers, saved[2]):
            layer.self_attn.sliding_window = w
            layer.self_attn.attn_logit_softcapping = saved[0]
    assert with_all != without


# ---- the attention kernels: window and soft-cap -----------------------------------------------


def test_masked_reference_without_window_is_plain_attention():
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(8, 4, 2, 32, generator=gen)
    v_cache = torch.randn(8, 4, 2, 32, generator=gen)
    q = torch.randn(9, 4, 32, generator=gen)
    tables = [[5, 1, 0, 3, 4, 2], [7, 6, 2, 2, 2, 2]]
    ref = paged_extend_attention(q, k_cache, v_cache, torch.tensor(tables), torch.tensor([0, 7, 9]), torch.tensor([19, 6]), 0.3)
    ours = paged_masked_attention(q, k_cache, v_cache, tables, [0, 7, 9], [12, 4], 0.3)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window,softcap", [(5, 0.0), (16, 0.0), (21, 2.5), (0, 1.5)])
def test_cpu_paged_attention_window_softcap(kernels, block_size, window, softcap):
    """The C++ kernel (each tier) against the reference: decodes and a chunk over cached keys in
    one call, blocks wholly before a row's window named by -1 (never read), a row alone giving the
    same bits as in the batch."""
    gen = torch.Generator().manual_seed(1)
    num_blocks, kvh, d = 40, 2, 64
    k_plain = torch.randn(num_blocks, block_size, kvh, d, generator=gen).to(torch.bfloat16)
    v_plain = torch.randn(num_blocks, block_size, kvh, d, generator=gen).to(torch.bfloat16)
    k_cache, v_cache = torch.empty_like(k_plain), torch.empty_like(v_plain)
    kernels.store_kv_paged(k_plain.view(-1, kvh, d), v_plain.view(-1, kvh, d), k_cache, v_cache,
                           torch.arange(num_blocks * block_size))
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    lens = [(70, 1), (3, 1), (40, 23)]  # (start position, new rows): two decodes, one chunk
    tables, i = [], 0
    for start, n in lens:
        nb = -(-(start + n) // block_size)
        tables.append(perm[i : i + nb])
        i += nb
    q = torch.randn(sum(n for _, n in lens), 6, d, generator=gen).to(torch.bfloat16)
    query_start = [0]
    for _, n in lens:
        query_start.append(query_start[-1] + n)
    starts = [s for s, _ in lens]
    ref = paged_masked_attention(q.float(), k_plain.float(), v_plain.float(), tables, query_start, starts, 0.125,
                                 window=window, softcap=softcap)
    hidden = []  # blocks wholly before each sequence's first row's window: -1 (the kernel must not read them)
    for t, s in zip(tables, starts):
        first = max(0, s - window + 1) if window else 0
        keep_from = first // 16 * 16 // block_size
        hidden.append([-1] * keep_from + t[keep_from:])
    width = max(len(t) for t in tables)
    padded = torch.tensor([t + [t[-1]] * (width - len(t)) for t in hidden])
    out = kernels.paged_attention(q, k_cache, v_cache, padded, torch.tensor(query_start), torch.tensor(starts),
                                  torch.arange(3), torch.tensor([0, 1, 2, 3]), 0.125, window, softcap)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    alone = kernels.paged_attention(q[2:], k_cache, v_cache, padded[2:], torch.tensor([0, 23]), torch.tensor([40]),
                                    torch.tensor([0]), torch.tensor([0, 1]), 0.125, window, softcap)
    assert torch.equal(alone, out[2:])
    if window:  # the window matters here: plain attention differs
        plain = paged_masked_attention(q.float(), k_plain.float(), v_plain.float(), tables, query_start, starts, 0.125,
                                       softcap=softcap)
        assert not torch.allclose(plain, ref, atol=2e-2, rtol=2e-2)


# ---- bf16: the C++ kernels of each tier --------------------------------------------------------


BF16_CASES = [("gemma2", t) for t in KERNEL_TIERS or ["none"]] + [(n, "auto") for n in ("gemma3", "phi3") if KERNEL_TIERS]


@pytest.mark.parametrize("name,tier", BF16_CASES)
def test_bf16_logprob_drift(name, tier, engine, hf_models, smollm_tokenizer):
    """bf16 on each kernel tier (Gemma 2; the others on the host's): our tokens' logprobs within a bound of transformers' float32 ones
    on the same tokens (teacher-forced, so a near-tie that flips does not end the comparison): no
    further than transformers' own bf16 model is, plus 0.1."""
    if tier == "none":
        pytest.skip("no kernel tier on this CPU")
    ids = prompt_ids(len(smollm_tokenizer))
    llm = engine(name, "bfloat16", tier)
    assert llm.engine.runner.attention_backend.name == "cpu"
    out = llm.generate({"prompt_token_ids": ids}, GREEDY)[0].outputs[0]
    ours = [e[t].logprob for e, t in zip(out.logprobs, out.token_ids)]
    model = hf_models(name)
    theirs = hf_logprobs_of(model, ids, out.token_ids)
    drift = max(abs(a - b) for a, b in zip(ours, theirs))
    # the bound: transformers' own bf16 drift on these tokens (random weights with a large init are
    # peaky, so bf16 rounding moves a logprob by up to ~1 on Phi-3's), and never more than 0.1 extra
    hf_bf16 = hf_logprobs_of(copy.deepcopy(model).to(torch.bfloat16), ids, out.token_ids)
    their_drift = max(abs(a - b) for a, b in zip(hf_bf16, theirs))
    assert drift <= max(0.1, their_drift + 0.1), (name, tier, drift, their_drift)


# ---- the prefix cache across the window ---------------------------------------------------------


@pytest.mark.parametrize("name,dtype", [("gemma2", "float32"), ("gemma2", "bfloat16"), ("phi3", "bfloat16")])
def test_prefix_cache_reuse_across_window(name, dtype, engine, smollm_tokenizer):
    """A prompt sharing a cached prefix several windows long gives the tokens of a cold run
    (windowed layers read only the prefix's last window, global ones all of it)."""
    base = prompt_ids(len(smollm_tokenizer), 4 * WINDOW + 5)
    longer = base + prompt_ids(len(smollm_tokenizer), 2 * WINDOW + 3, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = engine(name, dtype)
    llm.generate({"prompt_token_ids": base}, params)
    reused = llm.generate({"prompt_token_ids": longer}, params)[0]
    assert reused.num_cached_tokens >= 4 * WINDOW
    assert llm.engine.reset_prefix_cache()
    cold = llm.generate({"prompt_token_ids": longer}, params)[0]
    assert cold.num_cached_tokens == 0
    assert reused.outputs[0].token_ids == cold.outputs[0].token_ids


# ---- KV blocks past every layer's window ------------------------------------------------------


@pytest.mark.parametrize("dtype,block_size", [("float32", 8), ("bfloat16", 16)])
def test_blocks_outside_every_window_are_freed(dtype, block_size, engine, family_checkpoint, smollm_tokenizer):
    """Phi-3 windows every layer: without the prefix cache, the blocks its window has passed go
    back to the pool as the sequence runs, and the tokens are those of an engine that keeps them."""
    folder = str(family_checkpoint("phi3"))
    ids = prompt_ids(len(smollm_tokenizer), 4 * WINDOW)
    params = SamplingParams(temperature=0.0, max_tokens=2 * WINDOW, ignore_eos=True)
    keeps = engine("phi3", dtype)  # prefix cache on: nothing freed (16-token blocks: the same tokens)
    frees = LLM(model=folder, dtype=dtype, max_model_len=256, block_size=block_size, enable_prefix_caching=False,
                max_num_batched_tokens=32)  # chunked prefill: blocks freed between chunks too
    assert keeps.engine.kv_free_window == 0 and frees.engine.kv_free_window == WINDOW
    expected = keeps.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids
    bm = frees.engine.block_manager
    got = frees.generate([{"prompt_token_ids": ids}, {"prompt_token_ids": ids[:40]}], params)
    assert got[0].outputs[0].token_ids == expected
    total = len(ids) + 2 * WINDOW
    # all but the blocks of the last window (and its 16-key tile) went free while it ran
    assert bm.num_window_freed_blocks >= (total - 2 * WINDOW - 16) // block_size
    frees.engine.check_integrity()
    assert bm.num_free_blocks == bm.num_total_blocks  # nothing leaked, nothing freed twice
    assert keeps.engine.block_manager.num_window_freed_blocks == 0


# ---- GGUF files named as llama.cpp's converter names them -------------------------------------

Q8_0 = 8


@pytest.fixture(scope="module")
def family_gguf(tmp_path_factory, hf_models, default_gguf):
    from tests.helpers.tiny_families import write_family_gguf

    made = {}

    def make(name: str, qtype: int):
        if (name, qtype) not in made:
            path = tmp_path_factory.mktemp(f"gguf-{name}-{qtype}") / f"{name}.gguf"
            made[name, qtype] = write_family_gguf(path, name, hf_models(name), str(default_gguf), qtype)
        return made[name, qtype]

    return make


def test_gguf_tensor_names_and_keys(family_gguf):
    """The files carry llama.cpp's names: Phi-3's fused attn_qkv and ffn_up (gate|up), long-rope
    factors as tensors; Gemma 2's four norms a layer and its soft-cap keys."""
    import mmap

    from chatserve.models.gguf_header import read_gguf_header

    def header(path):
        with open(path, "rb") as f:
            return read_gguf_header(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))

    phi3 = header(family_gguf("phi3", Q8_0))
    shapes = {t.name: t.shape for t in phi3.tensors}
    assert shapes["blk.0.attn_qkv.weight"] == (128 + 2 * 64, 128) and shapes["blk.0.ffn_up.weight"] == (256, 128)
    assert "rope_factors_long.weight" in shapes and phi3.metadata["phi3.attention.sliding_window"] == WINDOW
    gemma2 = header(family_gguf("gemma2", Q8_0))
    names = {t.name for t in gemma2.tensors}
    assert {f"blk.1.{n}.weight" for n in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")} <= names
    assert gemma2.metadata["gemma2.attn_logit_softcapping"] == 4.0


@pytest.mark.parametrize("name", ["gemma2", "phi3"])
def test_gguf_f32_greedy_matches_transformers(name, family_gguf, hf_models, smollm_tokenizer):
    """From a float32 GGUF (the values unquantized), the same tokens as transformers on the source
    weights: names, the 1 + w norms, the fused splits and the metadata the config is completed from."""
    ids = prompt_ids(len(smollm_tokenizer))
    llm = LLM(model=str(family_gguf(name, 0)), dtype="float32", max_model_len=256)
    out = llm.generate({"prompt_token_ids": ids}, GREEDY)[0].outputs[0]
    assert out.token_ids == hf_greedy(hf_models(name), ids, NEW_TOKENS)[0]


@pytest.mark.parametrize("name", ["gemma2", "phi3"])
def test_gguf_q8_0_logprob_drift(name, family_gguf, hf_models, smollm_tokenizer):
    """Q8_0 blocks through the quantized kernels (bf16): our tokens' logprobs within 3x
    transformers' own bf16 drift plus 0.1 of its float32 ones (Q8_0 weights, int8 activations)."""
    ids = prompt_ids(len(smollm_tokenizer))
    llm = LLM(model=str(family_gguf(name, Q8_0)), dtype="bfloat16", max_model_len=256)
    out = llm.generate({"prompt_token_ids": ids}, GREEDY)[0].outputs[0]
    model = hf_models(name)
    ours = [e[t].logprob for e, t in zip(out.logprobs, out.token_ids)]
    theirs = hf_logprobs_of(model, ids, out.token_ids)
    hf_bf16 = hf_logprobs_of(copy.deepcopy(model).to(torch.bfloat16), ids, out.token_ids)
    their_drift = max(abs(a - b) for a, b in zip(hf_bf16, theirs))
    drift = max(abs(a - b) for a, b in zip(ours, theirs))
    assert drift <= 3 * their_drift + 0.1, (name, drift, their_drift)



def test_gemma3_multimodal_checkpoint_serves_its_language_model():
    """Gemma3ForConditionalGeneration: the text config is the model's, the language model's
    tensors load under the text names, the vision tower and projector are left out."""
    import transformers

    from chatserve.models.config import ModelConfig
    from chatserve.models.gemma import _text_weights
    from tests.helpers.tiny_families import hf_config

    text = hf_config("gemma3", 1000, 1, 2)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=16, patch_size=8)
    cfg = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict())
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    mc = ModelConfig.from_hf(cfg)
    assert (mc.architecture, mc.hidden_size, mc.num_layers, mc.layer_windows) == (
        "Gemma3ForConditionalGeneration", 64, 4, (WINDOW, WINDOW, 0, WINDOW))
    assert mc.qk_norm and mc.hf_config.model_type == "gemma3_text"
    names = ["language_model.model.layers.0.self_attn.q_proj.weight", "model.language_model.norm.weight",
             "vision_tower.vision_model.embeddings.patch_embedding.weight", "multi_modal_projector.mm_input_projection_weight",
             "language_model.lm_head.weight"]
    mapped = [n for n, _ in _text_weights((n, None) for n in names)]
    assert mapped == ["model.layers.0.self_attn.q_proj.weight", "model.norm.weight", "lm_head.weight"]
