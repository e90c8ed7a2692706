"""Linear layers whose weights stay quantized: GGUF blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) kept from
the file, or int8 per output channel quantised at load (`quantization="int8"`).

Why: decoding one stream reads every weight once per token, so its speed is the bytes of the
weights; the default model's Q4_1 file is ~0.6 byte a weight against bf16's 2 (issue #21). The
compiled kernels (kernels/cpu_quant.py) de-quantise each weight in registers to exactly the bf16
value the de-quantising path would hold and accumulate in that path's order, so a quantized layer
gives the bits of `quantization="none"` (and stays batch-invariant): same greedy tokens, less memory.

A layer is a list of row segments: the loader hands each GGUF tensor over as a `QuantizedTensor`
at its row offset in the fused matrix (q|k|v, gate|up); adjacent segments of one type are packed
together (one kernel call), and a fused layer of mixed types (Q4_K_M files store attn_v in Q6_K
beside Q4_K q/k) runs one kernel call per segment, each writing its columns. Rows that arrived
de-quantised (types the kernels lack, F16/F32 tensors) are a bf16 segment on the bf16 matmul.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from chatserve.config import QUANTIZATION_CHOICES
from chatserve.kernels.cpu_gemv import CpuKernels, PackedGemm
from chatserve.kernels.quant_reference import (
    INT8_BLOCK,
    QTYPE_INT8_CHANNEL,
    SUPPORTED_QTYPES,
    quantize_int8_per_channel,
    reference_quant_kernels,
)
from chatserve.layers.linear import Linear, LinearMethod

logger = logging.getLogger(__name__)



@dataclass(frozen=True)
class QuantizedTensor:
    """One GGUF tensor's blocks, rows in the model's (HF) order: uint8 [n, row_bytes]."""

    raw: torch.Tensor
    qtype: int
    n: int
    k: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    def dequantize(self) -> torch.Tensor:
        """bf16 [n, k], the values the de-quantising loader yields (gguf's fp32, then bf16)."""
        import numpy as np
        from gguf import GGMLQuantizationType, dequantize

        return torch.from_numpy(dequantize(np.ascontiguousarray(self.raw.numpy()), GGMLQuantizationType(self.qtype))).to(torch.bfloat16)


@dataclass(frozen=True)
class Segment:
    """Rows [start, start + n) of a layer's weight: packed blocks of `qtype`, or bf16 when qtype is None."""

    start: int
    n: int
    qtype: int | None
    packed: torch.Tensor


class QuantizedLinearMethod(LinearMethod):
    """x @ W.T over row segments of quantized (or, where the file had no supported type, bf16) weights.

    `quant` is the compiled `QuantKernels` or the torch reference (same fields); `gemm` the
    batch-invariant bf16 matmul for bf16 segments (F.linear where None). With `int8`, every
    de-quantised weight is quantised to int8 per output channel at `process`."""

    def __init__(self, quant: Any, gemm: PackedGemm | None, int8: bool = False) -> None:
        self.quant = quant
        self.gemm = gemm
        self.int8 = int8
        kind = "int8 per channel" if int8 else "GGUF blocks (Q4_0/Q4_1/Q8_0/Q4_K/Q6_K)"
        self.description = f"quantized {kind}: {getattr(quant, 'description', 'avx512-bf16 kernels')}"

    def load_quantized(self, layer: Linear, row_start: int, tensor: QuantizedTensor) -> None:
        """Called by the model's `load_weights` for each GGUF tensor kept quantized."""
        if tensor.k != layer.in_features or not 0 <= row_start <= layer.out_features - tensor.n:
            raise ValueError(f"quantized weight of shape {tensor.shape} does not fit rows {row_start}.. of a "
                             f"[{layer.out_features}, {layer.in_features}] layer")
        parts = layer.__dict__.setdefault("quant_parts", [])
        parts.append((row_start, tensor))

    def process(self, layer: Linear) -> None:
        parts = sorted(layer.__dict__.pop("quant_parts", []), key=lambda p: p[0])
        runs: list[tuple[int, int, list[QuantizedTensor]]] = []  # start, qtype, tensors
        for start, t in parts:
            if runs and runs[-1][1] == t.qtype and runs[-1][0] + sum(x.n for x in runs[-1][2]) == start:
                runs[-1][2].append(t)
            else:
                runs.append((start, t.qtype, [t]))
        segments: list[Segment] = []
        row = 0
        with torch.no_grad():
            for start, qtype, tensors in runs:
                if start > row:
                    segments.append(self._dense(layer, row, start))
                n = sum(t.n for t in tensors)
                raw = tensors[0].raw if len(tensors) == 1 else torch.cat([t.raw for t in tensors])
                segments.append(Segment(start, n, qtype, self.quant.pack(raw, qtype, n, layer.in_features)))
                row = start + n
            if row < layer.out_features:
                segments.append(self._dense(layer, row, layer.out_features))
        layer.quant_segments = segments
        del layer.weight

    def _dense(self, layer: Linear, start: int, stop: int) -> Segment:
        w = layer.weight.detach()[start:stop]
        if self.int8 and layer.in_features % INT8_BLOCK == 0:  # else this layer stays bf16
            q, scale = quantize_int8_per_channel(w)
            return Segment(start, stop - start, QTYPE_INT8_CHANNEL, self.quant.pack_int8(q, scale))
        packed = self.gemm.pack(w.contiguous()) if self.gemm is not None else w.contiguous().clone()
        return Segment(start, stop - start, None, packed)

    def _run(self, seg: Segment, x: torch.Tensor, k: int, bias: torch.Tensor | None) -> torch.Tensor:
        if seg.qtype is not None:
            return self.quant.linear(x, seg.packed, seg.qtype, seg.n, k, bias)
        if self.gemm is not None:
            return self.gemm.linear(x, seg.packed, bias, seg.n)
        return F.linear(x, seg.packed, bias)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) != 1:  # the kernels read rows of unit stride (row-strided views in place)
            x = x.contiguous()
        segments: list[Segment] = layer.quant_segments
        k, bias = layer.in_features, layer.bias
        if len(segments) == 1:
            return self._run(segments[0], x, k, bias)
        return torch.cat([self._run(s, x, k, None if bias is None else bias[s.start : s.start + s.n]) for s in segments], dim=1)

    def tied_embedding(self, head: Linear, embedding: nn.Embedding) -> nn.Module:
        (seg,) = head.quant_segments  # an lm_head is one tensor: one segment
        if seg.qtype is not None:
            quant = self.quant
            return SegmentEmbedding(head, lambda ids: quant.rows(seg.packed, seg.qtype, ids, seg.n, head.in_features))
        if self.gemm is not None:
            gemm = self.gemm
            return SegmentEmbedding(head, lambda ids: gemm.rows(seg.packed, ids, seg.n, head.in_features))
        return SegmentEmbedding(head, lambda ids: F.embedding(ids, seg.packed))


