"""`--plot FILE.png`: the distributions behind the summary's means and percentiles.

Two panels, cumulative distributions of TTFT and of inter-token latency (log x, median dashed),
one line per result: the shape a p99 hides (a long tail, two modes when the prefix cache hits
some requests). matplotlib is optional: without it `--plot` is an error that says so, before any
request is sent.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def check_available() -> str | None:
    """None when matplotlib imports, else the message for the --plot error."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib (pip install matplotlib), which is not installed"
    return None


def write_plot(path: str, results: Sequence[dict[str, Any]], labels: Sequence[str]) -> None:
    """ECDFs of TTFT and ITL (ms) of results that carry `ttfts` and `itls` (seconds, vLLM's keys)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (res, label) in enumerate(zip(results, labels)):
        ok = [e == "" for e in res.get("errors") or []]
        series = {"TTFT (ms)": [t * 1e3 for t, good in zip(res.get("ttfts") or [], ok) if good],
                  "inter-token latency (ms)": [x * 1e3 for gaps, good in zip(res.get("itls") or [], ok) if good
                                               for x in gaps]}
        for ax, (name, xs) in zip(axes, series.items()):
            if not xs:
                continue
            xs = sorted(max(x, 1e-3) for x in xs)
            med = statistics.median(xs)
            color = f"C{i % 10}"
            ax.step([xs[0], *xs], [0.0, *((k + 1) / len(xs) for k in range(len(xs)))], where="post", color=color,
                    label=f"{label} (p50 {med:.1f} ms, n={len(xs)})")
            ax.axvline(med, color=color, linestyle="--", linewidth=0.8)
            ax.set_xscale("log")
            ax.set_xlabel(name)
            ax.set_ylabel("fraction of samples <= x")
            ax.set_title(f"{name.split(' (')[0]}: cumulative distribution")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8, loc="lower right")
    r = results[0]
    fig.suptitle(f"{r.get('dataset_name')}: {r.get('num_prompts')} prompts, rate {r.get('request_rate')}, "
                 f"max concurrency {r.get('max_concurrency')}, model {r.get('model_id')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
