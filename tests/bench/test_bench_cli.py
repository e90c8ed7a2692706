"""`chatserve bench serve|latency|throughput` (chatserve/bench/): the flags and their errors, the
datasets, the result keys against vLLM's, and short real runs (a live server, the engine
in-process). Counts are checked, never wall-clock times."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from chatserve.bench import plot as bench_plot
from chatserve.bench.client import RequestOutput
from chatserve.bench.datasets import (
    conversations,
    prefix_requests,
    random_requests,
    session_requests,
    sharegpt_like_requests,
)
from chatserve.bench.results import compute_metrics, format_summary, metric_keys, result_filename, save_result
from chatserve.cli import parse_args
from tests.helpers import prefork
from tests.helpers.server import ROOT, SHARED_API_KEY

# What `vllm bench serve --save-result --save-detailed --percentile-metrics ttft,tpot,itl,e2el` writes
# (vllm/benchmarks/serve.py: main's result_json + benchmark()'s result), spelled out here rather than
# imported, so a rename on our side breaks this test.
VLLM_RESULT_KEYS = [
    "date", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate", "burstiness", "max_concurrency",
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
    "request_goodput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
    "max_concurrent_requests",
    "input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts", "errors",
    "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "median_tpot_ms", "std_tpot_ms", "p99_tpot_ms",
    "mean_itl_ms", "median_itl_ms", "std_itl_ms", "p99_itl_ms",
    "mean_e2el_ms", "median_e2el_ms", "std_e2el_ms", "p99_e2el_ms",
]
VLLM_DETAILED = {"input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts", "errors"}


def _error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, environ={})
    assert exc.value.code == 2
    return capsys.readouterr().err


# ---- flags --------------------------------------------------------------------------------------------
def test_serve_defaults_are_vllms_and_vllm_spellings_parse() -> None:
    a = parse_args(["bench", "serve"], environ={})
    assert (a.dataset_name, a.request_rate, a.max_concurrency, a.random_input_len, a.random_output_len) == \
        ("random", float("inf"), None, 1024, 128)
    assert (a.endpoint, a.backend, a.percentile_metrics_list, a.metric_percentiles_list) == \
        ("completions", "openai", ["ttft", "tpot", "itl", "e2el"], [99.0])
    a = parse_args(["bench", "serve", "--endpoint", "/v1/chat/completions", "--request-rate", "2.5",
                    "--max-concurrency", "4", "--metric-percentiles", "50,90,99.9", "--dataset-name", "prefix"], environ={})
    assert (a.endpoint, a.backend, a.request_rate, a.max_concurrency) == ("chat", "openai-chat", 2.5, 4)
    assert a.metric_percentiles_list == [50.0, 90.0, 99.9]
    assert parse_args(["bench", "serve", "--backend", "openai-chat"], environ={}).endpoint == "chat"
    assert parse_args(["bench", "serve", "--dataset-name", "sessions"], environ={}).backend == "chatserve-sessions"


@pytest.mark.parametrize("argv, flag", [
    (["--num-prompts", "0"], "--num-prompts"),
    (["--num-prompts", "many"], "--num-prompts"),
    (["--request-rate", "0"], "--request-rate"),
    (["--request-rate", "fast"], "--request-rate"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--random-range-ratio", "1.5"], "--random-range-ratio"),
    (["--dataset-name", "sharegpt"], "--dataset-name"),
    (["--endpoint", "/v1/embeddings"], "--endpoint"),
    (["--percentile-metrics", "ttft,goodput"], "--percentile-metrics"),
    (["--metric-percentiles", "0,101"], "--metric-percentiles"),
    (["--header", "no-equals-sign"], "--header"),
    (["--extra-body", "[1, 2]"], "--extra-body"),
    (["--ignore-eos", "--disable-ignore-eos"], "--disable-ignore-eos"),
    (["--no-such-flag"], "--no-such-flag"),
])
def test_serve_bad_flags_are_errors_naming_the_flag(capsys, argv: list[str], flag: str) -> None:
    err = _error(capsys, ["bench", "serve", *argv])
    assert flag in err and "error" in err


def test_plot_without_matplotlib_is_an_error_naming_plot(capsys, monkeypatch) -> None:
    monkeypatch.setattr(bench_plot, "check_available", lambda: "--plot needs matplotlib (pip install matplotlib)")
    err = _error(capsys, ["bench", "serve", "--plot", "x.png"])
    assert "--plot" in err and "matplotlib" in err


def test_offline_commands_take_engine_flags_and_check_lengths(capsys) -> None:
    a = parse_args(["bench", "latency", "--input-len", "8", "--output-len", "4", "--batch-size", "2",
                    "--dtype", "float32", "--max-model-len", "64"], environ={})
    assert (a.input_len, a.output_len, a.batch_size, a.num_iters_warmup, a.num_iters) == (8, 4, 2, 10, 30)
    assert a.dtype == "float32" and a.enable_prefix_caching is False  # repeated prompts must not hit the cache
    t = parse_args(["bench", "throughput", "--num-prompts", "5"], environ={})
    assert (t.input_len, t.output_len, t.num_prompts, t.enable_prefix_caching) == (128, 128, 5, True)
    assert "--max-model-len" in _error(capsys, ["bench", "latency", "--input-len", "60", "--output-len", "10",
                                                "--max-model-len", "64"])
    assert "--batch-size" in _error(capsys, ["bench", "latency", "--batch-size", "0"])
    assert "--num-prompts" in _error(capsys, ["bench", "throughput", "--num-prompts", "-1"])
    assert "serve,latency,throughput" in _error(capsys, ["bench"])


# ---- datasets -----------------------------------------------------------------------------------------
def test_random_dataset_lengths_and_seed() -> None:
    a = random_requests(20, 64, 16, seed=1)
    assert all(abs(r.prompt_len - 64) <= 3 and r.expected_output_len == 16 for r in a)
    assert [r.prompt for r in a] == [r.prompt for r in random_requests(20, 64, 16, seed=1)]
    assert [r.prompt for r in a] != [r.prompt for r in random_requests(20, 64, 16, seed=2)]
    assert len({r.prompt for r in a}) == 20
    spread = random_requests(200, 100, 40, seed=3, range_ratio=0.5)
    assert all(50 <= r.expected_output_len * 100 / 40 <= 150 for r in spread)
    assert all(45 <= r.prompt_len <= 153 for r in spread)
    assert len({r.expected_output_len for r in spread}) > 10
    assert all(r.prompt == r.messages[0]["content"] for r in a)  # completions: the bare text, no template


def test_sharegpt_like_varies_and_is_deterministic() -> None:
    a = sharegpt_like_requests(60, input_median=100, seed=5)
    assert [r.chat_messages() for r in a] == [r.chat_messages() for r in sharegpt_like_requests(60, 100, seed=5)]
    assert len({r.prompt_len for r in a}) > 30 and len({r.expected_output_len for r in a}) > 20
    assert any(r.history for r in a) and any(not r.history for r in a)
    for r in a:
        msgs = r.chat_messages()
        assert [m["role"] for m in msgs] == ["user", "assistant"] * len(r.history[::2]) + ["user"]
        assert r.prompt.endswith("Assistant:") or not r.history
    assert {r.expected_output_len for r in sharegpt_like_requests(10, 100, output_len=7, seed=5)} == {7}


def test_prefix_dataset_shares_the_prefix_only() -> None:
    a = prefix_requests(6, prefix_len=200, question_len=30, output_len=8, seed=0)
    systems = {r.messages[0]["content"] for r in a}
    assert len(systems) == 1 and 180 < len(next(iter(systems))) / 4.9 < 240
    assert len({r.messages[1]["content"] for r in a}) == 6
    assert all(r.prompt.startswith("System: ") for r in a)
    b = prefix_requests(6, 50, 10, 8, seed=0, num_prefixes=3)
    assert [b[i].messages[0]["content"] == b[i + 3].messages[0]["content"] for i in range(3)] == [True] * 3
    assert len({r.messages[0]["content"] for r in b}) == 3


def test_sessions_dataset_turns_and_grouping() -> None:
    a = session_requests(7, turns=3, first_len=60, turn_len=20, output_len=5, seed=0)
    assert [(r.conversation, r.turn) for r in a] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0)]
    assert a[0].prompt_len > a[1].prompt_len
    units = conversations(a)
    assert [len(u) for u in units] == [3, 3, 1]
    assert [len(u) for u in conversations(random_requests(3, 8, 2))] == [1, 1, 1]


# ---- results ------------------------------------------------------------------------------------------
def _outputs() -> list[RequestOutput]:
    return [
        RequestOutput(success=True, prompt_len=10, output_tokens=4, ttft=0.1, itl=[0.02, 0.02, 0.05], latency=0.19,
                      start_time=100.0, generated_text="abcd", cached_tokens=5),
        RequestOutput(success=True, prompt_len=20, output_tokens=2, ttft=0.3, itl=[0.1], latency=0.4, start_time=100.1,
                      generated_text="ef", cached_tokens=0),
        RequestOutput(success=False, error="HTTP 500: boom", prompt_len=7, start_time=100.2),
    ]


def test_result_keys_are_vllms_and_the_numbers_follow_its_definitions(tmp_path: Path) -> None:
    r = compute_metrics(_outputs(), duration=2.0, t0=100.0)
    header = {k: None for k in VLLM_RESULT_KEYS[:9]}
    full = {**header, **r}
    assert set(VLLM_RESULT_KEYS) <= set(full)
    assert metric_keys(["ttft", "tpot", "itl", "e2el"], [99]) == VLLM_RESULT_KEYS[-16:]
    assert (r["completed"], r["failed"], r["total_input_tokens"], r["total_output_tokens"]) == (2, 1, 30, 6)
    assert r["output_lens"] == [4, 2, 0] and r["input_lens"] == [10, 20, 7] and r["errors"] == ["", "", "HTTP 500: boom"]
    assert r["request_throughput"] == pytest.approx(1.0) and r["output_throughput"] == pytest.approx(3.0)
    assert r["total_token_throughput"] == pytest.approx(18.0)
    assert r["mean_ttft_ms"] == pytest.approx(200.0) and r["median_ttft_ms"] == pytest.approx(200.0)
    assert r["std_ttft_ms"] == pytest.approx(100.0)  # population std, as numpy's
    assert r["p99_ttft_ms"] == pytest.approx(298.0)  # linear interpolation, as numpy.percentile
    assert r["mean_tpot_ms"] == pytest.approx((30.0 + 100.0) / 2)  # (latency - ttft) / (tokens - 1)
    assert r["mean_itl_ms"] == pytest.approx(47.5) and r["median_itl_ms"] == pytest.approx(35.0)
    assert r["ttfts"] == [0.1, 0.3, 0.0]  # seconds, as vLLM's
    assert r["max_concurrent_requests"] == 2.0 and r["cached_tokens_ratio"] == pytest.approx(5 / 30)
    table = format_summary({**full, "max_concurrency": 2, "request_rate": "inf"}, ["ttft", "tpot", "itl", "e2el"], [99])
    lines = table.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============" and lines[-1] == "=" * 50
    assert "Successful requests:                     2" in table and "P99 TTFT (ms):" in table
    assert "Maximum request concurrency:             2" in table

    brief = json.loads(Path(save_result(full, str(tmp_path / "r.json"), detailed=False)).read_text())
    assert not VLLM_DETAILED & set(brief) and "mean_ttft_ms" in brief
    detailed = json.loads(Path(save_result(full, str(tmp_path / "sub" / "d.json"), detailed=True)).read_text())
    assert set(VLLM_RESULT_KEYS) <= set(detailed)
    assert result_filename(None, "openai", float("inf"), 8, "org/Model-1", "20260101-000000") == \
        "openai-infqps-concurrency8-Model-1-20260101-000000.json"
    assert result_filename("run", "openai", 2.0, None, "m", "d") == "run-2.0qps-m-d.json"


# ---- real runs ----------------------------------------------------------------------------------------
def _chatserve(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`python -m chatserve *args`, a fork of the worker's warm interpreter (tests/helpers/prefork.py)."""
    with tempfile.TemporaryDirectory(prefix="chatserve-cli-") as out:
        return prefork.run(["-m", "chatserve", *args], env=os.environ, cwd=ROOT, timeout=timeout, out_dir=Path(out))


