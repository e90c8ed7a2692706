#!/usr/bin/env python
"""Do JSON replies run away on whitespace? (issue #35)

Against a live OpenAI-compatible server (``--base-url``; without it this script starts a
``chatserve serve`` with the default model and stops it at the end), sends ``--n`` seeded requests
(seed 0..n-1) for each of ``response_format: json_object`` and ``json_schema`` with a prompt that asks
for a short object (a city and its country), temperature 1.0, max_tokens 64, all in flight together,
and reports per format: how many replies parse as JSON (and, for json_schema, validate), the
finish_reason counts, how many contain a run of 3 or more newlines, the longest whitespace run
outside strings, and the mean number of output tokens.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/serving/probe_json_whitespace.py --out probe.json
    .venv/bin/python benchmarks/serving/probe_json_whitespace.py --base-url http://127.0.0.1:8000 --model NAME
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from chatserve.structured.config import whitespace_runs

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
          "required": ["city", "country"], "additionalProperties": False}
# NOTE: the prompt names neither JSON nor the keys (response_format alone asks for JSON), as a client
# that relies on the grammar does; KEYS_PROMPT (--prompt) is the well-specified variant.
PROMPT = "Name a city and its country."
KEYS_PROMPT = "Name one city and its country. Reply with a JSON object with the keys city and country."
FORMATS: dict[str, dict[str, Any]] = {
    "json_object": {"type": "json_object"},
    "json_schema": {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str, str]:
    port = _free_port()
    log = tempfile.mkstemp(prefix="probe-json-ws-", suffix=".log")[1]
    args = [sys.executable, "-m", "chatserve", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", "2048", "--log-level", "warning", *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("CHATSERVE_API_KEY", None)
    with open(log, "wb") as fh:
        proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; log: {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"server did not start; log: {log}")


def one(url: str, model: str | None, fmt: dict[str, Any], seed: int, max_tokens: int, extra: dict[str, Any],
        prompt: str = PROMPT) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}], "response_format": fmt,
                            "temperature": 1.0, "seed": seed, "max_tokens": max_tokens, **extra}
    if model:
        body["model"] = model
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    data = r.json()
    choice = data["choices"][0]
    return {"seed": seed, "content": choice["message"].get("content") or "", "finish_reason": choice["finish_reason"],
            "completion_tokens": data["usage"]["completion_tokens"]}


def parses(text: str, kind: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if kind == "json_schema":
        import jsonschema

        try:
            jsonschema.validate(value, SCHEMA)
        except jsonschema.ValidationError:
            return False
        return True
    return isinstance(value, dict)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", help="a running server (default: start chatserve serve with the default model)")
    ap.add_argument("--model", help="model name to send (default: none, the server's own)")
    ap.add_argument("--n", type=int, default=16, help="seeded requests per format")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--server-arg", action="append", default=[], help="extra flag for the started server (repeatable)")
    ap.add_argument("--extra-body", default="{}", help="JSON merged into every request body")
    ap.add_argument("--prompt", default=PROMPT, help="the user message (default: %(default)r)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    extra = json.loads(args.extra_body)
    proc = None
    url = args.base_url
    if url is None:
        proc, url, log = start_server(args.server_arg)
        print(f"started chatserve at {url} (log {log})", file=sys.stderr)
    results: dict[str, Any] = {"max_tokens": args.max_tokens, "n": args.n, "temperature": 1.0, "prompt": args.prompt,
                               "extra_body": extra, "formats": {}}
    try:
        for kind, fmt in FORMATS.items():
            with ThreadPoolExecutor(args.n) as pool:
                replies = list(pool.map(lambda s, f=fmt: one(url, args.model, f, s, args.max_tokens, extra, args.prompt),
                                        range(args.n)))
            ok = [parses(r["content"], kind) for r in replies]
            newline_runs = [bool(re.search(r"\n\s*\n\s*\n", r["content"])) for r in replies]
            row = {
                "parsed": sum(ok),
                "of": len(replies),
                "finish_reasons": dict(Counter(r["finish_reason"] for r in replies)),
                "with_3plus_newline_runs": sum(newline_runs),
                "longest_whitespace_run": max((max(whitespace_runs(r["content"]), default=0) for r in replies), default=0),
                "mean_output_tokens": round(sum(r["completion_tokens"] for r in replies) / len(replies), 1),
                "replies": replies,
            }
            results["formats"][kind] = row
            print(f"{kind:12s} parsed {row['parsed']}/{row['of']}  finish {row['finish_reasons']}  "
                  f">=3-newline runs {row['with_3plus_newline_runs']}  longest ws run {row['longest_whitespace_run']}  "
                  f"mean tokens {row['mean_output_tokens']}")
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
