#!/usr/bin/env python3
"""chatserve against native llama.cpp and ik_llama.cpp binaries, per model file: one command, one table (#57).

    python benchmarks/peers/bench_native.py                         # 135M default + the random 1B/3B/8B files found
    python benchmarks/peers/bench_native.py --models default,~/.cache/chatserve-native/models/llama-3.2-1b-random-q4_0.gguf
    python benchmarks/peers/bench_native.py --rounds 3 --engines chatserve,ik --json bench_results/native.json
    python benchmarks/peers/bench_native.py --quick                 # decode b1 + prefill 512 only (3B, 8B on a busy day)

The binaries come from benchmarks/peers/build_native.sh (run it first; --mainline-bin / --ik-bin
point elsewhere); the 1B/3B/8B files from `benchmarks/models/make_random_gguf.py --preset ...`.
Every engine runs with --threads threads (2), the same file, each measurement in its own process,
engines ALTERNATED within each round (round 1: chatserve, llama.cpp, ik; round 2: the same...), and
the table shows medians over --rounds. Per model and engine:

  decode b1   tokens/s of one stream. llama-bench: tg128 (`-n 128`, from an empty context, no
              sampling). chatserve: `LLM.generate` of one 16-token prompt, ignore_eos, greedy;
              (N - 1) / (time(max_tokens=N) - time(max_tokens=1)), N = 128 (sampling included).
  prefill P   seconds for a P-token prompt (512, and --long-prefill 2000 on models under 5B
              parameters). llama-bench: pp512 / pp2000 (`-p P`, batch 2048, ubatch 512, its
              defaults). chatserve: time(max_tokens=1) of a P-token random-id prompt, prefix cache off.
  decode b8   total tokens/s of 8 concurrent streams. llama.cpp and ik: `llama-batched-bench
              -npp 16 -ntg 128 -npl 8` (S_TG: 8 sequences decoding in one batch, after their
              prefill). chatserve: 8 prompts of 16 ids in one `generate`, 8 (N - 1) / (time(N) - time(1)).
  peak RSS    the process's maximum resident set (MiB): /usr/bin/time -v for the binaries (mmapped
              weight pages count once touched), VmHWM for chatserve's worker (after warm-up and
              all of the above).

ik_llama.cpp runs with `-rtr 1` (run-time repacking of the weights into its interleaved layouts,
its best CPU setting). llama.cpp's builds use build_native.sh's flags (-march=native unless AMX).
Above the table: the CPU, chatserve's kernel tier, the host's read bandwidth (read_bandwidth.c:
--threads threads reading a 2 GiB buffer, best of 5 passes; probed three times before every round,
the median of all probes used and their range printed, since a VM's vCPUs read 30-60 GiB/s by
where they are placed at the moment) and, per model, the bytes decode reads per
token (every tensor's bytes, less the embedding table when an output matrix is separate) and
the decode bound = bandwidth / those bytes, with each decode b1 as a % of that bound.
Timings on a busy machine are noise: the script warns when the load average is high.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE.parent))
import bench_common as bc  # noqa: E402

ENGINES = ("chatserve", "llamacpp", "ik")
LABELS = {"chatserve": "chatserve", "llamacpp": "llama.cpp", "ik": "ik_llama.cpp"}
RESULT = "BENCH_NATIVE_RESULT "
MODELS_DIR = Path.home() / ".cache" / "chatserve-native" / "models"
PROMPT_IDS = 16


@dataclass
class Measure:
    """One engine's numbers for one model in one round (None: not measured or failed)."""

    decode_b1: float | None = None
    prefill_s: dict[str, float] = field(default_factory=dict)  # str(P) -> seconds
    decode_b8: float | None = None
    peak_rss_mib: float | None = None
    errors: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------
# The host and the file
# ---------------------------------------------------------------------------------------------------


