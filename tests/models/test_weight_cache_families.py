"""Every family loaded twice from one weight cache answers bit for bit the same (issue 51).

A weight-cache hit (models/weight_cache.py) maps the processed weights and never calls the model's
`load_weights` / `process_weights`; whatever else a model builds at load (rotary tables, Gemma's
(1 + w) norm scales) must be rebuilt on that path too (`post_load`), or the second start of a model
answers differently from the first. Gemma 3's two rotary tables were built in `load_weights`, so its
second start used the default table in every layer: the first test is that case, against
transformers as well; the second loads every architecture of the registry (the tiny random models
the suite already writes, with a 256-token vocabulary) built, then mapped, and compares the logits
of every prompt position bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from chatserve.config import CacheConfig
from chatserve.forward_batch import build_forward_batch
from chatserve.layers.ops import select_layer_ops
from chatserve.models.config import ModelConfig
from chatserve.models.loader import load_hf_config, resolve_model
from chatserve.models.registry import MODEL_REGISTRY
from chatserve.models.weight_cache import WeightCacheConfig
from chatserve.worker.model_runner import ModelRunner
from tests.conftest import KERNEL_TIERS, write_tiny_checkpoint
from tests.helpers import moe_models, tiny_families

VOCAB = 256
BLOCK = 16
MAX_LEN = 128
PROMPT = [(i * 37 + 11) % (VOCAB - 8) + 4 for i in range(56)]  # 3.5 windows of 16: local layers mask


class _Tokenizer:
    """What the checkpoint writers read of a tokenizer; the model runner needs none."""

    bos_token_id, eos_token_id = 1, 2

    def __len__(self) -> int:
        return VOCAB

    def save_pretrained(self, folder: Any) -> None:
        pass


def _gemma3_alternating_config() -> Any:
    """Gemma 3 with local and global layers alternating (sliding_window_pattern 2: layers 1, 3, 5
    global), global rope theta 1e6 with linear scaling x8, local theta 1e4: the two tables differ at
    every position past 0."""
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1,
        eos_token_id=2, pad_token_id=2, initializer_range=0.2, sliding_window=tiny_families.WINDOW,
        query_pre_attn_scalar=24, sliding_window_pattern=2,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}},
    )
    assert config.layer_types == ["sliding_attention", "full_attention"] * 3
    config.architectures = ["Gemma3ForCausalLM"]
    return config


def _randomised(model: Any, gemma: bool) -> Any:
    """Non-trivial norm weights (Gemma's (1 + w) starts at w = 0), as tiny_families does."""
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if gemma else 1.0) + 0.3 * torch.randn(p.shape, generator=gen))
    return model.eval()


def _write_gemma3_alternating(folder: Path) -> Any:
    import transformers

    torch.manual_seed(1234)
    model = _randomised(transformers.AutoModelForCausalLM.from_config(
        _gemma3_alternating_config(), dtype=torch.float32, attn_implementation="eager"), gemma=True)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def _write_gemma3_multimodal(folder: Path) -> None:
    """Gemma3ForConditionalGeneration: the alternating text model under a tiny vision tower."""
    import transformers

    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=16, patch_size=8)
    config = transformers.Gemma3Config(text_config=_gemma3_alternating_config().to_dict(),
                                       vision_config=vision.to_dict(), mm_tokens_per_image=4)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    torch.manual_seed(1234)
    model = _randomised(transformers.Gemma3ForConditionalGeneration(config), gemma=True)
    model.save_pretrained(folder, safe_serialization=True)


def _write(folder: Path, family: str) -> str:
    """A tiny checkpoint of `family` in `folder`; returns its architecture."""
    tok = _Tokenizer()
    if family in ("llama3-rope", "qwen2", "qwen3"):
        write_tiny_checkpoint(folder, family, tok)
    elif family in tiny_families.FAMILIES:
        tiny_families.write_family_checkpoint(folder, family, tok)
    elif family in moe_models.FAMILIES:
        moe_models.write_tiny_moe(folder, family, tok)
    elif family == "gemma3-alternating":
        _write_gemma3_alternating(folder)
    elif family == "gemma3-multimodal":
        _write_gemma3_multimodal(folder)
    else:
        raise AssertionError(family)
    return load_hf_config(resolve_model(folder)).architectures[0]


