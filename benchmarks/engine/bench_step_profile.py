#!/usr/bin/env python3
"""Where one decode step's time goes (issue #57): batch-1 greedy decode, step by step.

    python benchmarks/engine/bench_step_profile.py                       # the default model, 2 threads
    python benchmarks/engine/bench_step_profile.py --model /tmp/llama-1b-q4_0.gguf --tokens 64
    python benchmarks/engine/bench_step_profile.py --json out.json

One `LLM`, one prompt, `--tokens` tokens generated with ignore_eos, `--repeats` times (the first run
is a warm-up and is not counted). Each part of the engine's step is timed by wrapping the method
that does it on the live objects (no code of the engine changes), and reported per step in
microseconds, medians over the counted runs:

  admit         Admission.admit_ready: grammars compiled, KV from the tiers
  schedule      Scheduler.schedule: the batch, blocks allocated
  batch         build_forward_batch: token ids, positions, block tables as tensors
  embed+rope    the token embedding and the rotary tables of the step
  layers        every decoder layer (the C++ LayerStack: one call; OpenMP threads woken per op)
  logits        final norm, lm_head matmul (the largest single read at 135M), float32 logits
  sampler       the sampler (greedy: an argmax and its logprob bookkeeping)
  update        Scheduler.update_from_output: tokens appended, finished sequences freed
  outputs       OutputProcessor.process: stop checks, incremental detokenization, outputs
  kv events     flush of the step's KV cache events
  rest          the step's wall time minus the above (Python glue between them, the generate loop)

Above the table: the tokens/s this loop reached, the bytes the step must read (the file's matrices,
the lm_head counted once, as llama.cpp reads them) and, with the host's read bandwidth measured the
way bench_native.py measures it (median of 3 probes), the decode bound and how close the step is to it. `--bound-only`
prints just the bound. The wrappers cost ~1 µs each (10 per step): stated, not subtracted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "peers"))

import bench_common as bc  # noqa: E402

PARTS = ("admit", "schedule", "batch", "embed+rope", "layers", "logits", "sampler", "update", "outputs", "kv events")


class StepTimers:
    """Seconds per part, summed over the steps of one run."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.enabled = False

    def wrap(self, owner: Any, attr: str, label: str) -> None:
        """Replace `owner.attr` (a bound method, or a module's function) by one that adds its time to `label`."""
        original = getattr(owner, attr)
        timers = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not timers.enabled:
                return original(*args, **kwargs)
            t = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                timers.total[label] += time.perf_counter() - t

        setattr(owner, attr, timed)


def instrument(llm: Any, timers: StepTimers) -> None:
    """Wrap each part of the engine's step on the live objects of `llm`."""
    import chatserve.worker.model_runner as model_runner

    engine = llm.engine
    runner = engine.worker
    model = runner.model
    timers.wrap(engine.admission, "admit_ready", "admit")
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(model_runner, "build_forward_batch", "batch")
    timers.wrap(model.embed_tokens, "forward", "embed+rope")
    timers.wrap(model.rotary, "cos_sin", "embed+rope")
    if model.layer_stack is not None:  # a C++ object: timed through a stand-in with its forward
        stack = model.layer_stack

        class TimedStack:
            forward = staticmethod(stack.forward)

        model.layer_stack = TimedStack()
        timers.wrap(model.layer_stack, "forward", "layers")
    else:  # the Python layers: each one's forward
        holder = type("Layers", (), {})()
        wrapped = []
        for i, forward in enumerate(model._layer_forwards):
            setattr(holder, f"l{i}", forward)
            timers.wrap(holder, f"l{i}", "layers")
            wrapped.append(getattr(holder, f"l{i}"))
        model._layer_forwards = wrapped
    timers.wrap(model, "logits", "logits")
    timers.wrap(runner, "sampler", "sampler")
    timers.wrap(engine.scheduler, "update_from_output", "update")
    timers.wrap(engine.output_processor, "process", "outputs")
    timers.wrap(engine, "flush_kv_events", "kv events")
    timers.wrap(engine, "step", "step")


def decode_bytes_per_token(path: str) -> int:
    """Bytes of the file's tensors one decode step reads (bench_native.file_info: every tensor, the token
    embedding's table only where it doubles as the lm_head)."""
    from bench_native import file_info  # type: ignore[import-not-found]

    return int(file_info(path).read_bytes_per_token)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128, help="tokens generated per run")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5, help="counted runs (one more warm-up run)")
    p.add_argument("--bandwidth", type=float, default=None, help="GiB/s (default: measured, as bench_native.py does)")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from bench_native import bandwidth_probes  # type: ignore[import-not-found]

    from chatserve import LLM, SamplingParams
    from chatserve.models.loader import default_model_path

    path = args.model or default_model_path()
    bandwidth = args.bandwidth or statistics.median(bandwidth_probes(args.threads))
    read_bytes = decode_bytes_per_token(path)
    bound = bandwidth * 2**30 / read_bytes

    llm = LLM(model=path, num_threads=args.threads, enable_prefix_caching=False, max_model_len=args.prompt_tokens + args.tokens + 16)
    timers = StepTimers()
    instrument(llm, timers)
    prompt = {"prompt_token_ids": [300 + (7 * i) % 20000 for i in range(args.prompt_tokens)]}
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)

    runs: list[dict[str, float]] = []
    for r in range(args.repeats + 1):
        timers.total.clear()
        timers.enabled = True
        steps_before = llm.engine.num_steps
        t = time.perf_counter()
        out = llm.generate([prompt], params)
        wall = time.perf_counter() - t
        timers.enabled = False
        steps = llm.engine.num_steps - steps_before
        assert len(out[0].outputs[0].token_ids) == args.tokens
        if r == 0:
            continue
        # the prefill step is one of them: its layers time is excluded by counting only decode steps' share
        per_step = {k: v / steps * 1e6 for k, v in timers.total.items()}
        per_step["wall"] = wall / steps * 1e6
        per_step["tok_s"] = args.tokens / wall
        runs.append(per_step)

    med = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in set().union(*runs)}
    parts_sum = sum(med.get(k, 0.0) for k in PARTS)
    med["rest"] = med["step"] - parts_sum
    med["outside step"] = med["wall"] - med["step"]
    info = llm.engine_info()
    print(f"\nmodel {Path(path).name}; tier {info.kernel_tier}; {args.threads} threads; CPU {bc.env_info()['cpu']}")
    print(f"decode reads {read_bytes / 2**20:.1f} MiB per token; read bandwidth {bandwidth:.1f} GiB/s; "
          f"bound {bound:.0f} tok/s; this loop {med['tok_s']:.1f} tok/s = {100 * med['tok_s'] / bound:.0f}% of the bound")
    print(f"(per step, µs, medians of {len(runs)} runs of {args.tokens} tokens; the prefill of "
          f"{args.prompt_tokens} tokens is one of the {args.tokens} steps)\n")
    print("| part | µs per step | % of the step |\n|---|---|---|")
    for k in (*PARTS, "rest", "outside step"):
        print(f"| {k} | {med.get(k, 0.0):.0f} | {100 * med.get(k, 0.0) / med['wall']:.1f} |")
    print(f"| **wall** | {med['wall']:.0f} | 100 |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": path, "threads": args.threads, "bandwidth_gib_s": bandwidth,
                                               "read_bytes_per_token": read_bytes, "bound_tok_s": bound,
                                               "median_us": med, "runs": runs, "env": bc.env_info()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