def read_bandwidth_gib_s(threads: int, gib: float = 2.0, repeats: int = 5) -> float:
    """Streaming-read bandwidth of `threads` threads over a `gib` GiB buffer, best of `repeats` passes:
    read_bandwidth.c, compiled once into the native cache (torch's `sum` gave 29 or 48 GiB/s on the
    same host by the buffer's size); torch's `sum` only where no C compiler is found."""
    probe = _bandwidth_probe()
    if probe is not None:
        out = subprocess.run([str(probe), str(threads), str(gib), str(repeats)], capture_output=True, text=True,
                             timeout=300, check=True)
        return float(out.stdout.split()[-1])
    import torch

    torch.set_num_threads(threads)
    x = torch.ones(int(gib * 2**30 / 4), dtype=torch.float32)
    x.sum()
    best = min(_timed(x.sum) for _ in range(repeats))
    return gib / best


def _bandwidth_probe() -> Path | None:
    """read_bandwidth.c built for this CPU (-O3 -march=native -fopenmp), cached by its source's hash."""
    import hashlib
    import shutil

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    src = HERE / "read_bandwidth.c"
    digest = hashlib.sha256(src.read_bytes()).hexdigest()[:12]
    cache = Path(os.environ.get("NATIVE_CACHE", Path.home() / ".cache" / "chatserve-native"))
    exe = cache / f"read_bandwidth-{digest}"
    if not exe.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = exe.with_suffix(".tmp")
        subprocess.run([cc, "-O3", "-march=native", "-fopenmp", str(src), "-o", str(tmp)], check=True, capture_output=True)
        os.replace(tmp, exe)
    return exe


def bandwidth_probes(threads: int, n: int = 3) -> list[float]:
    """`n` probes in a row: a VM's two vCPUs read 30-60 GiB/s by where they run at the moment."""
    return [read_bandwidth_gib_s(threads) for _ in range(n)]


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


@dataclass(frozen=True)
class FileInfo:
    """What decode reads per token and the model's size, from the GGUF's tensor table."""

    path: str
    label: str
    file_bytes: int
    read_bytes_per_token: int
    params: int


def file_info(path: str) -> FileInfo:
    """Bytes decode reads per token: every tensor, less the embedding table when a separate output
    matrix exists (then one embedding row per token is read, not the table)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    params = sum(int(t.n_elements) for t in reader.tensors)
    read = sum(sizes.values()) - (sizes.get("token_embd.weight", 0) if "output.weight" in sizes else 0)
    return FileInfo(path=path, label=Path(path).stem, file_bytes=os.path.getsize(path), read_bytes_per_token=read, params=params)


# ---------------------------------------------------------------------------------------------------
# chatserve: a worker process per round (load once, then every measurement)
# ---------------------------------------------------------------------------------------------------


def chatserve_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs inside the worker: loads `spec["model"]` and measures prefill, decode b1 and b8, peak RSS."""
    import random

    from chatserve import LLM, SamplingParams

    llm = LLM(model=spec["model"], num_threads=spec["threads"], max_model_len=spec["max_model_len"],
              enable_prefix_caching=False, kv_cache_memory_gb=spec["kv_gb"])
    vocab = len(llm.get_tokenizer())
    rng = random.Random(0)

    def ids(n: int) -> dict[str, list[int]]:
        return {"prompt_token_ids": [rng.randrange(300, vocab - 1) for _ in range(n)]}

    def run(prompts: list[dict[str, list[int]]], n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False) if _takes_tqdm(llm) else llm.generate(prompts, params)
        elapsed = time.perf_counter() - t
        made = [len(o.outputs[0].token_ids) for o in outs]
        if made != [n] * len(prompts):
            raise RuntimeError(f"expected {n} tokens per prompt, got {made}")
        return elapsed

    out: dict[str, Any] = {"prefill_s": {}}
    n = spec["n_gen"]
    b1 = [ids(PROMPT_IDS)]
    run(b1, 8)  # warm-up: kernels, arenas, the first-step costs
    out["decode_b1"] = (n - 1) / (run(b1, n) - run(b1, 1))
    for p in spec["prefill"]:
        prompt = [ids(p)]
        run(prompt, 1)  # warm-up at this length
        out["prefill_s"][str(p)] = run([ids(p)], 1)
    if spec["batch"]:
        b8 = [ids(PROMPT_IDS) for _ in range(spec["batch"])]
        run(b8, 4)
        out["decode_b8"] = spec["batch"] * (n - 1) / (run(b8, n) - run(b8, 1))
    out["peak_rss_mib"] = bc.peak_rss_mib()
    info = llm.engine_info()
    out["info"] = {"kernel_tier": info.kernel_tier, "dtype": info.dtype, "linear": info.linear_impl}
    return out


