"""Make vLLM's CPU build load the kernels of a lesser x86 host (`benchmarks/peers/compare_vllm.sh` with VLLM_CPU_ISA).

vLLM picks `_C` (AVX512-BF16), `_C_AVX512` or `_C_AVX2` from `torch.cpu._is_avx512_supported()` and
`_is_avx512_bf16_supported()`, which read the CPU's flags and ignore ATEN_CPU_CAPABILITY. To compare
against an AVX2-only host on an AVX512 machine, compare_vllm.sh puts this folder on PYTHONPATH with
VLLM_CPU_ISA=avx2 (or avx512: AVX512 without BF16), so every vLLM process, its workers included,
sees only that ISA; torch's own kernels are capped by ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA.
"""

import os

_isa = os.environ.get("VLLM_CPU_ISA", "").lower()
if _isa in ("avx2", "avx512"):
    import torch.cpu

    torch.cpu._is_avx512_bf16_supported = lambda: False
    if _isa == "avx2":
        torch.cpu._is_avx512_supported = lambda: False
