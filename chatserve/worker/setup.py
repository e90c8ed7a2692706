"""The worker's own choices: device, dtype, CPU kernel tier and layer ops, from a config it is handed.

The engine says *what* to run (a model, a KV pool, limits); this module decides *how* on this
machine: CUDA or the CPU, bfloat16 or float32 (bfloat16 on a CPU only where a kernel tier loads:
`config.resolve_dtype`), which compiled kernels, which matmul and attention. The engine never
imports `kernels/` or `layers/`: it reads what was chosen from `ModelRunner.info()`. Every choice
comes from the `WorkerConfig` it is handed (the tier cap, the kernels' build folder, the matmul and
the cache folder included): nothing below here reads the environment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from chatserve.config import CacheConfig, EngineArgs, resolve_dtype, resolve_kv_cache_dtype
from chatserve.kernels.cpu import load_cpu_kernels
from chatserve.layers.ops import select_layer_ops
from chatserve.models.config import ModelConfig
from chatserve.models.loader import ModelSource
from chatserve.models.weight_cache import WeightCacheConfig
from chatserve.worker.model_runner import ModelRunner


@dataclass(frozen=True)
class WorkerConfig:
    """How the worker runs the model (the `EngineArgs` fields it reads, and nothing else)."""

    device: str = "auto"  # auto (CUDA when available, else CPU), cpu, cuda or cuda:N
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # auto (the model's dtype), bf16 or int8 (config.resolve_kv_cache_dtype)
    attention_backend: str = "auto"
    cpu_kernels: bool = True
    cpu_kernel_tier: str = "auto"
    max_cpu_tier: str | None = None  # the best kernel tier allowed (None: no cap)
    amx: bool = True
    kernel_build_dir: str | None = None  # where the C++ kernels are built (None: torch's default folder)
    quantization: str = "auto"
    num_threads: int | None = None  # torch compute threads (None: torch's default, all cores)
    weight_cache: WeightCacheConfig = WeightCacheConfig()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> WorkerConfig:
        return cls(
            device=args.device, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, attention_backend=args.attention_backend,
            cpu_kernels=args.cpu_kernels, cpu_kernel_tier=args.cpu_kernel_tier, max_cpu_tier=args.max_cpu_tier,
            amx=args.amx, kernel_build_dir=args.kernel_build_dir,
            quantization=args.quantization, num_threads=args.num_threads,
            weight_cache=WeightCacheConfig(args.weight_cache, args.weight_cache_dir,
                                           int(args.weight_cache_max_gb * 2**30), cache_dir=args.cache_dir),
        )


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _cpu_kernels_load(config: WorkerConfig, device: torch.device) -> bool:
    """Whether the C++ kernels of the requested tier load here (built and checked once per process),
    which is what makes bfloat16 the fast dtype on a CPU; a forced tier the CPU lacks raises."""
    if device.type != "cpu" or not config.cpu_kernels or config.dtype not in ("auto", "bfloat16"):
        return False
    return load_cpu_kernels(amx=config.amx, tier=config.cpu_kernel_tier, cap=config.max_cpu_tier,
                            build_dir=config.kernel_build_dir) is not None


def resolve_placement(config: WorkerConfig) -> tuple[torch.device, torch.dtype]:
    """The device and dtype this worker runs in; a forced kernel tier that cannot apply is an error."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device, cpu_kernels=_cpu_kernels_load(config, device),
                          max_cpu_tier=config.max_cpu_tier)
    if config.cpu_kernel_tier != "auto" and (device.type != "cpu" or dtype != torch.bfloat16):
        raise ValueError(f"cpu_kernel_tier={config.cpu_kernel_tier!r} picks bfloat16 CPU kernels, but this engine runs "
                         f"{str(dtype).removeprefix('torch.')} on {device.type}; use dtype auto or bfloat16 on the CPU")
    return device, dtype


def build_model_runner(
    config: WorkerConfig, source: ModelSource, hf_config: Any, model_config: ModelConfig, cache_config: CacheConfig,
    max_model_len: int,
) -> ModelRunner:
    """Place the worker (device, dtype), choose its layer ops, then build the model and its KV pool."""
    device, dtype = resolve_placement(config)
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, device, dtype, config.attention_backend)
    cfg = model_config
    # auto: Triton on CUDA, the torch path (with the C++ kernels where they apply) on the CPU
    ops = select_layer_ops(
        dtype=dtype, device=device, attention_backend=config.attention_backend,
        cpu_kernels=config.cpu_kernels, amx=config.amx, quantization=config.quantization, is_gguf=source.is_gguf,
        head_dim=cfg.head_dim, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
        cpu_kernel_tier=config.cpu_kernel_tier, max_cpu_tier=config.max_cpu_tier,
        kernel_build_dir=config.kernel_build_dir,
    )
    return ModelRunner(source, hf_config, cfg, cache_config, dtype, device, max_model_len=max_model_len, ops=ops,
                       weight_cache=config.weight_cache, kv_cache_dtype=kv_dtype)