def _takes_tqdm(llm: Any) -> bool:
    import inspect

    return "use_tqdm" in inspect.signature(llm.generate).parameters


def run_chatserve(model: str, args: argparse.Namespace, prefill: list[int]) -> Measure:
    spec = {"model": model, "threads": args.threads, "max_model_len": max(prefill) + args.n_gen + 64,
            "kv_gb": args.kv_gb, "n_gen": args.n_gen, "prefill": prefill, "batch": args.batch}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        proc = subprocess.run([sys.executable, __file__, "--chatserve-worker", f.name], capture_output=True,
                              text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return Measure(errors=[f"chatserve: timed out after {args.timeout} s"])
    finally:
        os.unlink(f.name)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            res = json.loads(line[len(RESULT):])
            return Measure(decode_b1=res["decode_b1"], prefill_s=res["prefill_s"], decode_b8=res.get("decode_b8"),
                           peak_rss_mib=res["peak_rss_mib"], info=res["info"])
    return Measure(errors=[f"chatserve exited {proc.returncode}: {proc.stderr.strip()[-800:]}"])


# ---------------------------------------------------------------------------------------------------
# The native binaries
# ---------------------------------------------------------------------------------------------------


def timed_process(cmd: list[str], timeout: float) -> tuple[int, str, float | None]:
    """(exit status, stdout + stderr, peak RSS MiB) of `cmd` under /usr/bin/time -v."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as tf:
        wrapped = ["/usr/bin/time", "-v", "-o", tf.name, *cmd] if os.path.exists("/usr/bin/time") else cmd
        try:
            proc = subprocess.run(wrapped, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return 124, f"timed out after {timeout} s", None
        m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", Path(tf.name).read_text())
        return proc.returncode, proc.stdout + proc.stderr, int(m.group(1)) / 1024 if m else None


def parse_llama_bench_json(text: str) -> list[dict[str, Any]]:
    """llama-bench's `-o json` array (logs on stderr can surround it)."""
    start, end = text.find("["), text.rfind("]")
    if start < 0 or end < start:
        raise ValueError("no JSON array in llama-bench's output")
    return json.loads(text[start:end + 1])


def parse_batched_bench(text: str) -> dict[int, float]:
    """llama-batched-bench's Markdown table: batch size B -> S_TG (total generated tokens/s)."""
    header: list[str] | None = None
    out: dict[int, float] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "S_TG t/s" in cells:
            header = cells
        elif header and len(cells) == len(header) and cells[header.index("B")].isdigit():
            out[int(cells[header.index("B")])] = float(cells[header.index("S_TG t/s")])
    return out


def run_native(engine: str, binaries: Path, model: str, args: argparse.Namespace, prefill: list[int]) -> Measure:
    # ik's run-time repacking: llama-bench takes a value (`-rtr 1`), its common-args tools a bare flag
    extra = ["-rtr", "1"] if engine == "ik" else []
    # ...and its batched bench without flash attention: ik 0.1.5's iqk FA kernel fails GGML_ASSERT(S > 0)
    # (iqk_fa_templates.h) on 8 sequences of 16-token prompts, with or without repacking
    extra_common = ["--run-time-repack", "-no-fa"] if engine == "ik" else []
    m = Measure()
    cmd = [str(binaries / "llama-bench"), "-m", model, "-t", str(args.threads), "-r", "1", "-o", "json",
           "-p", ",".join(map(str, prefill)), "-n", str(args.n_gen), *extra]
    rc, text, rss = timed_process(cmd, args.timeout)
    if rc != 0:
        m.errors.append(f"{engine} llama-bench exited {rc}: {text.strip()[-800:]}")
        return m
    for row in parse_llama_bench_json(text):
        if row.get("n_gen") and not row.get("n_prompt"):
            m.decode_b1 = float(row["avg_ts"])
        elif row.get("n_prompt") and not row.get("n_gen"):
            m.prefill_s[str(row["n_prompt"])] = row["n_prompt"] / float(row["avg_ts"])
    m.peak_rss_mib = rss
    if args.batch:
        bb = binaries / "llama-batched-bench"
        cmd = [str(bb), "-m", model, "-t", str(args.threads), "-tb", str(args.threads), "-c", "4096",
               "-npp", str(PROMPT_IDS), "-ntg", str(args.n_gen), "-npl", str(args.batch), *extra_common]
        rc, text, rss = timed_process(cmd, args.timeout)
        speeds = parse_batched_bench(text) if rc == 0 else {}
        if args.batch in speeds:
            m.decode_b8 = speeds[args.batch]
            m.peak_rss_mib = max(x for x in (m.peak_rss_mib, rss) if x is not None)
        else:
            m.errors.append(f"{engine} llama-batched-bench exited {rc}: {text.strip()[-800:]}")
    return m


# ---------------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------------


def median_measure(ms: list[Measure]) -> dict[str, Any]:
    def med(xs: list[float | None]) -> float | None:
        vals = [x for x in xs if x is not None]
        return statistics.median(vals) if vals else None

    keys = sorted({k for m in ms for k in m.prefill_s}, key=int)
    return {"decode_b1": med([m.decode_b1 for m in ms]), "decode_b8": med([m.decode_b8 for m in ms]),
            "prefill_s": {k: med([m.prefill_s.get(k) for m in ms]) for k in keys},
            "peak_rss_mib": med([m.peak_rss_mib for m in ms]), "runs": len(ms)}


def table(results: dict[str, Any], bandwidth: float, prefill_cols: list[int]) -> str:
    head = ["model", "engine", "decode b1 tok/s", "% of bound"] + [f"prefill {p} s" for p in prefill_cols]
    head += ["decode 8 streams tok/s", "peak RSS MiB"]
    rows = [head]
    for model in results["models"]:
        bound = bandwidth * 2**30 / model["file"]["read_bytes_per_token"]
        for engine, med in model["median"].items():
            d = med["decode_b1"]
            rows.append([model["file"]["label"] + f", bound {bound:.0f} tok/s", LABELS[engine], bc.fmt(d, "{:.1f}"),
                         bc.fmt(d and 100 * d / bound, "{:.0f}%")]
                        + [bc.fmt(med["prefill_s"].get(str(p)), "{:.2f}") for p in prefill_cols]
                        + [bc.fmt(med["decode_b8"], "{:.1f}"), bc.fmt(med["peak_rss_mib"], "{:.0f}")])
    return bc.markdown_table(rows)


def default_models() -> list[str]:
    found = [str(MODELS_DIR / f"{p}-random-{t}.gguf") for p in ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b")
             for t in ("q4_0", "q8_0")]
    return ["default"] + [f for f in found if os.path.exists(f)]


def native_bin_dir(name: str) -> Path:
    out = subprocess.run(["bash", str(HERE / "build_native.sh"), "--print-dir", name], capture_output=True,
                         text=True, check=True)
    return Path(out.stdout.strip())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", help="comma-separated .gguf paths; 'default' is the 135M default model "
                                    "[default: default + every random preset file in ~/.cache/chatserve-native/models]")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"from {','.join(ENGINES)}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-gen", type=int, default=128, help="decoded tokens per measurement")
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--long-prefill", type=int, default=2000, help="also on models under 5B parameters (0: never)")
    p.add_argument("--batch", type=int, default=8, help="concurrent streams of the batched decode (0: skip)")
    p.add_argument("--quick", action="store_true", help="decode b1 and prefill --prefill only")
    p.add_argument("--kv-gb", type=float, default=None,
                   help="chatserve's KV pool in GB [default: its own, sized for the longest prompt + --n-gen]")
    p.add_argument("--mainline-bin", type=Path, help="folder of llama.cpp's binaries [build_native.sh's]")
    p.add_argument("--ik-bin", type=Path, help="folder of ik_llama.cpp's binaries [build_native.sh's]")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", help="write every run and the medians here")
    p.add_argument("--chatserve-worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.chatserve_worker:
        res = chatserve_worker(json.loads(Path(args.chatserve_worker).read_text()))
        print(RESULT + json.dumps(res), flush=True)
        return 0
    if args.quick:
        args.batch, args.long_prefill = 0, 0

    busy = bc.start_parent()
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = sorted(set(engines) - set(ENGINES))
    if bad:
        p.error(f"--engines: unknown {bad} (from {', '.join(ENGINES)})")
    bins = {"llamacpp": args.mainline_bin or native_bin_dir("mainline"), "ik": args.ik_bin or native_bin_dir("ik")}
    for e in engines:
        if e in bins and not (bins[e] / "llama-bench").exists():
            p.error(f"{bins[e]}/llama-bench is missing: run benchmarks/peers/build_native.sh first")
    models = [bc.default_gguf_path() if m.strip() == "default" else os.path.expanduser(m.strip())
              for m in (args.models.split(",") if args.models else default_models())]
    files = [file_info(m) for m in models]
    probes: list[float] = []

    runs: dict[str, dict[str, list[Measure]]] = {f.path: {e: [] for e in engines} for f in files}
    prefill_of = {f.path: [args.prefill] + ([args.long_prefill] if args.long_prefill and f.params < 5e9 else [])
                  for f in files}
    for r in range(args.rounds):
        probes += bandwidth_probes(args.threads)
        bc.log("main", f"read bandwidth, {args.threads} threads: {', '.join(f'{b:.1f}' for b in probes[-3:])} GiB/s")
        for f in files:
            for e in (engines if r % 2 == 0 else engines[::-1]):  # alternate the order too
                bc.log("main", f"round {r + 1}/{args.rounds}: {LABELS[e]} on {Path(f.path).name}")
                m = (run_chatserve(f.path, args, prefill_of[f.path]) if e == "chatserve"
                     else run_native(e, bins[e], f.path, args, prefill_of[f.path]))
                for err in m.errors:
                    bc.log("main", "ERROR " + err)
                bc.log("main", f"  decode b1 {bc.fmt(m.decode_b1, '{:.1f}')} tok/s, prefill "
                               f"{ {k: round(v, 2) for k, v in m.prefill_s.items()} } s, decode b{args.batch} "
                               f"{bc.fmt(m.decode_b8, '{:.1f}')} tok/s, peak RSS {bc.fmt(m.peak_rss_mib, '{:.0f}')} MiB")
                runs[f.path][e].append(m)

    bandwidth = statistics.median(probes)
    tier = next((m.info.get("kernel_tier") for f in files for m in runs[f.path].get("chatserve", []) if m.info), None)
    results = {"env": bc.env_info(), "threads": args.threads, "bandwidth_gib_s": bandwidth, "bandwidth_probes": probes,
               "chatserve_tier": tier,
               "binaries": {k: str(v) for k, v in bins.items()}, "busy_warning": busy,
               "models": [{"file": asdict(f), "median": {e: median_measure(runs[f.path][e]) for e in engines},
                           "runs": {e: [asdict(m) for m in runs[f.path][e]] for e in engines}} for f in files]}
    cols = sorted({p for ps in prefill_of.values() for p in ps})
    print(f"\nCPU: {results['env']['cpu']}; chatserve tier {tier}; {args.threads} threads; read bandwidth "
          f"{bandwidth:.1f} GiB/s (median of {len(probes)} probes, {min(probes):.1f}-{max(probes):.1f}); "
          f"medians of {args.rounds} alternated rounds\n")
    print(table(results, bandwidth, cols))
    if busy:
        print("\nWARNING: " + busy)
    if args.json:
        bc.write_json(args.json, results)
    return 1 if any(m.errors for f in files for ms in runs[f.path].values() for m in ms) else 0


if __name__ == "__main__":
    raise SystemExit(main())
