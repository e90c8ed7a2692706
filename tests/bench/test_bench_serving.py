"""benchmarks/serving/bench_serving.py, run briefly as a user would: against a real chatserve server, and against
a minimal OpenAI-compatible server without chatserve's extras (no usage details, metrics, cancel
endpoint or sessions), where it must degrade instead of failing."""

from __future__ import annotations

import importlib.util
import json
import os
import threading
from pathlib import Path

import pytest

from tests.helpers import prefork
from tests.helpers.net import free_port, wait_until
from tests.helpers.server import ROOT, ServerProcess, start_server

SCRIPT = ROOT / "benchmarks" / "serving" / "bench_serving.py"
DIST_KEYS = {"p50", "p90", "p99", "mean"}


def run_bench(base_url: str, tmp_path: Path, name: str, *args: str, timeout: float = 120) -> dict:
    """`python benchmarks/serving/bench_serving.py ...` as a user runs it (a fork of the warm fork server:
    tests/helpers/prefork.py), its JSON result."""
    out = tmp_path / f"{name}.json"
    proc = prefork.run([str(SCRIPT), "--base-url", base_url, "--json", str(out), "--no-progress", *args],
                       env=os.environ, cwd=ROOT, timeout=timeout, out_dir=tmp_path / f"{name}-output")
    assert proc.returncode == 0, f"bench_serving failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    assert "| metric" in proc.stdout  # the table
    return json.loads(out.read_text())


def check_common(d: dict, workload: str, num_requests: int, rates: bool = True) -> None:
    for key in ("ttft_ms", "itl_ms", "e2e_ms", "tpot_ms"):
        assert set(d[key]) == DIST_KEYS, key
    for key in ("output_tokens_per_s", "requests_per_s", "cached_token_ratio", "num_completed", "num_errors",
                "settings", "requests"):
        assert key in d, key
    assert d["num_errors"] == 0, d["errors"]
    assert d["num_requests"] == num_requests
    s = d["settings"]
    assert s["workload"] == workload and s["num_requests"] == num_requests and "seed" in s
    if rates:
        assert d["output_tokens_per_s"] > 0 and d["requests_per_s"] > 0


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    # NOTE: one compute thread: on a shared 2-core box two OpenMP threads slow down 10x or more as
    # soon as anything else runs; this test is about the client, not the server's speed.
    srv = start_server("--max-model-len", "2048", "--max-num-seqs", "8", "--num-threads", "1")
    yield srv
    srv.stop()


def test_shared_prefix_and_multi_turn_sessions_against_chatserve(server: ServerProcess, tmp_path: Path) -> None:
    d = run_bench(server.url, tmp_path, "sp", "--workload", "shared-prefix", "--num-requests", "4",
                  "--concurrency", "2", "--max-tokens", "4", "--prefix-tokens", "300", "--label", "cache on")
    check_common(d, "shared-prefix", 4)
    assert d["num_completed"] == 4
    assert d["settings"]["server_kind"] == "chatserve-metrics"
    assert all(d["ttft_ms"][k] > 0 for k in DIST_KEYS)
    assert d["itl_ms"]["p50"] > 0
    assert all(r["completion_tokens"] == 4 for r in d["requests"])  # ignore_eos honoured
    assert d["mean_prompt_tokens"] > 300
    # Four requests behind one ~300-token system prompt: most prompt tokens come from the cache.
    assert d["cached_token_ratio"] > 0.5
    assert d["server"]["prefix_cache_hits"] > 0

    m = run_bench(server.url, tmp_path, "mt", "--workload", "multi-turn", "--sessions", "--num-requests", "4",
                  "--turns", "2", "--concurrency", "2", "--max-tokens", "4", "--first-turn-tokens", "60",
                  "--turn-tokens", "20", "--seed", "0")
    check_common(m, "multi-turn", 4)
    assert m["settings"]["notes"] == []  # the session API was used
    turns = {b["turn"]: b for b in m["by_turn"]}
    assert set(turns) == {1, 2}
    assert turns[2]["cached_token_ratio"] > 0.6  # turn 2 reuses turn 1's KV through the session's tokens
    server.wait_idle()

    if importlib.util.find_spec("matplotlib") is not None:
        png = tmp_path / "p.png"
        proc = prefork.run([str(SCRIPT), "--side-by-side", str(tmp_path / "mt.json"), str(tmp_path / "sp.json"),
                            "--plot", str(png)], env=os.environ, cwd=ROOT, timeout=60, out_dir=tmp_path / "plot-output")
        assert proc.returncode == 0, proc.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_abort_storm_against_chatserve(server: ServerProcess, tmp_path: Path) -> None:
    d = run_bench(server.url, tmp_path, "abort", "--workload", "abort-storm", "--num-requests", "8",
                  "--concurrency", "4", "--max-tokens", "12", "--abort-fraction", "0.5",
                  "--random-input-min", "16", "--random-input-max", "64", "--seed", "3")
    check_common(d, "abort-storm", 8)
    a = d["abort"]
    assert a["issued"] == a["planned"] > 0
    assert d["num_completed"] + d["num_aborted"] == 8
    assert a["cancel_endpoint"] in ("used", "not used")
    sm = a["server_metrics"]
    assert sm is not None
    assert sm["freed"] <= a["issued"]
    assert sm["running_after"] == 0 and sm["waiting_after"] == 0
    assert sm["idle_after_last_client_ms"] is not None
    server.wait_idle()


