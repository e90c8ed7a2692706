"""Faster bf16 linear layers on the CPU, with a bounded set of oneDNN matmul shapes.

Three ways, picked by `LlamaFamilyForCausalLM.optimize_for_cpu` from what the CPU offers:

- **AMX tiles** (`AmxLinear`, Intel Sapphire Rapids and later): each weight packed once into the
  tile layout; one shape-free kernel for every row count. Over a 30-layer SmolLM2-sized weight set
  plus its lm_head (cold caches, Intel Xeon dev host), ms per forward of M rows, AMX vs our
  AVX512-BF16 kernel vs oneDNN (`F.linear`): M=1 13.6 / 12.2 / 27.0, M=8 13.8 / 17.8 / 27.2,
  M=32 14.8 / 53.7 / 29.9, M=128 33.1 / 190 / 49.0, M=1000 218 / - / 216 (BENCHMARKS.md).
- **Our AVX512-BF16 kernel** (`GemvLinear`, e.g. AMD Zen 4) over plain weights up to
  KERNEL_MAX_ROWS rows, oneDNN above. Measured on the AMD EPYC dev host of earlier sessions:
  M=8 23.4 vs 11.7 (oneDNN vs ours), M=32 38.2 vs 28.4, M=128 99.8 vs 89.0, M=1000 689 vs 726.
- **oneDNN-prepacked weights** (`PackedLinear`) when the kernels cannot be built.

With the kernels, all the weights sit in one arena advised for transparent huge pages
(`move_weights_to_arena`): streaming them took a TLB miss every 4 KiB.

Why the pieces: oneDNN builds (and caches, up to 1,024 entries) one primitive per distinct matmul
shape, a few hundred KiB each, and glibc then fragments around them. Under a serving workload
every step has a different row count, so a server's RSS grew by hundreds of MiB over minutes.
Rows above KERNEL_MAX_ROWS are therefore cut into power-of-two pieces (>= ONEDNN_MIN_ROWS) plus a
remainder for our kernel: at most ~6 shapes per weight, whatever the traffic. The AMX kernel has
no per-shape state at all.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from chatserve.kernels.cpu_gemv import MAX_GEMV_ROWS, AmxMatmul, CpuKernels

logger = logging.getLogger(__name__)

Gemv = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
KERNEL_MAX_ROWS = MAX_GEMV_ROWS  # our kernel handles any M; up to here it is faster than oneDNN
ONEDNN_MIN_ROWS = KERNEL_MAX_ROWS


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


class PackedLinear(nn.Module):
    """Drop-in for `nn.Linear` on 2-D inputs, holding a oneDNN-packed weight.

    Row counts are cut into power-of-two pieces so oneDNN sees at most ~log2(M) shapes."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        with torch.no_grad():
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)
        self.bias = None if bias is None else bias.detach().clone()

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        m = x.shape[0]
        if m & (m - 1) == 0:  # already a power of two (or empty)
            return self._run(x)
        return torch.cat([self._run(x[s : s + n]) for s, n in power_of_two_pieces(m, 1)])


def kernel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemv: Gemv) -> torch.Tensor:
    """x @ weight.T (+ bias): our kernel up to KERNEL_MAX_ROWS rows, oneDNN in power-of-two pieces above."""
    m = x.shape[0]
    if m <= KERNEL_MAX_ROWS:
        return gemv(x, weight, bias)
    x = x.contiguous()
    out = x.new_empty((m, weight.shape[0]))
    wt = weight.t()
    for start, rows in power_of_two_pieces(m, ONEDNN_MIN_ROWS):
        part = x[start : start + rows]
        if rows < ONEDNN_MIN_ROWS:
            out[start : start + rows] = gemv(part, weight, bias)
        elif bias is None:
            torch.mm(part, wt, out=out[start : start + rows])
        else:
            torch.addmm(bias, part, wt, out=out[start : start + rows])
    return out


class GemvLinear(nn.Module):
    """Drop-in for `nn.Linear` on 2-D inputs over plain weights: see `kernel_linear`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, gemv: Gemv,
                 out: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight = weight.detach().contiguous() if out is None else out.copy_(weight.detach())
        self.bias = None if bias is None else bias.detach().contiguous()
        self.gemv = gemv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernel_linear(x, self.weight, self.bias, self.gemv)


class AmxLinear(nn.Module):
    """Drop-in for `nn.Linear` on 2-D inputs over a weight packed into the AMX tile layout.

    Only the packed copy is kept. One kernel for every row count: a shape-free C++ loop, so
    nothing is cached per shape (unlike oneDNN, above)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, amx: AmxMatmul,
                 out: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        with torch.no_grad():
            self.packed_weight = amx.pack(weight.detach(), out=out)
        self.bias = None if bias is None else bias.detach().contiguous()
        self.amx = amx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.amx.linear(x, self.packed_weight, self.bias, self.out_features)


MakeLinear = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], nn.Module]  # weight, bias, arena view


def move_weights_to_arena(layers: nn.ModuleList, head_weight: torch.Tensor, kernels: CpuKernels,
                          shape_of: Callable[[int, int], tuple[int, ...]], make: MakeLinear) -> nn.Module:
    """Replace every `nn.Linear` in `layers` by `make(weight, bias, view)`, which stores the weight
    (as `shape_of(N, K)`, packed or plain) in `view`: one arena for all of them and the lm_head,
    2 MiB aligned and advised for transparent huge pages (see `huge_page_zeros` in
    csrc/amx_gemm.cpp for why). Returns the lm_head module. Each layer's plain weights go back to
    the OS once the layer is done, so the resident set peaks at one copy of the weights plus a layer."""
    sizes = [math.prod(shape_of(*m.weight.shape)) for m in layers.modules() if isinstance(m, nn.Linear)]
    head_shape = shape_of(*head_weight.shape)
    arena = kernels.huge_page_zeros(sum(sizes) + math.prod(head_shape))
    offset = 0

    def take(shape: tuple[int, ...]) -> torch.Tensor:
        nonlocal offset
        n = math.prod(shape)
        view = arena[offset : offset + n].view(shape)
        offset += n
        return view

    for layer in layers:
        replace_linears(layer, lambda lin: make(lin.weight, lin.bias, take(shape_of(*lin.weight.shape))))
        kernels.release_free_memory()
    return make(head_weight, None, take(head_shape))


class PackedEmbedding(nn.Module):
    """Token embedding that reads its rows from a tied lm_head's AMX-packed weight."""

    def __init__(self, head: AmxLinear) -> None:
        super().__init__()
        self.head = head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self.head
        return head.amx.rows(head.packed_weight, ids, head.out_features, head.in_features)


def replace_linears(module: nn.Module, make: Callable[[nn.Linear], nn.Module]) -> int:
    """Replace every `nn.Linear` below `module` by `make(linear)`; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, make(child))
            count += 1
        else:
            count += replace_linears(child, make)
    return count


def pack_linears(module: nn.Module) -> int:
    return replace_linears(module, lambda lin: PackedLinear(lin.weight, lin.bias))