# a checkpoint of every architecture in the registry (the last test checks that none is missing)
FAMILIES = {
    "llama3-rope": "LlamaForCausalLM", "mistral-window": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3-alternating": "Gemma3ForCausalLM",
    "gemma3-multimodal": "Gemma3ForConditionalGeneration", "phi3": "Phi3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "olmoe": "OlmoeForCausalLM",
}


def _runner(folder: Path, cache: Path, tier: str | None) -> ModelRunner:
    """A model runner as the engine builds one, its weights through the cache at `cache`; tier None:
    float32 through torch (no kernels)."""
    dtype = torch.float32 if tier is None else torch.bfloat16
    source = resolve_model(folder)
    hf = load_hf_config(source)
    cfg = ModelConfig.from_hf(hf)
    ops = select_layer_ops(dtype=dtype, device=torch.device("cpu"), attention_backend="auto", cpu_kernels=tier is not None,
                           amx=True, head_dim=cfg.head_dim, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                           is_gguf=source.is_gguf, cpu_kernel_tier=tier or "auto")
    return ModelRunner(source, hf, cfg, CacheConfig(BLOCK, MAX_LEN // BLOCK), dtype, torch.device("cpu"),
                       max_model_len=MAX_LEN, ops=ops, weight_cache=WeightCacheConfig(True, str(cache)))


def _logits(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """float32 logits at every position of one prefill of `ids` from an empty KV cache."""
    runner.kv_cache.zero_()
    blocks = list(range(-(-len(ids) // BLOCK)))
    batch = build_forward_batch(decode_tokens=[], decode_positions=[], decode_block_tables=[], extend_tokens=[ids],
                                extend_start_positions=[0], extend_block_tables=[blocks], extend_need_logits=[True],
                                extend_num_logits=[len(ids)], block_size=BLOCK, device=torch.device("cpu"),
                                backend=runner.attention_backend)
    return runner.model(batch, runner.kv_cache).clone()


def _built_then_mapped(folder: Path, cache: Path, tier: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    first = _runner(folder, cache, tier)
    assert first.weight_cache.status == "built", first.weight_cache
    a = _logits(first, PROMPT)
    del first
    second = _runner(folder, cache, tier)
    assert second.weight_cache.status == "hit", second.weight_cache
    return a, _logits(second, PROMPT)


def _assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape == (len(PROMPT), VOCAB), (what, a.shape, b.shape)
    same = torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert same, f"{what}: logits differ by up to {(a - b).abs().max().item()}"


def test_gemma3_local_and_global_layers_twice_from_one_cache_match_transformers(tmp_path):
    """The second start (a cache hit) rotates local layers with the local table and global ones with
    the global table, as the first does and as transformers does."""
    folder = tmp_path / "gemma3"
    hf_model = _write_gemma3_alternating(folder)
    built, mapped = _built_then_mapped(folder, tmp_path / "cache", None)
    with torch.no_grad():
        want = hf_model(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(built, want, atol=1e-4, rtol=1e-5)  # (float32: ~5e-6 here)
    _assert_bitwise(built, mapped, "gemma3, float32: the cache hit")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_family_twice_from_one_cache_gives_the_same_logits(family, tmp_path):
    """On the host's best kernel tier in bf16 (the production path: packed panels, the C++ layers),
    or float32 torch where the CPU has no tier."""
    folder = tmp_path / family
    arch = _write(folder, family)
    assert arch == FAMILIES[family]
    tier = KERNEL_TIERS[0] if KERNEL_TIERS else None
    built, mapped = _built_then_mapped(folder, tmp_path / "cache", tier)
    assert torch.isfinite(built).all()
    _assert_bitwise(built, mapped, f"{family} ({arch}, {tier or 'float32'})")


def test_the_families_above_cover_the_registry():
    """A new architecture in models/registry.py must get a checkpoint in FAMILIES above."""
    assert set(FAMILIES.values()) == set(MODEL_REGISTRY), sorted(set(MODEL_REGISTRY) - set(FAMILIES.values()))
