"""Attention kernels over the paged KV cache: pure-torch references (CPU path, ground truth)."""

from .reference import (
    attention_lse,
    cascade_decode_attention,
    cascade_extend_attention,
    merge_attention_states,
    extend_attention_dense,
    paged_decode_attention,
    paged_extend_attention,
    store_kv_cache,
)

__all__ = [
    "attention_lse",
    "cascade_decode_attention",
    "cascade_extend_attention",
    "merge_attention_states",
    "extend_attention_dense",
    "paged_decode_attention",
    "paged_extend_attention",
    "store_kv_cache",
]
