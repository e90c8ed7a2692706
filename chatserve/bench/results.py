"""The serving benchmark's numbers under vLLM's names, its summary table and its result file.

`vllm bench serve --save-result` writes one JSON object; writing the same keys with the same
meaning and units (`ttfts`/`itls` in seconds, every `*_ms` in milliseconds, `request_rate` the
string "inf" when unbounded) lets one script read results of both tools side by side. The
statistics follow vLLM's `calculate_metrics`: TPOT per request = (latency - TTFT) / (output tokens
- 1) for requests of more than one token, ITL over every gap of every request, mean / median /
population std / linear percentiles, 0 where there is no sample. Keys chatserve adds
(`dataset_name`, `endpoint_type`, `cached_tokens_ratio`, ...) are new names, never a vLLM key with
another meaning.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Sequence
from typing import Any

from chatserve.bench.client import RequestOutput

# Every key `vllm bench serve --save-result` writes (vllm/benchmarks/serve.py), for the default
# percentile metrics ttft,tpot,itl (+ e2el, which vLLM adds with --percentile-metrics) and
# --metric-percentiles 99. The per-request lists are dropped unless --save-detailed, as in vLLM.
VLLM_HEADER_KEYS = ("date", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate", "burstiness",
                    "max_concurrency")
VLLM_METRIC_KEYS = ("duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
                    "request_goodput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
                    "max_concurrent_requests")
VLLM_DETAILED_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts", "errors")
PERCENTILE_METRICS = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
                      "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}


def percentile(xs: Sequence[float], p: float) -> float:
    """numpy.percentile's default (linear interpolation between order statistics)."""
    if not xs:
        return 0.0
    s = sorted(xs)
    k = (len(s) - 1) * p / 100.0
    f = math.floor(k)
    c = min(f + 1, len(s) - 1)
    return s[f] + (s[c] - s[f]) * (k - f)


def _p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def metric_keys(metrics: Sequence[str], percentiles: Sequence[float]) -> list[str]:
    """`mean_ttft_ms`, `median_ttft_ms`, `std_ttft_ms`, `p99_ttft_ms`, ... in vLLM's order."""
    keys = []
    for m in metrics:
        keys += [f"mean_{m}_ms", f"median_{m}_ms", f"std_{m}_ms", *(f"p{_p_word(p)}_{m}_ms" for p in percentiles)]
    return keys


def _peaks(outputs: Sequence[RequestOutput], t0: float) -> tuple[float, float]:
    """(most output tokens in one second, most requests in flight at once), as vLLM reports them."""
    per_second: dict[int, int] = {}
    events: list[tuple[float, int]] = []
    for o in outputs:
        events += [(o.start_time, 1), (o.start_time + o.latency, -1)]
        if not o.success:
            continue
        t = o.start_time + o.ttft
        per_second[int(t - t0)] = per_second.get(int(t - t0), 0) + 1
        for gap in o.itl:
            t += gap
            per_second[int(t - t0)] = per_second.get(int(t - t0), 0) + 1
    running = peak = 0
    for _, d in sorted(events, key=lambda e: (e[0], e[1])):
        running += d
        peak = max(peak, running)
    return float(max(per_second.values(), default=0)), float(peak)


def compute_metrics(outputs: Sequence[RequestOutput], duration: float, t0: float,
                    metrics: Sequence[str] = ("ttft", "tpot", "itl", "e2el"),
                    percentiles: Sequence[float] = (99,)) -> dict[str, Any]:
    ok = [o for o in outputs if o.success]
    duration = max(duration, 1e-9)
    total_in = sum(o.prompt_len for o in ok)
    output_lens = [o.output_tokens if o.success else 0 for o in outputs]
    total_out = sum(output_lens)
    samples = {
        "ttft": [o.ttft for o in ok],
        "tpot": [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1],
        "itl": [x for o in ok for x in o.itl],
        "e2el": [o.latency for o in ok],
    }
    peak_tokens, peak_conc = _peaks(outputs, t0)
    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_conc,
    }
    for m in metrics:
        xs = [x * 1e3 for x in samples[m]]
        result[f"mean_{m}_ms"] = statistics.fmean(xs) if xs else 0.0
        result[f"median_{m}_ms"] = statistics.median(xs) if xs else 0.0
        result[f"std_{m}_ms"] = statistics.pstdev(xs) if xs else 0.0
        for p in percentiles:
            result[f"p{_p_word(p)}_{m}_ms"] = percentile(xs, p)
    result.update({
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": output_lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "start_times": [o.start_time for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    })
    with_cache = [o for o in ok if o.cached_tokens is not None and o.prompt_len]
    result["cached_tokens_ratio"] = (sum(o.cached_tokens or 0 for o in with_cache) / sum(o.prompt_len for o in with_cache)
                                     if with_cache else None)
    return result


def _row(name: str, value: Any, precision: int | None = None) -> str:
    if precision is None:
        return f"{name:<40} {value!s:<10}"
    return f"{name:<40} {value:<10.{precision}f}"


def format_summary(result: dict[str, Any], metrics: Sequence[str], percentiles: Sequence[float]) -> str:
    """The table `vllm bench serve` prints, row for row."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
             _row("Successful requests:", result["completed"]),
             _row("Failed requests:", result["failed"])]
    if result.get("max_concurrency") is not None:
        lines.append(_row("Maximum request concurrency:", result["max_concurrency"]))
    rate = result.get("request_rate")
    if rate is not None and rate != "inf":
        lines.append(_row("Request rate configured (RPS):", float(rate), 2))
    lines += [_row("Benchmark duration (s):", result["duration"], 2),
              _row("Total input tokens:", result["total_input_tokens"]),
              _row("Total generated tokens:", result["total_output_tokens"]),
              _row("Request throughput (req/s):", result["request_throughput"], 2),
              _row("Output token throughput (tok/s):", result["output_throughput"], 2),
              _row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], 2),
              _row("Peak concurrent requests:", result["max_concurrent_requests"], 2),
              _row("Total token throughput (tok/s):", result["total_token_throughput"], 2)]
    for m in metrics:
        short, header = PERCENTILE_METRICS[m]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        lines.append(_row(f"Mean {short} (ms):", result[f"mean_{m}_ms"], 2))
        lines.append(_row(f"Median {short} (ms):", result[f"median_{m}_ms"], 2))
        for p in percentiles:
            lines.append(_row(f"P{_p_word(p)} {short} (ms):", result[f"p{_p_word(p)}_{m}_ms"], 2))
    if result.get("cached_tokens_ratio") is not None:
        lines.append("{s:{c}^{n}}".format(s="Prefix cache (server usage)", n=50, c="-"))
        lines.append(_row("Cached prompt tokens ratio:", result["cached_tokens_ratio"], 3))
    lines.append("=" * 50)
    return "\n".join(lines)


def result_filename(label: str | None, backend: str, request_rate: float, max_concurrency: int | None, model_id: str,
                    date: str) -> str:
    """vLLM's default name: `{label or backend}-{rate}qps[-concurrency{C}]-{model basename}-{date}.json`."""
    conc = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    return f"{label or backend}-{request_rate}qps{conc}-{model_id.split('/')[-1]}-{date}.json"


def save_result(result: dict[str, Any], path: str, detailed: bool) -> str:
    """Write the JSON (without the per-request lists unless `detailed`, as vLLM); returns the path."""
    out = dict(result) if detailed else {k: v for k, v in result.items() if k not in VLLM_DETAILED_KEYS}
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(out, fh)
    return path
