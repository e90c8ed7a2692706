"""Routes one layer's attention through the kernels, as the ForwardBatch describes it.

This is the seam for attention backends, chosen once per engine
(`resolve_attention_backend`) and carried by every `ForwardBatch`:

- ``"torch"``: the pure-torch reference ops (the CPU path), with cascade
  attention for sequences sharing cached prefix blocks;
- ``"triton"``: the Triton paged kernels (the CUDA path; on the CPU only under
  Triton's interpreter, for tests). They read K/V through the block tables, so
  batches carry no cascade groups for them.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Literal

import torch

from chatserve.kernels import (
    cascade_decode_attention,
    cascade_extend_attention,
    paged_decode_attention,
    paged_extend_attention,
    store_kv_cache,
)

from chatserve.worker.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

AttentionBackendName = Literal["torch", "triton"]


def resolve_attention_backend(requested: str, device: torch.device) -> AttentionBackendName:
    """"auto" -> Triton on CUDA (when installed), the torch reference elsewhere; validate explicit choices."""
    if requested == "torch":
        return "torch"
    if requested == "auto":
        if device.type != "cuda":
            return "torch"
        if importlib.util.find_spec("triton") is None:
            logger.warning("attention_backend=auto: triton is not installed, using the torch reference on CUDA "
                           "(pip install triton for the paged kernels)")
            return "torch"
        return "triton"
    if requested != "triton":
        raise ValueError(f"attention_backend must be auto, torch or triton; got {requested!r}")
    if importlib.util.find_spec("triton") is None:
        raise ValueError("attention_backend='triton' needs the triton package: pip install triton (Linux), "
                         "or use attention_backend='torch'")
    if device.type == "cuda":
        return "triton"
    if device.type != "cpu":
        raise ValueError(f"attention_backend='triton' runs on CUDA devices (or the CPU interpreter), not {device.type!r}")
    from chatserve.kernels.triton_attention import interpret_requested

    if not interpret_requested():
        raise ValueError(
            "attention_backend='triton' on the CPU runs only in Triton's interpreter (slow; meant for tests): "
            "set TRITON_INTERPRET=1 in the environment before starting, or use attention_backend='auto' or 'torch'"
        )
    from chatserve.kernels.triton_attention import is_interpreted

    if not is_interpreted():
        raise ValueError(
            "the Triton kernels were compiled for CUDA because TRITON_INTERPRET=1 was set only after "
            "chatserve.kernels.triton_attention was first imported; set it before that import (e.g. at process start)"
        )
    return "triton"


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """Store the new K/V, then attend decodes and extends."""
    if batch.attention_backend == "triton":
        return _triton_attention(q, k, v, k_cache, v_cache, batch, scale)
    (batch.store_kv_kernel or store_kv_cache)(k, v, k_cache, v_cache, batch.slot_mapping)
    nd = batch.num_decodes
    if batch.num_extends == 0:
        return _decode(q, k_cache, v_cache, batch, scale)
    if nd == 0:
        return _extend(q, k_cache, v_cache, batch, scale)
    out = torch.empty_like(q)
    out[:nd] = _decode(q[:nd], k_cache, v_cache, batch, scale)
    out[nd:] = _extend(q[nd:], k_cache, v_cache, batch, scale)
    return out


def _triton_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    batch: ForwardBatch, scale: float,
) -> torch.Tensor:
    # NOTE: imported here, not at module level: the module decides at import whether its
    # kernels are compiled or interpreted, and the torch path must not need triton at all.
    from chatserve.kernels import triton_attention as tk

    tk.store_kv_cache(k, v, k_cache, v_cache, batch.slot_mapping)
    out = torch.empty_like(q)
    nd = batch.num_decodes
    if nd:
        tk.paged_decode_attention(
            q[:nd], k_cache, v_cache, batch.decode_block_tables, batch.decode_context_lens, scale,
            max_len=batch.decode_max_len, out=out[:nd],
        )
    if batch.num_extends:
        tk.paged_extend_attention(
            q[nd:], k_cache, v_cache, batch.extend_block_tables, batch.extend_query_start_loc, batch.extend_seq_lens,
            scale, max_query_len=batch.extend_max_query_len, out=out[nd:],
        )
    return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, scale: float) -> torch.Tensor:
    def plain(qp: torch.Tensor) -> torch.Tensor:
        if batch.decode_kernel is not None:
            return batch.decode_kernel(qp, k_cache, v_cache, batch.decode_block_tables, batch.decode_context_lens, scale)
        return paged_decode_attention(
            qp, k_cache, v_cache, batch.decode_block_tables, batch.decode_context_lens, scale,
            max_len=batch.decode_max_len, mask=batch.decode_mask,
        )

    if not batch.decode_groups:
        return plain(q)
    out = torch.empty_like(q)
    for g in batch.decode_groups:
        out[g.rows] = cascade_decode_attention(q[g.rows], k_cache, v_cache, g.prefix_slots, g.suffix_slots, g.suffix_mask, scale)
    if batch.decode_plain_rows is not None and batch.decode_plain_rows.numel():
        out[batch.decode_plain_rows] = plain(q[batch.decode_plain_rows])
    return out


def _extend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, scale: float) -> torch.Tensor:
    def plain(qp: torch.Tensor) -> torch.Tensor:
        return paged_extend_attention(
            qp, k_cache, v_cache, batch.extend_block_tables, batch.extend_query_start_loc, batch.extend_seq_lens, scale
        )

    if not batch.extend_groups:
        return plain(q)
    out = torch.empty_like(q)
    for g in batch.extend_groups:
        out[g.token_rows] = cascade_extend_attention(
            q[g.token_rows], k_cache, v_cache, g.prefix_slots, g.query_lens, g.suffix_slots, scale
        )
    if batch.extend_plain_rows is not None and batch.extend_plain_rows.numel():
        out[batch.extend_plain_rows] = plain(q[batch.extend_plain_rows])
    return out
