"""Faster bf16 linear layers on the CPU, with a bounded set of oneDNN matmul shapes.

Each `Linear` gets its `LinearMethod` at construction (vLLM's quant-method pattern): the method
says how the loaded weight is stored (`process`) and how x @ W.T runs (`apply`). Picked once by
`select_linear_method` from what the CPU offers:

- **The batch-invariant matmul of the CPU's kernel tier** (`PackedGemmLinearMethod`, the default
  without AMX: AVX512-BF16 on e.g. AMD Zen 4/5, AVX512-VNNI, AVX2): weights packed once into the kernel's layout, one
  kernel for every row count, and each output element one fixed accumulation chain over K, so a
  row's result has the same bits alone, in a decode batch or as the last token of a 1,000-row
  prefill (issue #20: greedy output must not change with batch composition or the prefix cache).
  Hot in cache it runs at ~90% of the core's vdpbf16ps peak from M = 32 on, and streams the
  weights faster than the older kernel at decode sizes (BENCHMARKS.md, "Batch-invariant matmul").
- **AMX tiles** (`AmxLinearMethod`, Intel Sapphire Rapids and later): each weight packed once into the
  tile layout; one shape-free kernel for every row count, batch-invariant too (each output tile
  accumulates over K in the same order whatever M; the tile rows configured for M < 16 and the
  zero-padded copy of ragged rows change which rows share a tile, not a row's arithmetic). Over a 30-layer SmolLM2-sized weight set
  plus its lm_head (cold caches, Intel Xeon dev host), ms per forward of M rows, AMX vs our
  AVX512-BF16 kernel vs oneDNN (`F.linear`): M=1 13.6 / 12.2 / 27.0, M=8 13.8 / 17.8 / 27.2,
  M=32 14.8 / 53.7 / 29.9, M=128 33.1 / 190 / 49.0, M=1000 218 / - / 216 (BENCHMARKS.md).
- **oneDNN-prepacked weights** (`OneDNNPackedLinearMethod`) when the kernels cannot be built.
- **plain `F.linear`** (`TorchLinearMethod`) for float32, GPUs and anything else.

With the kernels, all the weights sit in one arena advised for transparent huge pages
(`WeightArena`): streaming them took a TLB miss every 4 KiB.

Why the pieces: oneDNN builds (and caches, up to 1,024 entries) one primitive per distinct matmul
shape, a few hundred KiB each, and glibc then fragments around them. Under a serving workload
every step has a different row count, so a server's RSS grew by hundreds of MiB over minutes.
The oneDNN fallback therefore cuts rows into power-of-two pieces: at most ~log2(M) shapes per weight,
whatever the traffic. The AMX kernel and the batch-invariant one have no per-shape state at all.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from chatserve.kernels.cpu import CpuKernels, PackedGemm

logger = logging.getLogger(__name__)

# What a method's `process` left on a layer besides its parameters: tensors and JSON values by key.
ProcessedState = dict[str, Any]


def power_of_two_pieces(m: int, smallest: int) -> Iterator[tuple[int, int]]:
    """(start, rows) pieces covering [0, m): powers of two >= `smallest`, largest first, then
    whatever remains (< `smallest`) as one last piece. E.g. m=1000, smallest=64 ->
    512, 256, 128, 64 and a remainder of 40."""
    start = 0
    size = 1 << max(m.bit_length() - 1, 0)
    while size >= smallest and start < m:
        if m - start >= size:
            yield start, size
            start += size
        size >>= 1
    if start < m:
        yield start, m - start


def packed_linear_available(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.randn(8, 16, dtype=dtype)
        x = torch.randn(2, 16, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        return bool(torch.allclose(out.float(), F.linear(x, w).float(), atol=1e-2))
    except Exception as exc:  # an unusual build: fall back to F.linear
        logger.info("oneDNN packed linear unavailable (%s); using F.linear", exc)
        return False


def onednn_pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T (+ bias) over a oneDNN-packed weight, rows cut into power-of-two pieces so oneDNN
    sees at most ~log2(M) shapes."""
    x = x.contiguous()
    m = x.shape[0]
    if m & (m - 1) == 0:  # already a power of two (or empty)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return torch.cat([torch.ops.mkldnn._linear_pointwise(x[s : s + n], packed, bias, "none", [], "")
                      for s, n in power_of_two_pieces(m, 1)])


