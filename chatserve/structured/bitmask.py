"""The batched token bitmask: fill one row per constrained sequence, mask those rows of the logits.

xgrammar packs the allowed-next-token set of each row into ``ceil(V / 32)`` int32 words (bit
``t % 32`` of word ``t // 32`` is token t, 1 = allowed). The matchers fill their rows in C++; the
mask is applied with xgrammar's CPU kernel for float32 CPU logits, and with the torch expansion
below everywhere else (CUDA, other dtypes), which needs no kernel build.

Unconstrained rows are never written: the function works on a copy only when some row is
constrained and touches only those rows, so they stay bit-identical to an unconstrained batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

# NOTE: xgrammar is imported where used: it (its C++ library, tvm_ffi, tiktoken) is ~20 MiB of
# resident memory that an engine serving no grammar never needs.

_BITS = 32


class BitmaskFiller(Protocol):
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...


def expand_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[R, W]`` int32 packed bits -> ``[R, vocab_size]`` bool (True = allowed); ids past ``W * 32`` are disallowed."""
    shifts = torch.arange(_BITS, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros((allowed.shape[0], vocab_size - allowed.shape[1]), dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """In place: ``logits[r, t] = -inf`` wherever bit t of ``bitmask[r]`` is 0, for r in rows."""
    index = torch.tensor(list(rows), dtype=torch.long, device=logits.device)
    allowed = expand_bitmask(bitmask.to(logits.device)[index], logits.shape[1])
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def apply_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """xgrammar's CPU kernel where it applies (float32, CPU, contiguous rows), the torch expansion elsewhere."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=list(rows))
    else:
        apply_bitmask_torch(logits, bitmask, rows)


def fill_and_apply_bitmask_(logits: torch.Tensor, matchers: Sequence[BitmaskFiller | None]) -> list[int]:
    """In place: mask every constrained row of ``logits`` (``matchers[i]`` None: row i untouched).

    Returns the constrained rows. For callers that own the tensor (the sampler, on logits it made or
    was told it may overwrite): a ``[B, V]`` copy costs more than the mask itself on a CPU.
    """
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return rows
    import xgrammar as xgr

    # NOTE: one row per batch row (indices address rows of both tensors); unconstrained rows stay all-ones.
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    for i in rows:
        matcher = matchers[i]
        assert matcher is not None
        matcher.fill_bitmask(bitmask, i)
    apply_bitmask_inplace(logits, bitmask, rows)
    return rows


def apply_grammar_bitmask(logits: torch.Tensor, matchers: Sequence[BitmaskFiller | None]) -> torch.Tensor:
    """The logits with every constrained row's disallowed tokens at -inf (``matchers[i]`` None: row i untouched).

    Returns ``logits`` itself when no row is constrained, else a masked copy; the caller's tensor
    is never modified.
    """
    if all(m is None for m in matchers):
        return logits
    out = logits.clone()
    fill_and_apply_bitmask_(out, matchers)
    return out
