"""The Triton paged-attention backend (the CUDA path; on the CPU only under Triton's interpreter).

The kernels read K/V through each sequence's block table, so the metadata is just the tables,
lengths and offsets: no cascade groups, no padding masks.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from dataclasses import dataclass

import torch

from chatserve.attention.base import AttentionBackend, BatchLayout, pad_tables

logger = logging.getLogger(__name__)

_MODULE = "chatserve.kernels.triton_attention"


@dataclass
class TritonAttentionMetadata:
    num_decodes: int
    num_extends: int
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks]
    decode_context_lens: torch.Tensor | None = None  # [B]
    decode_max_len: int = 0
    extend_block_tables: torch.Tensor | None = None  # [E, max_blocks]
    extend_query_start_loc: torch.Tensor | None = None  # [E + 1]
    extend_seq_lens: torch.Tensor | None = None  # [E] prefix + new tokens
    extend_max_query_len: int = 0  # sizes the grid without a device sync


def load_triton_kernels(device: torch.device, interpret: bool):
    """The Triton kernel module, compiled for CUDA (`interpret` False) or run by Triton's interpreter
    on CPU tensors (`interpret` True: the only way Triton runs on the CPU).

    NOTE: the one environment write below the CLI, and a deliberate edge. Triton decides at
    decoration time (when the module is first imported) whether its kernels compile or run in the
    interpreter, and it reads that only from $TRITON_INTERPRET. The decision is ours, made from the
    worker's configuration (`TritonAttentionBackend`: interpret exactly when the worker's device is
    the CPU), and we write it into the environment just before that first import, so users choose
    with `attention_backend` and `device` alone. A module already imported the other way cannot be
    switched, and that is refused.
    """
    if importlib.util.find_spec("triton") is None:
        raise ValueError("attention_backend='triton' needs the triton package: pip install triton (Linux), "
                         "or use attention_backend='torch'")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"attention_backend='triton' runs on CUDA devices (or the CPU interpreter), not {device.type!r}")
    if interpret != (device.type == "cpu"):
        raise ValueError(f"Triton on {device.type} runs {'interpreted' if device.type == 'cpu' else 'compiled'}; "
                         f"got interpret={interpret}")
    if interpret and _MODULE not in sys.modules:
        logger.info("attention_backend='triton' on the CPU: Triton's interpreter (slow; meant for tests)")
        os.environ["TRITON_INTERPRET"] = "1"  # read by Triton at the import below, and only there
    import chatserve.kernels.triton_attention as tk

    if interpret and not tk.is_interpreted():
        raise ValueError(
            "attention_backend='triton' on the CPU needs Triton's interpreter, but the Triton kernels were "
            "already compiled for CUDA in this process; use attention_backend='torch' here"
        )
    if not interpret and tk.is_interpreted():
        raise ValueError("the Triton kernels were built for the interpreter (TRITON_INTERPRET=1) in this process; "
                         "unset it to run them on CUDA")
    return tk


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, device: torch.device) -> None:
        # interpreted exactly on the CPU (the worker's device): Triton compiles only for GPUs
        self.interpret = device.type == "cpu"
        self.kernels = load_triton_kernels(device, interpret=self.interpret)

    def prepare(self, layout: BatchLayout, device: torch.device) -> TritonAttentionMetadata:
        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        meta = TritonAttentionMetadata(layout.num_decodes, layout.num_extends)
        if layout.num_decodes:
            context = [p + 1 for p in layout.decode_positions]
            meta.decode_block_tables = pad_tables(layout.decode_block_tables, device)
            meta.decode_context_lens = tensor(context)
            meta.decode_max_len = max(context)
        if layout.num_extends:
            meta.extend_block_tables = pad_tables(layout.extend_block_tables, device)
            meta.extend_query_start_loc = tensor(layout.extend_offsets())
            meta.extend_seq_lens = tensor([s + n for s, n in zip(layout.extend_start_positions, layout.extend_lens)])
            meta.extend_max_query_len = max(layout.extend_lens)
        return meta

    def forward(self, q, k, v, k_cache, v_cache, slot_mapping, metadata: TritonAttentionMetadata, scale,
                window: int = 0, softcap: float = 0.0):
        tk = self.kernels
        tk.store_kv_cache(k, v, k_cache, v_cache, slot_mapping)
        out = torch.empty_like(q)
        nd = metadata.num_decodes
        if nd:
            tk.paged_decode_attention(
                q[:nd], k_cache, v_cache, metadata.decode_block_tables, metadata.decode_context_lens, scale,
                max_len=metadata.decode_max_len, out=out[:nd], window=window, softcap=softcap,
            )
        if metadata.num_extends:
            tk.paged_extend_attention(
                q[nd:], k_cache, v_cache, metadata.extend_block_tables, metadata.extend_query_start_loc,
                metadata.extend_seq_lens, scale, max_query_len=metadata.extend_max_query_len, out=out[nd:],
                window=window, softcap=softcap,
            )
        return out
