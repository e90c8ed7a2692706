"""A mixture-of-experts MLP: a router picks `top_k` of `num_experts` gated SiLU MLPs per token.

How a step runs (`FusedMoE.forward`): one router matmul over every row, softmax in float32 and
the top k (`route`); the (token, slot) pairs grouped by expert with one stable sort; then for each
expert that got rows, *one* call of each of its kernels over all of its rows (gate|up matmul,
silu*up, down matmul), written back to the pairs' places; last, each token's k outputs summed in
float32 in slot order (the router's rank), weighted by its routing weights.

Why it is batch-invariant (issue 20: a row's tokens must not depend on the other rows of the step):
every piece computes a row from that row alone in a fixed order. The experts' matmuls are the
model's own `LinearMethod` (the batch-invariant packed bf16 kernel, or GGUF / int8 blocks through
the quantized kernels), whose output row has the same bits whatever the row count, so it does not
matter how many other tokens share an expert, or which; gathers and scatters copy bits; the final
sum runs over a token's own slots, always in rank order, one rounding per slot. The router is a
`Linear` of the same method, and softmax / top-k work row by row.

Expert weights are ordinary `Linear`s (one gate|up and one down per expert), so every weight layout
the dense layers have (packed bf16, AMX tiles, GGUF blocks kept quantized, int8) serves experts with
no code of its own: llama.cpp's stacked ``ffn_*_exps`` tensors arrive one expert at a time
(models/gguf.py cuts them) and load like any projection.
"""

from __future__ import annotations

import torch
from torch import nn

from chatserve.kernels.cpu import CpuKernels
from chatserve.layers.activation import SiluAndMul
from chatserve.layers.linear import Linear, LinearMethod


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids int64 [T, k]) from router logits [T, E], best first.

    softmax over all experts in float32, then the k largest; with `renormalize` they are divided
    by their sum (Mixtral always; Qwen3-MoE / OLMoE where `norm_topk_prob`), which equals a softmax
    over the k chosen logits. What transformers computes for all three families.
    """
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class ExpertMLP(nn.Module):
    """One expert: down(silu(gate(x)) * up(x)), gate|up fused into one matmul (as the dense MLP)."""

    def __init__(self, hidden_size: int, intermediate_size: int, linear: LinearMethod, kernels: CpuKernels | None) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, False, linear)
        self.act = SiluAndMul(intermediate_size, kernels)
        self.down_proj = Linear(intermediate_size, hidden_size, False, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.act.forward(self.gate_up_proj.forward(x)))


class FusedMoE(nn.Module):
    """The routed MLP of a MoE layer: `gate` (the router, [num_experts, hidden]) and `experts`.

    Parameter names follow the HF checkpoints of Qwen3-MoE and OLMoE (``mlp.gate.weight``,
    ``mlp.experts.{e}.{gate,up,down}_proj.weight``); the model maps Mixtral's names onto them."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 linear: LinearMethod, kernels: CpuKernels | None) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.gate = Linear(hidden_size, num_experts, False, linear)
        self.experts = nn.ModuleList(ExpertMLP(hidden_size, intermediate_size, linear, kernels) for _ in range(num_experts))
        self._expert_forwards = tuple(e.forward for e in self.experts)  # bound once: the hot loop skips __call__

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t, k = x.shape[0], self.top_k
        weights, ids = route(self.gate.forward(x), k, self.renormalize)
        flat = ids.flatten()  # slot s = token * k + rank
        # stable: within an expert, slots stay in token order (any order would give the same bits)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // k
        out = x.new_empty((t * k, x.shape[1]))
        start = 0
        for expert_forward, n in zip(self._expert_forwards, counts):
            if n:
                rows = order[start : start + n]
                out.index_copy_(0, rows, expert_forward(x.index_select(0, tokens[start : start + n])))
                start += n
        out = out.view(t, k, -1)
        acc = out[:, 0].float() * weights[:, :1]
        for rank in range(1, k):  # a token's own slots, in rank order: one fixed chain per output element
            acc += out[:, rank].float() * weights[:, rank : rank + 1]
        return acc.to(x.dtype)


__all__ = ["ExpertMLP", "FusedMoE", "route"]