class SegmentEmbedding(nn.Module):
    """Token embedding read from a tied lm_head's own (quantized or packed) copy: one table in all."""

    def __init__(self, head: Linear, rows: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.head = head
        self.rows = rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids)


def weight_nbytes(layer: Linear) -> int:
    """Bytes this layer's weight occupies after `process` (packed, quantized or plain)."""
    if hasattr(layer, "quant_segments"):
        return sum(s.packed.numel() * s.packed.element_size() for s in layer.quant_segments)
    w = getattr(layer, "packed_weight", None)
    if w is None:
        w = layer.weight
    return w.numel() * w.element_size()


def model_weight_nbytes(model: nn.Module) -> int:
    """Bytes of a processed model's weights: every Linear's (packed, quantized or plain), plus the
    other parameters (embedding table unless it reads the lm_head's copy, norms, biases), each once."""
    total = 0
    counted: set[int] = set()
    for module in model.modules():
        if isinstance(module, Linear):
            total += weight_nbytes(module)
            w = module.__dict__.get("_parameters", {}).get("weight")
            if w is not None:
                counted.add(id(w))
    for p in model.parameters():
        if id(p) not in counted:
            counted.add(id(p))
            total += p.numel() * p.element_size()
    return total


# ---------------------------------------------------------------- choosing the mode and the kernels

@functools.cache
def load_compiled_quant_kernels() -> Any | None:
    """The compiled quantized kernels (kernels/cpu_quant.py), or None where the module, the CPU
    (AVX512-BF16) or the build is missing."""
    try:
        from chatserve.kernels.cpu_quant import load_quant_kernels
    except ImportError:
        return None
    return load_quant_kernels()


@dataclass(frozen=True)
class QuantizationChoice:
    mode: Literal["none", "gguf", "int8"]
    method: QuantizedLinearMethod | None  # None: the bf16 method (select_linear_method)
    keep_qtypes: frozenset[int]  # GGUF tensor types the loader hands over undecoded


NO_QUANTIZATION = QuantizationChoice("none", None, frozenset())


def select_quantization(requested: str, *, is_gguf: bool, dtype: torch.dtype, device: torch.device,
                        kernels: CpuKernels | None) -> QuantizationChoice:
    """What `quantization` means for this model on this machine.

    auto: a GGUF file keeps its blocks where the compiled kernels run (a CPU with AVX512-BF16, dtype
    bfloat16), else it is de-quantised as before, with one log line saying why; a safetensors folder
    stays bf16. none: de-quantise. gguf / int8: asked for explicitly, so a model or machine that
    cannot honour them is an error naming the field; where only the compiled kernels are missing the
    torch reference runs instead (correct, slow), with a warning.
    """
    if requested not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}; got {requested!r}")
    if requested == "none" or (requested == "auto" and not is_gguf):
        return NO_QUANTIZATION
    if requested == "gguf" and not is_gguf:
        raise ValueError("quantization='gguf' keeps a GGUF file's quantized blocks, but the model is a Hugging Face "
                         "folder; use quantization='int8' to quantise its weights at load, or 'none'")
    unfit = None
    if device.type != "cpu":
        unfit = f"the {device.type} path has no quantized kernels (weights are de-quantised at load)"
    elif dtype != torch.bfloat16:
        unfit = f"the quantized kernels compute in bfloat16 and dtype is {str(dtype).removeprefix('torch.')}"
    if unfit is not None:
        if requested == "auto":
            logger.info("GGUF weights de-quantised at load: %s", unfit)
            return NO_QUANTIZATION
        raise ValueError(f"quantization={requested!r} is not available here: {unfit}; use quantization='none'")
    quant = load_compiled_quant_kernels()
    if quant is None:
        if requested == "auto":
            logger.info("GGUF weights de-quantised at load: the quantized kernels need a CPU with AVX512-BF16 "
                        "and a C++ compiler (pass quantization='gguf' to run the slow torch reference anyway)")
            return NO_QUANTIZATION
        logger.warning("quantization=%r: the compiled quantized kernels are unavailable; running the torch reference, "
                       "which de-quantises every weight on every call (slow)", requested)
        quant = reference_quant_kernels(kernels.gemm if kernels is not None else None)
    gemm = kernels.gemm if kernels is not None else None
    if requested == "int8":
        return QuantizationChoice("int8", QuantizedLinearMethod(quant, gemm, int8=True), frozenset())
    keep = frozenset(q for q in SUPPORTED_QTYPES if q != QTYPE_INT8_CHANNEL)
    return QuantizationChoice("gguf", QuantizedLinearMethod(quant, gemm), keep)