def test_bench_serve_against_a_live_server(shared_server, tmp_path: Path) -> None:
    common = ["bench", "serve", "--base-url", shared_server.url, "--api-key", SHARED_API_KEY, "--disable-tqdm",
              "--save-result", "--save-detailed", "--result-dir", str(tmp_path)]
    proc = _chatserve(*common, "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "4",
                      "--num-prompts", "4", "--max-concurrency", "2", "--request-rate", "50", "--seed", "1",
                      "--result-filename", "random.json", "--plot", str(tmp_path / "random.png"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "============ Serving Benchmark Result ============" in proc.stdout
    d = json.loads((tmp_path / "random.json").read_text())
    assert set(VLLM_RESULT_KEYS) <= set(d)
    assert (d["completed"], d["failed"], d["num_prompts"], d["max_concurrency"], d["request_rate"]) == (4, 0, 4, 2, 50.0)
    assert d["total_output_tokens"] == 4 * 4 and d["output_lens"] == [4] * 4  # ignore_eos: exactly the length asked
    assert d["ignore_eos"] is True and d["endpoint_type"] == "/v1/completions" and d["backend"] == "openai"
    assert all(t > 0 for t in d["ttfts"]) and all(len(g) >= 1 for g in d["itls"])
    assert all(10 <= n <= 24 for n in d["input_lens"])  # the server's usage.prompt_tokens for ~16-token prompts
    assert d["max_concurrent_requests"] <= 2
    assert (tmp_path / "random.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    proc = _chatserve(*common, "--dataset-name", "sessions", "--session-turns", "2", "--num-prompts", "4",
                      "--random-input-len", "40", "--session-turn-len", "10", "--random-output-len", "3", "--ignore-eos",
                      "--max-concurrency", "2", "--result-filename", "sessions.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    s = json.loads((tmp_path / "sessions.json").read_text())
    assert (s["completed"], s["total_output_tokens"], s["endpoint_type"]) == (4, 12, "sessions")
    # Turn 2 of each conversation reuses turn 1's KV through the session's token history.
    assert s["cached_tokens_ratio"] > 0

    proc = _chatserve(*common, "--dataset-name", "prefix", "--prefix-len", "100", "--prefix-question-len", "10",
                      "--random-output-len", "2", "--num-prompts", "3", "--endpoint", "chat", "--ignore-eos",
                      "--result-filename", "prefix.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    p = json.loads((tmp_path / "prefix.json").read_text())
    assert (p["completed"], p["total_output_tokens"], p["backend"]) == (3, 6, "openai-chat")
    shared_server.wait_idle()


def test_bench_serve_against_a_plain_openai_server(tmp_path: Path) -> None:
    """Only /v1/chat/completions and /v1/models, no usage: the chat endpoint works, output lengths come
    from the chunks; the sessions dataset and a missing endpoint fail at once with what is missing."""
    from tests.bench.test_bench_serving import _plain_openai_app, _serve

    url, srv, thread = _serve(_plain_openai_app())
    try:
        out = tmp_path / "plain.json"
        proc = _chatserve("bench", "serve", "--base-url", url, "--endpoint", "chat", "--num-prompts", "3",
                          "--random-input-len", "8", "--random-output-len", "5", "--disable-tqdm",
                          "--result-filename", str(out), timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        d = json.loads(out.read_text())
        assert (d["completed"], d["total_output_tokens"], d["model_id"]) == (3, 15, "plain-model")
        assert "input_lens" not in d  # not --save-detailed
        proc = _chatserve("bench", "serve", "--base-url", url, "--dataset-name", "sessions", "--num-prompts", "2",
                          timeout=60)
        assert proc.returncode == 2 and "session API" in proc.stderr and "sharegpt-like" in proc.stderr
        proc = _chatserve("bench", "serve", "--base-url", url, "--num-prompts", "2", timeout=60)  # /v1/completions
        assert proc.returncode == 2 and "first test request failed" in proc.stderr and "404" in proc.stderr
    finally:
        srv.should_exit = True
        thread.join(10)


def test_bench_latency_and_throughput_offline(tmp_path: Path) -> None:
    engine = ["--max-model-len", "128", "--num-threads", "1"]
    lat = tmp_path / "latency.json"
    proc = _chatserve("bench", "latency", "--input-len", "8", "--output-len", "4", "--batch-size", "2",
                      "--num-iters-warmup", "1", "--num-iters", "2", "--disable-tqdm", "--output-json", str(lat), *engine)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Avg latency:" in proc.stdout and "99% percentile latency:" in proc.stdout
    d = json.loads(lat.read_text())
    assert len(d["latencies"]) == 2 and set(d["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert d["avg_latency"] > 0

    thr = tmp_path / "throughput.json"
    proc = _chatserve("bench", "throughput", "--input-len", "8", "--output-len", "4", "--num-prompts", "3",
                      "--output-json", str(thr), *engine)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "requests/s" in proc.stdout and "output tokens/s" in proc.stdout
    t = json.loads(thr.read_text())
    assert (t["num_requests"], t["total_output_tokens"], t["total_num_tokens"]) == (3, 12, 3 * 8 + 12)
    assert t["requests_per_second"] > 0 and t["tokens_per_second"] > 0