class WeightArena:
    """One buffer for every weight of a model, 2 MiB aligned and advised for transparent huge pages
    (see `huge_page_zeros` in csrc/amx_gemm.cpp for why: streaming weights took a TLB miss every
    4 KiB). Each layer reserves its part at construction (shapes are known then); the buffer is
    allocated at the first `take`, after the weights are loaded."""

    def __init__(self, kernels: CpuKernels) -> None:
        self._kernels = kernels
        self._sizes: dict[int, int] = {}  # id(layer) -> offset
        self._numel = 0
        self._buffer: torch.Tensor | None = None

    def reserve(self, layer: nn.Module, numel: int) -> None:
        if self._buffer is not None:
            raise RuntimeError("the weight arena is allocated already; reserve before loading")
        self._sizes[id(layer)] = self._numel
        self._numel += numel

    def take(self, layer: nn.Module, shape: tuple[int, ...]) -> torch.Tensor:
        if self._buffer is None:
            self._buffer = self._kernels.huge_page_zeros(self._numel)
        start = self._sizes.pop(id(layer))
        return self._buffer[start : start + math.prod(shape)].view(shape)


class LinearMethod(ABC):
    """How a `Linear` stores its weight and computes x @ W.T (+ bias)."""

    description: str
    # a row's result the same bits whatever the row count of the call and the thread split
    batch_invariant: bool = False

    def reserve(self, layer: Linear) -> None:  # noqa: B027 - most methods need no space
        """Called at construction, when the weight's shape is known (and nothing is allocated)."""

    def process(self, layer: Linear) -> None:  # noqa: B027 - F.linear keeps the loaded weight
        """Called once after the weights are loaded: repack or move `layer.weight` as needed."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor: ...

    def tied_embedding(self, head: Linear, embedding: nn.Embedding) -> nn.Module:
        """The token embedding of a model whose lm_head is `head` with tied weights (processed)."""
        return embedding

    def processed_state(self, layer: Linear) -> ProcessedState | None:
        """What `process` left on `layer` besides its parameters (which the weight cache saves by
        name), for models/weight_cache.py: tensors and JSON values by key; None where this method's
        layout cannot be written to a file (oneDNN's opaque packed tensors)."""
        return {}

    def restore_processed(self, layer: Linear, state: ProcessedState) -> None:  # noqa: B027
        """Put back what `processed_state` returned, its tensors now views of the cache file's
        mapping; the layer's parameters are restored by the cache before this call."""


class TorchLinearMethod(LinearMethod):
    description = "torch F.linear"

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


class OneDNNPackedLinearMethod(LinearMethod):
    """oneDNN-prepacked weights (only the packed copy is kept; a tied embedding keeps its own)."""

    description = "oneDNN prepacked"

    def process(self, layer: Linear) -> None:
        with torch.no_grad():
            layer.packed_weight = onednn_pack(layer.weight)
        del layer.weight

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, layer.packed_weight, layer.bias)

    def processed_state(self, layer: Linear) -> None:
        return None  # a mkldnn tensor: its layout is oneDNN's own, not bytes we can map back


class PackedGemmLinearMethod(LinearMethod):
    """Weights packed once into the batch-invariant kernel's layout, in the arena (the plain copy
    dropped); one kernel for every row count, nothing cached per shape, and a row's result the same
    bits whatever else is in the call. A tied embedding reads its rows back from the packed copy."""

    batch_invariant = True

    def __init__(self, kernels: CpuKernels, arena: WeightArena) -> None:
        assert kernels.gemm is not None
        self.gemm: PackedGemm = kernels.gemm
        self.arena = arena
        self.description = f"batch-invariant {kernels.tier} matmul over packed weights (one huge-page arena)"

    def reserve(self, layer: Linear) -> None:
        self.arena.reserve(layer, math.prod(self.gemm.packed_shape(layer.out_features, layer.in_features)))

    def process(self, layer: Linear) -> None:
        view = self.arena.take(layer, self.gemm.packed_shape(layer.out_features, layer.in_features))
        with torch.no_grad():
            layer.packed_weight = self.gemm.pack(layer.weight.detach(), out=view)
        del layer.weight

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.stride(-1) != 1:  # the kernel reads rows of unit stride (row-strided views in place)
            x = x.contiguous()
        return self.gemm.linear(x, layer.packed_weight, layer.bias, layer.out_features)

    def processed_state(self, layer: Linear) -> ProcessedState:
        return {"packed_weight": layer.packed_weight}

    def restore_processed(self, layer: Linear, state: ProcessedState) -> None:
        layer._parameters.pop("weight", None)  # a fresh model's unfilled weight: `process` drops it too
        layer.packed_weight = state["packed_weight"]

    def tied_embedding(self, head: Linear, embedding: nn.Embedding) -> nn.Module:
        return PackedEmbedding(head, self.gemm.rows)


