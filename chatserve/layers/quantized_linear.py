"""Linear layers whose weights stay quantized: GGUF blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) kept from
the file, or int8 per output channel quantised at load (`quantization="int8"`).

Why: decoding one stream reads every weight once per token, so its speed is the bytes of the
weights; the default model's Q4_1 file is ~0.6 byte a weight against bf16's 2 (issue #21). The
compiled kernels (kernels/cpu_quant.py) multiply the blocks' integer quants by each row of x
quantised to int8 in blocks of 32 (AVX512-VNNI) and apply the blocks' scales in fp32: the weights are
exactly gguf's, the activations' rounding is the one approximation, and every row's result is the
same whatever the batch (batch-invariant, as the bf16 path). Greedy output stays close to
`quantization="none"` (tests/models/test_quantized_model.py states how close), at a third of the bytes.

A layer is a list of row segments: the loader hands each GGUF tensor over as a `QuantizedTensor`
at its row offset in the fused matrix (q|k|v, gate|up); adjacent segments of one type are packed
together (one kernel call), and a fused layer of mixed types (Q4_K_M files store attn_v in Q6_K
beside Q4_K q/k) runs one kernel call per segment, each writing its columns. Rows that arrived
de-quantised (types the kernels lack, F16/F32 tensors) are a bf16 segment on the bf16 matmul.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from chatserve.config import QUANTIZATION_CHOICES
from chatserve.kernels.cpu import CpuKernels, PackedGemm
from chatserve.kernels.quant_reference import (
    INT8_BLOCK,
    QTYPE_INT8_CHANNEL,
    SUPPORTED_QTYPES,
    quantize_int8_per_channel,
    reference_quant_kernels,
)
from chatserve.layers.linear import Linear, LinearMethod, ProcessedState

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

    def __init__(self, quant: Any, gemm: PackedGemm | None, int8: bool = False,
                 kernels: CpuKernels | None = None) -> None:
        self.quant = quant
        self.gemm = gemm
        self.int8 = int8
        self.kernels = kernels  # for the huge-page arena (None: each packed weight its own allocation)
        # the compiled kernels of a tier and the batch-invariant matmul for bf16 rows (the torch reference and
        # F.linear split their sums by the thread count)
        self.batch_invariant = getattr(quant, "tier", None) is not None and gemm is not None
        kind = "int8 per channel" if int8 else "GGUF blocks (Q4_0/Q4_1/Q8_0/Q4_K/Q6_K)"
        arena = "; one huge-page arena" if kernels is not None else ""
        self.description = f"quantized {kind}: {getattr(quant, 'description', 'avx512-vnni kernels, int8 activations')}{arena}"

    def load_quantized(self, layer: Linear, row_start: int, tensor: QuantizedTensor) -> None:
        """Called by the model's `load_weights` for each GGUF tensor kept quantized."""
        if tensor.k != layer.in_features or not 0 <= row_start <= layer.out_features - tensor.n:
            raise ValueError(f"quantized weight of shape {tensor.shape} does not fit rows {row_start}.. of a "
                             f"[{layer.out_features}, {layer.in_features}] layer")
        parts = layer.__dict__.setdefault("quant_parts", [])
        parts.append((row_start, tensor))

    def _layout(self, layer: Linear) -> list[tuple[int, int, int | None, list[QuantizedTensor] | None]]:
        """(start, rows, qtype or None for bf16, the GGUF tensors or None for rows of the plain weight)
        for each segment: runs of one type packed together, the rows between them from `weight`."""
        parts = sorted(layer.__dict__.get("quant_parts", []), key=lambda p: p[0])
        k = layer.in_features
        dense_type = QTYPE_INT8_CHANNEL if self.int8 and k % INT8_BLOCK == 0 else None  # else such a layer stays bf16
        layout: list[tuple[int, int, int | None, list[QuantizedTensor] | None]] = []
        row = 0
        for start, t in parts:
            if start > row:
                layout.append((row, start - row, dense_type, None))
            last = layout[-1] if layout else None
            if last is not None and last[3] is not None and last[2] == t.qtype and last[0] + last[1] == start:
                layout[-1] = (last[0], last[1] + t.n, t.qtype, [*last[3], t])
            else:
                layout.append((start, t.n, t.qtype, [t]))
            row = start + t.n
        if row < layer.out_features:
            layout.append((row, layer.out_features - row, dense_type, None))
        return layout

    def _nbytes(self, qtype: int | None, n: int, k: int) -> int:
        if qtype is not None:
            return self.quant.packed_nbytes(qtype, n, k)
        assert self.gemm is not None
        return math.prod(self.gemm.packed_shape(n, k)) * 2

    def plan(self, layers: list[Linear]) -> None:
        """Before any `process`: place every layer's packed segments in one buffer advised for
        transparent huge pages (a decode step streams all of them; 4 KiB pages cost a TLB miss each),
        64-byte aligned. Only with the C++ kernels (which allocate it) and the bf16 matmul for bf16 rows."""
        if self.kernels is None or self.gemm is None:
            return
        offsets: list[tuple[Linear, list[int]]] = []
        total = 0
        for layer in layers:
            starts = []
            for _, n, qtype, _ in self._layout(layer):
                starts.append(total)
                total += -(-self._nbytes(qtype, n, layer.in_features) // 64) * 64
            offsets.append((layer, starts))
        buffer = self.kernels.huge_page_zeros((total + 1) // 2).view(torch.uint8)
        for layer, starts in offsets:
            layer.__dict__["arena_offsets"] = (buffer, starts)

    def process(self, layer: Linear) -> None:
        k = layer.in_features
        arena = layer.__dict__.pop("arena_offsets", None)
        segments: list[Segment] = []
        with torch.no_grad():
            for i, (start, n, qtype, tensors) in enumerate(self._layout(layer)):
                out = None
                if arena is not None:
                    out = arena[0][arena[1][i] : arena[1][i] + self._nbytes(qtype, n, k)]
                if tensors is not None:
                    raw = tensors[0].raw if len(tensors) == 1 else torch.cat([t.raw for t in tensors])
                    packed = self.quant.pack(raw, qtype, n, k, out=out)
                elif qtype is not None:
                    q, scale = quantize_int8_per_channel(layer.weight.detach()[start : start + n])
                    packed = self.quant.pack_int8(q, scale, out=out)
                else:
                    w = layer.weight.detach()[start : start + n].contiguous()
                    if self.gemm is None:
                        packed = w.clone()
                    else:
                        view = None if out is None else out.view(torch.bfloat16).view(self.gemm.packed_shape(n, k))
                        packed = self.gemm.pack(w, out=view) if view is not None else self.gemm.pack(w)
                segments.append(Segment(start, n, qtype, packed))
        layer.__dict__.pop("quant_parts", None)
        layer.quant_segments = segments
        del layer.weight

    def processed_state(self, layer: Linear) -> ProcessedState:
        segments: list[Segment] = layer.quant_segments
        state: ProcessedState = {"segments": [[s.start, s.n, s.qtype] for s in segments]}
        state.update((f"segment{i}", s.packed) for i, s in enumerate(segments))
        return state

    def restore_processed(self, layer: Linear, state: ProcessedState) -> None:
        layer._parameters.pop("weight", None)  # a fresh model's unfilled weight: `process` drops it too
        layer.__dict__.pop("quant_parts", None)
        layer.quant_segments = [Segment(int(start), int(n), None if qtype is None else int(qtype), state[f"segment{i}"])
                                for i, (start, n, qtype) in enumerate(state["segments"])]

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
def load_compiled_quant_kernels(tier: str = "auto", build_dir: Path | None = None) -> Any | None:
    """The compiled quantized kernels of `tier` (kernels/cpu_quant.py; built under `build_dir`, the bf16
    kernels' folder), or None where the module, the CPU (a kernel tier: AVX2 or better) or the build is missing."""
    try:
        from chatserve.kernels.cpu_quant import load_quant_kernels
    except ImportError:
        return None
    return load_quant_kernels(tier, build_dir)


@dataclass(frozen=True)
class QuantizationChoice:
    mode: Literal["none", "gguf", "int8"]
    method: QuantizedLinearMethod | None  # None: the bf16 method (select_linear_method)
    keep_qtypes: frozenset[int]  # GGUF tensor types the loader hands over undecoded


NO_QUANTIZATION = QuantizationChoice("none", None, frozenset())


def select_quantization(requested: str, *, is_gguf: bool, dtype: torch.dtype, device: torch.device,
                        kernels: CpuKernels | None) -> QuantizationChoice:
    """What `quantization` means for this model on this machine.

    auto: a GGUF file keeps its blocks where the compiled kernels run (a CPU with a kernel tier, AVX2 or
    better, dtype bfloat16), else it is de-quantised as before, with one log line saying why; a safetensors folder
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
    quant = load_compiled_quant_kernels(kernels.tier, kernels.build_dir) if kernels is not None else None
    if quant is None and kernels is None and requested == "auto":
        logger.info("GGUF weights de-quantised at load: the C++ CPU kernels are off (cpu_kernels=False) or unavailable")
        return NO_QUANTIZATION
    if quant is None:
        if requested == "auto":
            logger.info("GGUF weights de-quantised at load: the quantized kernels need a CPU with AVX2 or better "
                        "and a C++ compiler (pass quantization='gguf' to run the slow torch reference anyway)")
            return NO_QUANTIZATION
        logger.warning("quantization=%r: the compiled quantized kernels are unavailable; running the torch reference, "
                       "which de-quantises every weight on every call (slow)", requested)
        quant = reference_quant_kernels()
    gemm = kernels.gemm if kernels is not None else None
    if requested == "int8":
        return QuantizationChoice("int8", QuantizedLinearMethod(quant, gemm, int8=True, kernels=kernels), frozenset())
    keep = frozenset(q for q in SUPPORTED_QTYPES if q != QTYPE_INT8_CHANNEL)
    return QuantizationChoice("gguf", QuantizedLinearMethod(quant, gemm, kernels=kernels), keep)