# ---- a plain OpenAI-compatible server without chatserve's extras --------------------------------------
class RequestLog:
    """What the plain server saw: every chat body, and the most chat streams open at once."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.open = 0
        self.max_open = 0


def _plain_openai_app(log: RequestLog | None = None):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    log = log or RequestLog()

    async def chat(request):
        body = await request.json()
        n = int(body.get("max_tokens") or 4)
        log.bodies.append(body)

        async def events():
            import asyncio

            log.open += 1
            log.max_open = max(log.max_open, log.open)
            try:
                for i in range(n):
                    await asyncio.sleep(0.005)
                    chunk = {"id": "x", "object": "chat.completion.chunk", "choices": [
                        {"index": 0, "delta": {"content": f" w{i}"}, "finish_reason": None}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
            finally:
                log.open -= 1
            done = {"id": "x", "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
            yield f"data: {json.dumps(done)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "plain-model", "object": "model"}]})

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/models", models)])


def _serve(app):
    import uvicorn

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    wait_until(lambda: srv.started, 20, "uvicorn to start")
    return f"http://127.0.0.1:{port}", srv, thread


@pytest.fixture()
def plain_server():
    url, srv, thread = _serve(_plain_openai_app())
    yield url
    srv.should_exit = True
    thread.join(10)


@pytest.fixture()
def recording_server():
    log = RequestLog()
    url, srv, thread = _serve(_plain_openai_app(log))
    yield url, log
    srv.should_exit = True
    thread.join(10)


def test_degrades_on_a_plain_openai_server(plain_server: str, tmp_path: Path) -> None:
    d = run_bench(plain_server, tmp_path, "plain", "--workload", "random", "--num-requests", "6",
                  "--concurrency", "3", "--max-tokens", "8")
    check_common(d, "random", 6)
    assert d["cached_token_ratio"] is None  # the server reports no usage at all
    assert d["server"] is None and d["settings"]["server_kind"] == "openai-compatible"
    assert d["settings"]["model"] == "plain-model"

    m = run_bench(plain_server, tmp_path, "plain-mt", "--workload", "multi-turn", "--sessions", "--num-requests", "4",
                  "--turns", "2", "--concurrency", "2", "--max-tokens", "4")
    check_common(m, "multi-turn", 4)
    assert any("no session API" in n for n in m["settings"]["notes"])

    a = run_bench(plain_server, tmp_path, "plain-abort", "--workload", "abort-storm", "--num-requests", "8",
                  "--concurrency", "4", "--max-tokens", "20", "--abort-fraction", "1.0", "--abort-mode", "cancel")
    check_common(a, "abort-storm", 8, rates=False)
    assert a["num_completed"] == 0 and a["num_aborted"] == 8
    assert a["abort"]["issued"] == 8 and a["abort"]["issued_by_mode"]["disconnect"] == 8
    assert a["abort"]["cancel_endpoint"].startswith("unsupported")
    assert a["abort"]["server_metrics"] is None


def test_fixed_and_ttft_workloads(recording_server: tuple[str, RequestLog], tmp_path: Path) -> None:
    url, log = recording_server
    d = run_bench(url, tmp_path, "fixed", "--workload", "fixed", "--num-requests", "6", "--concurrency", "3",
                  "--prompt-tokens", "80", "--max-tokens", "5", "--warmup", "0")
    check_common(d, "fixed", 6)
    assert d["num_completed"] == 6 and all(r["num_chunks"] == 5 for r in d["requests"])  # exactly max_tokens
    assert log.max_open == 3  # all at the concurrency asked for
    # The burst's slowest first token came after every other request's and before the run ended.
    assert max(r["ttft_ms"] for r in d["requests"]) <= d["all_first_tokens_ms"] <= d["duration_s"] * 1e3
    assert d["decode_tokens_per_s"] == pytest.approx(1e3 / d["tpot_ms"]["p50"], rel=0.01)

    # No two prompts of a run, nor of two runs with the same seed, start alike: a prefix cache cannot help.
    first = [b["messages"][0]["content"] for b in log.bodies]
    assert len(set(first)) == 6 and all(b["messages"][0]["role"] == "system" for b in log.bodies)
    assert all(b["max_tokens"] == 5 and b["ignore_eos"] is True for b in log.bodies)
    fixed_texts = {b["messages"][1]["content"] for b in log.bodies}
    assert len(fixed_texts) == 6
    assert all(300 < len(w) < 600 for w in fixed_texts)  # ~80 tokens of ~4.9 characters

    log.bodies.clear()
    log.max_open = 0
    t = run_bench(url, tmp_path, "ttft", "--workload", "ttft", "--num-requests", "3", "--concurrency", "4",
                  "--prompt-tokens", "80", "--max-tokens", "2", "--warmup", "0")
    check_common(t, "ttft", 3)
    assert log.max_open == 1  # one at a time whatever --concurrency says, and the run says so
    assert any("one request at a time" in n for n in t["settings"]["notes"])
    assert t["ttft_ms_min"] == min(r["ttft_ms"] for r in t["requests"])
    assert t["ttft_ms_min"] <= t["ttft_ms"]["p50"]
    assert not {b["messages"][0]["content"] for b in log.bodies} & set(first)  # a new run id, new prompts
    # The same seed gives the same text after the distinct system message.
    assert {b["messages"][1]["content"] for b in log.bodies} <= fixed_texts
