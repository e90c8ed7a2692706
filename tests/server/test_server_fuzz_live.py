"""benchmarks/serving/fuzz_server.py against a live `chatserve serve`: its quick run (~200 hostile requests on every
route, each followed by a request on the same connection) gets no 5xx, no connection reset, no timeout
and no error outside the API's shape, the server serves normally afterwards and its log has no
traceback. Also on the live server: --limit-concurrency answers past the limit with a 503 in OpenAI's
shape, and the Host check of a loopback-bound server."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest

from tests.helpers.errors import assert_error
from tests.helpers.server import ROOT, ServerProcess, start_server

pytestmark = pytest.mark.timeout(600)

LIMIT = 12  # --limit-concurrency of the server below


def _fuzz_module() -> Any:
    spec = importlib.util.spec_from_file_location("fuzz_server", ROOT / "benchmarks" / "serving" / "fuzz_server.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_server"] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def server():
    srv = start_server("--max-model-len", "1024", "--max-num-seqs", "4", "--limit-concurrency", str(LIMIT), "--no-web")
    yield srv
    code = srv.stop()
    log = srv.log()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-8000:]


def test_the_quick_fuzz_run_finds_nothing(server: ServerProcess) -> None:
    fuzz = _fuzz_module()
    cases = fuzz.all_cases(quick=True)
    assert len(cases) >= 150
    groups = {c.group for c in cases}
    assert groups >= {"chat", "completions", "tokenize", "sessions", "responses", "cancel", "resume", "models",
                      "messages", "headers"}
    paths = " ".join(c.path for c in cases)
    for route in ("/v1/messages/count_tokens", "/detokenize", "/v1/requests/", "/stream", "/input_items", "/fork",
                  "/regenerate"):
        assert route in paths, route
    summary = fuzz.Runner(server.url, None, 60.0).run(cases)
    fuzz.print_summary(summary)
    d = summary.as_dict()
    assert d["requests"] == len(cases)
    assert summary.failures == [], "\n".join(f"{f.kind}: {f.case}\n  -> {f.detail}" for f in summary.failures)
    assert summary.healthy_after, summary.after_notes
    assert "Traceback" not in server.log(), server.log()[-8000:]


def test_past_the_connection_limit_new_requests_get_a_503_in_openais_shape(server: ServerProcess) -> None:
    idle = []
    try:
        for _ in range(LIMIT):
            idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=10))
        with httpx.Client(timeout=30) as client:
            resp = client.get(f"{server.url}/v1/models")
        err = assert_error(resp, 503, code="too_many_connections")
        assert "--limit-concurrency" in err["message"] and resp.headers["retry-after"] == "1"
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 30
    while True:  # the closed connections leave uvicorn's count as their close is seen
        with httpx.Client(timeout=30) as client:
            if client.get(f"{server.url}/v1/models").status_code == 200:
                break
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_rebinding_host_is_refused_and_loopback_names_are_not(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        assert_error(client.get("/v1/sessions", headers={"Host": f"evil.example:{server.port}"}), 403,
                     code="host_not_allowed")
        for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}"):
            assert client.get("/v1/sessions", headers={"Host": host}).status_code == 200


def test_the_script_lists_its_cases_from_the_command_line() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serving" / "fuzz_server.py"), "--list"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.strip().splitlines()[-1].split()[0]) >= 400  # the full run