class AmxLinearMethod(LinearMethod):
    """Weights packed once into the AMX tile layout, in the arena; one shape-free kernel for every
    row count, so nothing is cached per shape (unlike oneDNN)."""

    description = "AMX tiles over packed weights (one huge-page arena)"
    batch_invariant = True

    def __init__(self, kernels: CpuKernels, arena: WeightArena) -> None:
        assert kernels.amx is not None
        self.amx = kernels.amx
        self.arena = arena

    def reserve(self, layer: Linear) -> None:
        self.arena.reserve(layer, math.prod(self.amx.packed_shape(layer.out_features, layer.in_features)))

    def process(self, layer: Linear) -> None:
        view = self.arena.take(layer, self.amx.packed_shape(layer.out_features, layer.in_features))
        with torch.no_grad():
            layer.packed_weight = self.amx.pack(layer.weight.detach(), out=view)
        del layer.weight

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.amx.linear(x, layer.packed_weight, layer.bias, layer.out_features)

    def processed_state(self, layer: Linear) -> ProcessedState:
        return {"packed_weight": layer.packed_weight}

    def restore_processed(self, layer: Linear, state: ProcessedState) -> None:
        layer._parameters.pop("weight", None)  # a fresh model's unfilled weight: `process` drops it too
        layer.packed_weight = state["packed_weight"]

    def tied_embedding(self, head: Linear, embedding: nn.Embedding) -> nn.Module:
        return PackedEmbedding(head, self.amx.rows)


class Linear(nn.Module):
    """y = x @ W.T (+ b) on 2-D inputs; `method` (fixed at construction) says how.

    The weight loads into `weight` as for `nn.Linear`; `process_weights()` then hands it to the
    method, which may repack it and drop the plain copy."""

    def __init__(self, in_features: int, out_features: int, bias: bool, method: LinearMethod) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.method = method
        method.reserve(self)

    def process_weights(self) -> None:
        if self.bias is not None:
            self.bias = nn.Parameter(self.bias.detach().contiguous(), requires_grad=False)
        self.method.process(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


PackedRows = Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]  # packed, ids, N, K -> rows [T, K]


class PackedEmbedding(nn.Module):
    """Token embedding that reads its rows, bit for bit, from a tied lm_head's packed weight (AMX
    tiles or the batch-invariant kernel's layout): one copy of the table in all."""

    def __init__(self, head: Linear, rows: PackedRows) -> None:
        super().__init__()
        self.head = head
        self.rows = rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self.head
        return self.rows(head.packed_weight, ids, head.out_features, head.in_features)


def select_linear_method(dtype: torch.dtype, device: torch.device, kernels: CpuKernels | None) -> LinearMethod:
    """The fastest bf16 matmul this CPU offers, with one copy of each weight: AMX tiles, else the
    batch-invariant kernel of the CPU's tier (AVX512-BF16, AVX512-VNNI or AVX2), else oneDNN-packed
    weights; plain F.linear for other dtypes and devices."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return TorchLinearMethod()
    if kernels is not None:
        arena = WeightArena(kernels)
        if kernels.amx is not None:
            return AmxLinearMethod(kernels, arena)
        if kernels.gemm is not None:
            return PackedGemmLinearMethod(kernels, arena)
    if packed_linear_available(dtype, device):
        return OneDNNPackedLinearMethod()
    return TorchLinearMethod()
