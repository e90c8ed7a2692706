"""Pure-torch/numpy reference of the quantized matmul API (csrc/tier_quant.cpp via cpu_quant.py).

Same functions, same arguments, the same arithmetic: "packed" is the GGUF blocks kept as they are
(or int8 rows followed by their fp32 scales); `rows` / `dequantize` de-quantise with the `gguf`
package (the compiled kernels return these bf16 values bit for bit), and `linear` quantises each
row of x to int8 in blocks of 32 exactly as the compiled kernel does (`quantize_activations`) and
multiplies those values by the de-quantised fp32 weights, one row at a time (so a row's result never
depends on the others: batch-invariant like the kernel). It equals the kernel up to fp32 summation
order and the final bf16 rounding, which the tests state as a tolerance. The engine runs on it
(slowly: it de-quantises the whole weight on every call) where the compiled kernels are missing and
quantization was asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

QTYPE_INT8_CHANNEL = 1000  # ours, not a GGUF type: w[n, k] = scale[n] * q[n, k], q int8, scale fp32
INT8_BLOCK = 32  # the kernels' K granularity for QTYPE_INT8_CHANNEL (cpu_quant.BLOCK_VALUES)
# GGML types the kernels keep packed: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K (and our int8 per channel)
SUPPORTED_QTYPES: frozenset[int] = frozenset({2, 3, 8, 12, 14, QTYPE_INT8_CHANNEL})


def block_layout(qtype: int) -> tuple[int, int]:
    """(values per block, bytes per block) of a GGML type (1 value, 1 byte for our int8 rows)."""
    if qtype == QTYPE_INT8_CHANNEL:
        return 1, 1
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of K values in the file's blocks; K must be a whole number of blocks."""
    block, size = block_layout(qtype)
    if k % block:
        raise ValueError(f"K={k} is not a multiple of the {block}-value block of ggml type {qtype}")
    return k // block * size


def _check_qtype(qtype: int) -> None:
    if qtype not in SUPPORTED_QTYPES:
        raise ValueError(f"qtype {qtype} is not supported (supported: {sorted(SUPPORTED_QTYPES)})")


def packed_nbytes(qtype: int, n: int, k: int) -> int:
    _check_qtype(qtype)
    if qtype == QTYPE_INT8_CHANNEL:
        return n * k + 4 * n
    return n * row_bytes(qtype, k)


