"""The Claude Code CLI in tests: where set-up installed it, how to run it headless against a server, and
the request it sends (captured once into tests/fixtures/claude_code_request.json, replayed by the tests).

- `claude_binary()`: the launcher scripts/install_claude_code.sh wrote (.cache/claude-code/bin/claude),
  or a clear failure saying how to install it (a missing CLI fails the tests, it never skips them).
- `run_claude(...)`: `claude -p` with its own HOME and working directory, offline (no updater, no
  telemetry), `ANTHROPIC_BASE_URL` the server under test.
- `CaptureServer`: a tiny local HTTP server that records every request; it answers `/v1/messages` with a
  fixed reply (so a conversation goes on to a second turn) or with 404.
- The fixture: `load_fixture()`; `with_cch(body)`, the same request with a per-request `cch=` hash in the
  billing header (what other Claude Code set-ups send); `next_turn(...)`, turn 2 built the way Claude
  Code built its captured turn 2.

Regenerate the fixture (needs the CLI: scripts/install_claude_code.sh):

    .venv/bin/python -m tests.helpers.claude_code capture
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CLAUDE_CODE_VERSION = "2.1.328"
CLAUDE_CODE_DIR = Path(os.environ.get("CLAUDE_CODE_DIR") or ROOT / ".cache" / "claude-code")
FIXTURE = ROOT / "tests" / "fixtures" / "claude_code_request.json"
BILLING_PREFIX = "x-anthropic-billing-header:"
# The headers of a captured request that a server may read; the rest (Stainless' client facts, Host,
# Content-Length, the key) are not kept.
KEPT_HEADERS = ("anthropic-version", "anthropic-beta", "content-type", "accept", "user-agent", "x-app",
                "anthropic-dangerous-direct-browser-access")
# Where the capture runs Claude Code: fixed, so the environment block it sends is the same at every capture.
CAPTURE_DIR = Path(tempfile.gettempdir()) / "claude-code-capture"
SCRUBBED_SESSION = "00000000-0000-4000-8000-000000000000"
SCRUBBED_DEVICE = "0" * 64


class ClaudeCodeMissing(RuntimeError):
    pass


def claude_binary() -> Path:
    """The installed CLI, checked to be the pinned version; raises (a test failure) with the fix if not."""
    launcher = CLAUDE_CODE_DIR / "bin" / "claude"
    how = ("install it with scripts/install_claude_code.sh (make setup-redis and make test run it; it needs the "
           "npm registry)")
    if not launcher.exists():
        raise ClaudeCodeMissing(f"the Claude Code CLI {CLAUDE_CODE_VERSION} is not installed at {launcher}: {how}")
    try:
        out = subprocess.run([str(launcher), "--version"], capture_output=True, text=True, timeout=60,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ClaudeCodeMissing(f"{launcher} --version failed ({e}): {how}") from e
    if not out.stdout.startswith(CLAUDE_CODE_VERSION + " "):
        raise ClaudeCodeMissing(f"{launcher} --version says {out.stdout.strip() or out.stderr.strip()!r}, not "
                                f"{CLAUDE_CODE_VERSION}: {how}")
    return launcher


def claude_env(base_url: str, home: Path, api_key: str = "dummy", **extra: str) -> dict[str, str]:
    """The environment Claude Code runs in: nothing of the caller's own (no real key, config or proxy), its
    own HOME, offline. `extra` adds variables (CLAUDE_CODE_MAX_OUTPUT_TOKENS, ANTHROPIC_MODEL, ...)."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": api_key,
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "NO_PROXY": "127.0.0.1,localhost",
    }
    env.update(extra)
    return env


