"""Attention kernels over the paged KV cache.

`reference` holds the pure-torch ops (the CPU path and the ground truth);
`triton_attention` holds Triton kernels of the same signatures (the CUDA path).
The names below are loaded lazily: triton is optional off Linux, and the
kernels are built compiled or interpreted (``TRITON_INTERPRET=1``) when their
module is first imported.
"""

# Loaded on first use, as the Triton names are: importing `chatserve.kernels.tiers` (the engine's
# config does, and so the CLI) must not import torch.
_REFERENCE_EXPORTS = (
    "attention_lse",
    "cascade_decode_attention",
    "cascade_extend_attention",
    "extend_attention_dense",
    "merge_attention_states",
    "paged_decode_attention",
    "paged_extend_attention",
    "store_kv_cache",
)
_TRITON_EXPORTS = {
    "triton_store_kv_cache": "store_kv_cache",
    "triton_paged_decode_attention": "paged_decode_attention",
    "triton_paged_extend_attention": "paged_extend_attention",
}


def __getattr__(name: str):
    if name in _REFERENCE_EXPORTS:
        from . import reference

        return getattr(reference, name)
    if name in _TRITON_EXPORTS:
        from . import triton_attention

        return getattr(triton_attention, _TRITON_EXPORTS[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "attention_lse",
    "cascade_decode_attention",
    "cascade_extend_attention",
    "merge_attention_states",
    "extend_attention_dense",
    "paged_decode_attention",
    "paged_extend_attention",
    "store_kv_cache",
]  # the triton_* names stay out of `import *`, which would import triton