def pack(raw: torch.Tensor, qtype: int, n: int, k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """raw: uint8 [N, row_bytes] GGUF blocks -> the same bytes, 1-D (into `out` when given)."""
    _check_qtype(qtype)
    if qtype == QTYPE_INT8_CHANNEL:
        raise ValueError("qtype QTYPE_INT8_CHANNEL is packed with pack_int8(q, scale)")
    if raw.dtype != torch.uint8 or raw.shape != (n, row_bytes(qtype, k)):
        raise ValueError(f"raw must be uint8 [{n}, {row_bytes(qtype, k)}], got {raw.dtype} {tuple(raw.shape)}")
    flat = raw.contiguous().view(-1)
    if out is None:
        return flat.clone()
    if out.dtype != torch.uint8 or out.numel() != flat.numel():
        raise ValueError(f"out must be uint8 of {flat.numel()} bytes, got {out.dtype} of {out.numel()}")
    return out.copy_(flat)


def pack_int8(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """q int8 [N, K], scale float32 [N] -> q's bytes then scale's bytes, 1-D."""
    if q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"q must be int8 [N, K], got {q.dtype} {tuple(q.shape)}")
    if q.shape[1] % INT8_BLOCK:
        raise ValueError(f"K={q.shape[1]} is not a multiple of {INT8_BLOCK} (int8 per channel)")
    if scale.dtype != torch.float32 or scale.shape != (q.shape[0],):
        raise ValueError(f"scale must be float32 [{q.shape[0]}], got {scale.dtype} {tuple(scale.shape)}")
    packed = torch.cat([q.contiguous().view(torch.uint8).view(-1), scale.contiguous().view(torch.uint8)])
    if out is None:
        return packed
    if out.dtype != torch.uint8 or out.numel() != packed.numel():
        raise ValueError(f"out must be uint8 of {packed.numel()} bytes, got {out.dtype} of {out.numel()}")
    return out.copy_(packed)


def _dequantize_rows(packed: torch.Tensor, qtype: int, n: int, k: int, ids: torch.Tensor | None) -> torch.Tensor:
    _check_qtype(qtype)
    if packed.dtype != torch.uint8 or packed.numel() != packed_nbytes(qtype, n, k):
        raise ValueError(f"packed must be uint8 of {packed_nbytes(qtype, n, k)} bytes, got {packed.dtype} of {packed.numel()}")
    if qtype == QTYPE_INT8_CHANNEL:
        q = packed[: n * k].view(torch.int8).view(n, k)
        scale = packed[n * k :].view(torch.float32)
        if ids is not None:
            q, scale = q[ids], scale[ids]
        return (scale[:, None] * q.float()).to(torch.bfloat16)
    from gguf import GGMLQuantizationType, dequantize

    raw = packed.view(n, row_bytes(qtype, k))
    if ids is not None:
        raw = raw[ids]
    values = dequantize(np.ascontiguousarray(raw.numpy()), GGMLQuantizationType(qtype))
    return torch.from_numpy(values).to(torch.bfloat16)


def dequantize(packed: torch.Tensor, qtype: int, n: int, k: int) -> torch.Tensor:
    """bf16 [N, K]: gguf's fp32 de-quantisation (fp32 scale * q for int8), rounded to bf16."""
    return _dequantize_rows(packed, qtype, n, k, None)


def rows(packed: torch.Tensor, qtype: int, ids: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """bf16 [T, K]: the de-quantised rows `ids` (a tied embedding's lookups)."""
    return _dequantize_rows(packed, qtype, n, k, ids.to(torch.int64))


@dataclass(frozen=True)
class ReferenceQuantKernels:
    """The compiled `QuantKernels`' fields, in torch (see the module's docstring for how close)."""

    pack: Callable[..., torch.Tensor]
    pack_int8: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    linear: Callable[..., torch.Tensor]
    rows: Callable[..., torch.Tensor]
    dequantize: Callable[..., torch.Tensor]
    packed_nbytes: Callable[[int, int, int], int]
    description: str = "torch reference (de-quantises the whole weight on every call)"


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled kernel's activation quantisation, per row in blocks of 32 values: dx = max|x| / 127
    (fp32), q = round-half-even(x * (127 / max|x|)) clamped to [-127, 127] (0 for an all-zero block).
    Returns (q int8 [M, K], dx float32 [M, K / 32])."""
    m, k = x.shape
    if k % INT8_BLOCK:
        raise ValueError(f"K={k} is not a multiple of {INT8_BLOCK}")
    xb = x.float().reshape(m, k // INT8_BLOCK, INT8_BLOCK)
    amax = xb.abs().amax(dim=-1)
    dx = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / torch.where(amax > 0, amax, torch.ones_like(amax)), torch.zeros_like(amax))
    q = torch.round(xb * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(m, k), dx


def reference_quant_kernels() -> ReferenceQuantKernels:
    """The reference: the kernel's activation quantisation, then fp32 products row by row."""

    def linear(x: torch.Tensor, packed: torch.Tensor, qtype: int, n: int, k: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
        w = dequantize(packed, qtype, n, k).float()
        q, dx = quantize_activations(x)
        xa = (q.float().reshape(x.shape[0], -1, INT8_BLOCK) * dx[..., None]).reshape(x.shape[0], k)
        out = torch.stack([torch.mv(w, row) for row in xa]) if x.shape[0] else xa.new_empty((0, n))
        if bias is not None:
            out = out + bias.float()
        return out.to(torch.bfloat16)

    return ReferenceQuantKernels(pack=pack, pack_int8=pack_int8, linear=linear, rows=rows,
                                 dequantize=dequantize, packed_nbytes=packed_nbytes)


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric weight-only int8 per output channel: scale[n] = max|w[n]| / 127 (fp32; 1 for an
    all-zero row), q = round-half-even(w / scale) in [-127, 127]."""
    wf = w.detach().float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale.contiguous()