def run_claude(args: list[str], *, base_url: str, home: Path, cwd: Path, timeout: float = 240,
               api_key: str = "dummy", **extra_env: str) -> subprocess.CompletedProcess:
    """`claude ARGS` headless (stdin closed); the caller checks the return code and the output."""
    home.mkdir(parents=True, exist_ok=True)
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run([str(claude_binary()), *args], cwd=cwd, env=claude_env(base_url, home, api_key, **extra_env),
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


# ---- a capture server ------------------------------------------------------------------------------------
def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


class CaptureServer:
    """Records every request (method, path with query, headers, JSON body) on 127.0.0.1 and a free port.

    `reply=None` answers everything 404 in Anthropic's error shape; a string answers `POST /v1/messages`
    with that text as a complete Messages reply (SSE when the request streams), so that a client goes on
    to its next turn. Use as a context manager; `requests` is the list, oldest first.
    """

    def __init__(self, reply: str | None = None):
        self.reply = reply
        self.requests: list[dict[str, Any]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _any(self) -> None:
                n = int(self.headers.get("content-length") or 0)
                raw = self.rfile.read(n) if n else b""
                try:
                    body: Any = json.loads(raw) if raw else None
                except ValueError:
                    body = raw.decode(errors="replace")
                outer.requests.append({"method": self.command, "path": self.path,
                                       "headers": dict(self.headers.items()), "body": body})
                if (outer.reply is not None and self.command == "POST" and self.path.split("?")[0] == "/v1/messages"
                        and isinstance(body, dict)):
                    self._answer(body)
                else:
                    self._send(404, "application/json", json.dumps(
                        {"type": "error", "error": {"type": "not_found_error", "message": f"capture: {self.path}"}}).encode())

            def _answer(self, body: dict[str, Any]) -> None:
                text = outer.reply or ""
                n = len(outer.requests)
                message = {"id": f"msg_capture{n}", "type": "message", "role": "assistant",
                           "model": body.get("model", "capture"), "content": [], "stop_reason": None,
                           "stop_sequence": None,
                           "usage": {"input_tokens": 10, "output_tokens": 1, "cache_read_input_tokens": 0,
                                     "cache_creation_input_tokens": 0}}
                if not body.get("stream"):
                    full = {**message, "content": [{"type": "text", "text": text}], "stop_reason": "end_turn",
                            "usage": {**message["usage"], "output_tokens": 5}}
                    self._send(200, "application/json", json.dumps(full).encode())
                    return
                frames = b"".join([
                    _sse("message_start", {"type": "message_start", "message": message}),
                    _sse("content_block_start", {"type": "content_block_start", "index": 0,
                                                 "content_block": {"type": "text", "text": ""}}),
                    _sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                 "delta": {"type": "text_delta", "text": text}}),
                    _sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
                    _sse("message_delta", {"type": "message_delta",
                                           "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                                           "usage": {"output_tokens": 5}}),
                    _sse("message_stop", {"type": "message_stop"}),
                ])
                self._send(200, "text/event-stream", frames)

            def _send(self, status: int, ctype: str, data: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(data)))
                self.send_header("request-id", "req_capture")
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _any

            def log_message(self, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> CaptureServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def messages_requests(self) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["method"] == "POST" and r["path"].split("?")[0] == "/v1/messages"]


# ---- the fixture ---------------------------------------------------------------------------------------
def scrub(request: dict[str, Any]) -> dict[str, Any]:
    """What of a captured request the fixture keeps: the headers a server may read (not the key), the path with
    its query, and the body with the per-install ids (device, session) and the host's kernel version fixed."""
    headers = {k.lower(): v for k, v in request["headers"].items() if k.lower() in KEPT_HEADERS}
    text = json.dumps(request["body"])
    session = request["headers"].get("X-Claude-Code-Session-Id") or request["headers"].get("x-claude-code-session-id")
    if session:
        text = text.replace(session, SCRUBBED_SESSION)
    text = re.sub(r'(\\"device_id\\":\\")[0-9a-f]+', rf"\g<1>{SCRUBBED_DEVICE}", text)
    text = re.sub(r"(OS Version: )[^\\]*", r"\g<1>Linux 6.1.0", text)
    text = re.sub(r"sk-ant-[A-Za-z0-9_-]+", "sk-ant-scrubbed", text)
    return {"method": request["method"], "path": request["path"], "headers": headers, "body": json.loads(text)}


def capture(out: Path = FIXTURE, reply: str = "Hello! How can I help you today?") -> dict[str, Any]:
    """Run `claude -p "hello"` then `claude -p --continue "thanks"` against a capture server answering `reply`,
    and write both `/v1/messages` requests, scrubbed, to `out`."""
    import shutil

    shutil.rmtree(CAPTURE_DIR, ignore_errors=True)
    home, work = CAPTURE_DIR / "home", CAPTURE_DIR / "work"
    with CaptureServer(reply=reply) as cap:
        first = run_claude(["-p", "hello"], base_url=cap.url, home=home, cwd=work, timeout=120)
        n_first = len(cap.messages_requests())
        second = run_claude(["-p", "--continue", "thanks"], base_url=cap.url, home=home, cwd=work, timeout=120)
    reqs = cap.messages_requests()
    if first.returncode or second.returncode or n_first < 1 or len(reqs) <= n_first:
        raise RuntimeError(f"capture failed: rc {first.returncode}/{second.returncode}, {len(cap.requests)} requests\n"
                           f"{first.stdout}{first.stderr}\n{second.stdout}{second.stderr}")
    fixture = {
        "about": (f"The first /v1/messages request of `claude -p \"hello\"` (Claude Code {CLAUDE_CODE_VERSION}, "
                  "ANTHROPIC_BASE_URL a local capture server, ANTHROPIC_API_KEY=dummy, its own HOME, "
                  "DISABLE_AUTOUPDATER=1, CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1), and the first of the next "
                  "turn, `claude -p --continue \"thanks\"`, after the server answered `assistant_reply`. Device and "
                  "session ids and the kernel version scrubbed; written by `python -m tests.helpers.claude_code "
                  "capture`."),
        "claude_code_version": CLAUDE_CODE_VERSION,
        # Claude Code writes its HOME and working directory into the prompt (its memory folder in the system
        # prompt, the working directory in the environment block): `relocate` moves them.
        "capture_home": str(home),
        "capture_cwd": str(work),
        "assistant_reply": reply,
        "turn1": scrub(reqs[0]),
        "turn2": scrub(reqs[n_first]),
        "other_requests": [{"method": r["method"], "path": r["path"]} for r in cap.requests
                           if r not in (reqs[0], reqs[n_first])],
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
    return fixture


def load_fixture() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


def project_slug(cwd: Path | str) -> str:
    """The folder name Claude Code keeps a working directory's sessions and memory under (~/.claude/projects/)."""
    return re.sub(r"[^A-Za-z0-9]", "-", str(cwd))


def relocate(fixture: dict[str, Any], home: Path, cwd: Path) -> dict[str, Any]:
    """The captured requests as Claude Code would send them with HOME `home`, run in `cwd`: the paths it writes into
    its prompt (the memory folder in the system prompt, the working directory in the environment block) moved, so
    that a replay and a live CLI run in that directory share their prompt up to the environment block."""
    text = json.dumps(fixture)
    for old, new in ((fixture["capture_home"], str(home)), (project_slug(fixture["capture_cwd"]), project_slug(cwd)),
                     (fixture["capture_cwd"], str(cwd))):
        text = text.replace(json.dumps(old)[1:-1], json.dumps(new)[1:-1])
    return json.loads(text)


_cch_counter = itertools.count()


def with_cch(body: dict[str, Any], salt: str = "") -> dict[str, Any]:
    """`body` with a per-request `cch=<5 hex>;` added to the billing header (the first system block), as the
    Claude Code set-ups that sign each request send it: a different hash on every call."""
    out = copy.deepcopy(body)
    first = out["system"][0]
    assert first["text"].startswith(BILLING_PREFIX), first
    n = next(_cch_counter)
    cch = hashlib.sha256(f"{salt}{n}{os.getpid()}{json.dumps(body)[:256]}".encode()).hexdigest()[:5]
    first["text"] = re.sub(r"\s*cch=[0-9a-f]+;", "", first["text"]).rstrip() + f" cch={cch};"
    return out


def reply_blocks(content: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A reply's content blocks as a client sends them back in the next turn: each block's own fields only, empty
    text blocks left out, "(no content)" (Claude Code's stand-in) when nothing is left."""
    keep = {"text": ("text",), "tool_use": ("id", "name", "input"), "thinking": ("thinking", "signature"),
            "redacted_thinking": ("data",)}
    out = []
    for block in content:
        if block["type"] == "text" and not block["text"]:
            continue
        out.append({"type": block["type"], **{k: block[k] for k in keep.get(block["type"], ()) if k in block}})
    return out or [{"type": "text", "text": "(no content)"}]


def next_turn(fixture: dict[str, Any], turn1_body: dict[str, Any], reply_content: list[dict[str, Any]],
              user_text: str) -> dict[str, Any]:
    """Turn 2 of the conversation `turn1_body` began, built as Claude Code built its captured turn 2: its
    messages are the captured turn 2's with the captured assistant reply replaced by `reply_content` (the
    server's real reply, through `reply_blocks`) and the last user text by `user_text`, after a `tool_result`
    for each `tool_use` the reply made; the rest of the request (system, tools, parameters) is turn 1's, and a
    turn 1 with a `cch=` hash gets a new one (`with_cch`)."""
    captured = copy.deepcopy(fixture["turn2"]["body"])
    canned = fixture["assistant_reply"]
    reply = reply_blocks(reply_content)
    messages = []
    replaced = False
    for m in captured["messages"]:
        if m["role"] == "assistant" and _text_of(m["content"]) == canned and not replaced:
            messages.append({"role": "assistant", "content": reply})
            replaced = True
        else:
            messages.append(m)
    assert replaced, "the captured turn 2 does not hold the capture server's reply"
    last = messages[-1]
    assert last["role"] == "user", last
    if isinstance(last["content"], str):
        last["content"] = [{"type": "text", "text": user_text}]
    else:
        texts = [b for b in last["content"] if b.get("type") == "text"]
        texts[-1]["text"] = user_text
    results = [{"type": "tool_result", "tool_use_id": b["id"], "content": "(not run in this test)"}
               for b in reply if b["type"] == "tool_use"]
    last["content"] = results + last["content"]
    body = copy.deepcopy(turn1_body)
    body["messages"] = messages
    if "cch=" in turn1_body["system"][0]["text"]:
        body = with_cch(body, salt="turn2")
    return body


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(b.get("text", "") for b in content if b.get("type") == "text")


if __name__ == "__main__":
    if sys.argv[1:] != ["capture"]:
        sys.exit("usage: python -m tests.helpers.claude_code capture")
    fx = capture()
    print(f"wrote {FIXTURE}: turn1 {len(json.dumps(fx['turn1']['body']))} bytes, "
          f"turn2 {len(json.dumps(fx['turn2']['body']))} bytes, other requests {fx['other_requests']}")


# ---- reading a Messages stream ---------------------------------------------------------------------------
def messages_sse(lines: Any) -> list[tuple[str, dict[str, Any]]]:
    """(event, data) per SSE frame of a `/v1/messages` stream, from its raw lines, checking Anthropic's framing:
    every frame has an `event:` line naming the `type` of its JSON `data:` (the Python SDK dispatches on the
    event name), and there is no OpenAI-style `[DONE]`. Comment lines are skipped."""
    frames: list[tuple[str, dict[str, Any]]] = []
    event: str | None = None
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                payload = "\n".join(data)
                assert payload != "[DONE]", "a Messages stream ends with message_stop, never [DONE]"
                assert event is not None, f"a data frame without its event: line: {payload[:200]}"
                obj = json.loads(payload)
                assert obj.get("type") == event, f"event: {event} carries data of type {obj.get('type')!r}"
                frames.append((event, obj))
            elif event is not None:
                raise AssertionError(f"event: {event} without data")
            event, data = None, []
        elif line.startswith(":"):
            continue
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
        else:
            assert line.startswith(("id:", "retry:")), f"unexpected SSE line {line!r}"
    return frames


def assemble(frames: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The message a stream describes, as a client assembles it: the `message_start` message with its content
    blocks filled from the block events (text and thinking appended, tool input JSON parsed from its deltas),
    `stop_reason` / `stop_sequence` and the final usage from `message_delta`. Checks the order of events."""
    kinds = [e for e, _ in frames if e != "ping"]
    assert kinds and kinds[0] == "message_start", kinds[:3]
    assert kinds[-1] == "message_stop", kinds[-3:]
    assert kinds.count("message_delta") == 1 and kinds[-2] == "message_delta", kinds[-4:]
    message = copy.deepcopy(frames[[e for e, _ in frames].index("message_start")][1]["message"])
    start_usage = dict(message["usage"])
    blocks: dict[int, dict[str, Any]] = {}
    partial_json: dict[int, str] = {}
    open_blocks: set[int] = set()
    for event, data in frames:
        if event == "content_block_start":
            i = data["index"]
            assert i not in blocks, f"block {i} started twice"
            blocks[i] = copy.deepcopy(data["content_block"])
            open_blocks.add(i)
        elif event == "content_block_delta":
            i, delta = data["index"], data["delta"]
            assert i in open_blocks, f"a delta for block {i}, which is not open"
            if delta["type"] == "text_delta":
                blocks[i]["text"] += delta["text"]
            elif delta["type"] == "input_json_delta":
                partial_json[i] = partial_json.get(i, "") + delta["partial_json"]
            elif delta["type"] == "thinking_delta":
                blocks[i]["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                blocks[i]["signature"] = delta["signature"]
        elif event == "content_block_stop":
            assert data["index"] in open_blocks
            open_blocks.discard(data["index"])
        elif event == "message_delta":
            message["stop_reason"] = data["delta"]["stop_reason"]
            message["stop_sequence"] = data["delta"].get("stop_sequence")
            message["usage"] = {**message["usage"], **data["usage"]}
    assert not open_blocks, f"blocks never stopped: {open_blocks}"
    assert sorted(blocks) == list(range(len(blocks))), sorted(blocks)
    for i, text in partial_json.items():
        blocks[i]["input"] = json.loads(text) if text else {}
    message["content"] = [blocks[i] for i in sorted(blocks)]
    message["start_usage"] = start_usage
    return message


def cached_fraction(usage: dict[str, Any]) -> float:
    """The share of the prompt read from the cache, as Anthropic counts it: `input_tokens` excludes cached tokens,
    so the prompt is input + cache reads + cache writes."""
    read = usage.get("cache_read_input_tokens") or 0
    total = (usage.get("input_tokens") or 0) + read + (usage.get("cache_creation_input_tokens") or 0)
    return read / total if total else 0.0
