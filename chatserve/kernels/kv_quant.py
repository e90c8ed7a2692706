"""The 8-bit KV cache's rows: one token's one KV head as D int8 quants and that row's fp32 scale.

An int8 layer cache is a ``torch.int8`` tensor ``[num_blocks, block_size, KVH, D + 4]``. In the
reference layout (what `store_kv_cache` writes and the torch reference attention reads) each row is
the D quants followed by the scale's 4 raw bytes (native little-endian: ``row[D:].view(float32)``).
The scale is per token and head, never per block, so a token's bytes depend on that token alone: a
cold run and a prefix hit read the same K/V, and a block stored to disk reads back bit for bit.

Quantization, bit-exact in every implementation (this module, and every C++ kernel tier):

    x = the value widened to fp32;  amax = max |x| over the row;  scale = amax / 127.0f
    q = 0 where scale == 0, else (int8) clamp(round_half_to_even(x / scale), -127, 127)
    dequantized value = (float) q * scale

(both divisions fp32 IEEE, elementwise: never a multiply by a reciprocal). The model's dtype is
what is widened: bfloat16 normally, float32 where the engine runs float32 (its K/V quantized from
the float32 values directly).
"""

from __future__ import annotations

import torch

__all__ = ["KV_DTYPES", "SCALE_BYTES", "dequantize_kv_rows", "kv_row_bytes", "kv_row_width", "quantize_kv_rows",
           "read_kv"]

SCALE_BYTES = 4
"""Bytes of each row's fp32 scale, after its D quants."""
QMAX = 127.0
KV_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "int8": torch.int8}
"""`EngineArgs.kv_cache_dtype` names other than auto, and the cache tensor's element type."""


def kv_row_width(head_dim: int, kv_dtype: torch.dtype) -> int:
    """Elements of one (block, slot, head) row of a layer cache: D, or D + 4 for int8 (the scale)."""
    return head_dim + SCALE_BYTES if kv_dtype == torch.int8 else head_dim


def kv_row_bytes(head_dim: int, kv_dtype: torch.dtype) -> int:
    """Bytes one token's one KV head takes (K or V): 2 * D in bf16, D + 4 in int8 (scale included)."""
    return kv_row_width(head_dim, kv_dtype) * torch.empty((), dtype=kv_dtype).element_size()


def quantize_kv_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] (any float dtype) -> [..., D + 4] int8 rows in the reference layout, per the contract."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # NOTE: tensor / tensor of the same shape, so torch divides elementwise (IEEE); a Python scalar
    # divisor may be turned into a multiply by its reciprocal, which rounds differently.
    scale = amax / torch.full_like(amax, QMAX)
    nonzero = scale != 0
    ratio = xf / torch.where(nonzero, scale, torch.ones_like(scale)).expand_as(xf).contiguous()
    q = torch.where(nonzero, torch.round(ratio).clamp_(-QMAX, QMAX), torch.zeros_like(ratio)).to(torch.int8)
    return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)


def dequantize_kv_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 4] int8 rows -> [..., D] of ``dtype``: (float) q * scale, then cast."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :head_dim].float() * scale).to(dtype)


def read_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows gathered by the reference attention, as ``dtype`` values to attend over."""
    if rows.dtype == torch.int8:
        return dequantize_kv_rows(rows, dtype)
    return rows.to(dtype)
