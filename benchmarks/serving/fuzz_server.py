#!/usr/bin/env python
"""Hostile and malformed requests against a live chatserve, on every route, as a hostile client would
send them; then checks the server still serves normally.

Every answer must be a 2xx or a 4xx in the API's own error shape (OpenAI's `{"error": {...}}`;
Anthropic's `{"type": "error", ...}` on /v1/messages). Counted as failures: 5xx answers, connection
resets (a request whose connection broke, or the *next* request on a connection the server closed
after an exception escaped to uvicorn), timeouts, and 4xx bodies not in the error shape. After the
run: /health is ok, a normal chat reply comes back, nothing is left running, and the KV cache passes
its integrity check (/debug/cache).

    python -m chatserve serve --port 8011 &
    python benchmarks/serving/fuzz_server.py --url http://127.0.0.1:8011            # every case (~500)
    python benchmarks/serving/fuzz_server.py --url http://127.0.0.1:8011 --quick    # a cheap subset (~200)
    python benchmarks/serving/fuzz_server.py --url ... --json out.json              # the summary as JSON too

Exit status 0 when nothing failed. Each failure is printed with its exact request, so it can be
replayed with curl. The cases are fixed (no randomness): two runs send the same bytes.
"""

from __future__ import annotations

import argparse
import collections
import json
import socket
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

CHAT_OK = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION_OK = {"prompt": "Hi", "max_tokens": 2}
MESSAGES_OK = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
RESPONSES_OK = {"input": "Hi", "max_output_tokens": 2}


@dataclass
class Case:
    group: str  # the route family, for the summary
    method: str
    path: str
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    expect: tuple[int, ...] | None = None  # statuses this case must get (None: any 2xx or 4xx)
    anthropic: bool = False  # errors in Anthropic's shape
    slow: bool = False  # may take seconds even when handled well; left out of --quick
    raw: bytes | None = None  # sent as these bytes over a fresh socket instead (headers httpx refuses)

    def describe(self) -> str:
        if self.raw is not None:
            return f"raw bytes over a socket: {self.raw[:300]!r}{'...' if len(self.raw) > 300 else ''}"
        body = "" if self.body is None else f" body={self.body[:300]!r}{'...' if len(self.body) > 300 else ''}" \
            f" ({len(self.body)} bytes)"
        hdrs = f" headers={self.headers}" if self.headers else ""
        return f"{self.method} {self.path}{hdrs}{body}"


def js(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def with_raw(base: dict[str, Any], key: str, raw: str) -> bytes:
    """`base` as JSON with `"key": raw` spliced in verbatim (NaN, 400-digit numbers, bad escapes)."""
    return (json.dumps(base)[:-1] + f', "{key}": {raw}}}').encode()


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def nested_json_text(depth: int) -> str:
    return "[" * depth + "]" * depth


def tool(params: Any, name: str = "f") -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": params}}


# ---- the cases ------------------------------------------------------------------------------------------
def body_cases() -> list[tuple[str, bytes]]:
    """Bodies no JSON route should take: (label, bytes)."""
    return [
        ("empty", b""), ("spaces", b"   "), ("null", b"null"), ("array", b"[]"), ("string", b'"x"'),
        ("number", b"1e400"), ("NaN", b"NaN"), ("truncated", b'{"messages": [{"role": "us'),
        ("bad utf-8", b'{"x": "\xff\xfe"}'), ("overlong utf-8", b'{"x": "\xc0\xaf"}'),
        ("surrogate bytes", b'{"x": "\xed\xa0\x80"}'), ("utf-16", json.dumps(CHAT_OK).encode("utf-16")),
        ("bom", b"\xef\xbb\xbf" + js(CHAT_OK)), ("nul", b'{"x": "a\x00b"}'),
        ("deep arrays", b"[" * 100_000), ("deep objects", b'{"a":' * 50_000 + b"1" + b"}" * 50_000),
        ("trailing garbage", js(CHAT_OK) + b"garbage"), ("two objects", js(CHAT_OK) + js(CHAT_OK)),
    ]


def chat_cases(quick: bool) -> Iterator[Case]:
    p = "/v1/chat/completions"
    g = "chat"
    for _label, body in body_cases():
        yield Case(g, "POST", p, body)
    fields = [
        ("messages", '"hi"'), ("messages", "[]"), ("messages", '[{"role": "robot", "content": "x"}]'),
        ("messages", '[{"role": "user"}]'), ("messages", '[{"role": "user", "content": 5}]'),
        ("messages", '[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]'),
        ("messages", '[{"role": "user", "content": "\\ud800"}]'), ("messages", '[{"role": "user", "content": "\\udfff\\ud800"}]'),
        ("messages", '[{"role": "assistant", "content": null, "tool_calls": [{"id": "1", "type": "function", '
                     '"function": {"name": "f", "arguments": "\\"\\\\ud800\\""}}]}, {"role": "user", "content": "x"}]'),
        ("messages", '[{"role": "assistant", "content": null, "tool_calls": [{"id": "1", "type": "function", '
                     '"function": {"name": "f", "arguments": "' + "[" * 5000 + "]" * 5000 + '"}}]}, '
                     '{"role": "user", "content": "x"}]'),
        ("messages", '[{"role": "tool", "content": "x", "tool_call_id": 5}]'),
    ]
    for key, raw in fields:
        yield Case(g, "POST", p, with_raw({"max_tokens": 2}, key, raw))
    numbers = ["1e400", "-1", "NaN", "Infinity", str(2**63), "9" * 4300, "-" + "9" * 400, "1.5", '"2"', "true", "null"]
    for key in ("max_tokens", "temperature", "top_p", "n", "seed", "top_k", "min_p", "presence_penalty",
                "frequency_penalty", "repetition_penalty", "min_tokens", "top_logprobs"):
        for raw in (numbers if not quick else ["1e400", "9" * 4300, "NaN", '"2"']):
            yield Case(g, "POST", p, with_raw({**CHAT_OK, "logprobs": True} if key == "top_logprobs" else
                                              {k: v for k, v in CHAT_OK.items() if k != key}, key, raw))
    odd = [
        {"stop": ["x"] * 10_000}, {"stop": "x" * 100_000}, {"stop": [""]}, {"stop_token_ids": list(range(200_000))},
        {"stop_token_ids": [-1, 2**40]}, {"logit_bias": {"x": 1}}, {"logit_bias": {str(i): 100 for i in range(50_000)}},
        {"logit_bias": {"1": "NaN"}}, {"tools": "x"}, {"tools": [{"type": "function"}]},
        {"tools": [tool(nested_schema(150))]}, {"tools": [tool({"type": "object", "properties": {"a": {"$ref": "#"}}})]},
        {"tools": [tool({"type": "object"}, name="x" * 100_000)]}, {"tools": [tool({"type": "object"}, name=f"t{i}")
                                                                           for i in range(5000)]},
        {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [tool({"type": "object"})]},
        {"tool_choice": "required"}, {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                              "schema": nested_schema(150)}}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
        {"response_format": {"type": "xml"}}, {"guided_json": nested_json_text(5000)}, {"guided_regex": "("},
        {"guided_regex": "[a-z]{1,30000}"}, {"guided_choice": []}, {"guided_grammar": "root ::= root"},
        {"chat_template_kwargs": {"self": 1}}, {"chat_template_kwargs": {"tokenizer": 1}},
        {"chat_template_kwargs": {"messages": 1}}, {"chat_template_kwargs": "x"},
        {"stream": True, "stream_options": {"include_usage": "yes"}}, {"stream_options": {"include_usage": True}},
        {"stream": True, "stream_options": {"resumable": True}, "disconnect_policy": {"mode": "detach",
                                                                                      "lease_seconds": 10**9}},
        {"disconnect_policy": "explode"}, {"n": 10_000}, {"model": "x" * 100_000}, {"model": "../../etc/passwd"},
        {"user": {"a": [1] * 1000}}, {"metadata": {"k" * 1000: "v"}}, {"functions": [{"name": "f", "parameters": 5}]},
        {"continue_final_message": True, "add_generation_prompt": True}, {"echo": True},
        {"messages": [{"role": "user", "content": "x"}] * 5000},
    ]
    for extra in odd:  # the big ones are slow however well they are handled: not in --quick
        heavy = len(json.dumps(extra)) > 50_000 or extra.get("guided_regex") == "[a-z]{1,30000}"
        yield Case(g, "POST", p, js({**CHAT_OK, **extra}), slow=heavy)
    yield Case(g, "POST", p, js({**CHAT_OK, "stream": True}), headers={"Accept": "text/event-stream"})
    yield Case(g, "GET", p, expect=(405,))
    yield Case(g, "PUT", p, js(CHAT_OK), expect=(405,))


def completion_cases(quick: bool) -> Iterator[Case]:
    p, g = "/v1/completions", "completions"
    for _label, body in body_cases()[:10 if quick else None]:
        yield Case(g, "POST", p, body)
    for extra in [
        {"prompt": None}, {"prompt": []}, {"prompt": [[]]}, {"prompt": [-1]}, {"prompt": [2**40]}, {"prompt": [[1], "x"]},
        {"prompt": ["x"] * 10_000}, {"prompt": "\ud800"}, {"logprobs": 10**9}, {"best_of": 10**9}, {"echo": True,
                                                                                                    "max_tokens": 0},
        {"suffix": "x"}, {"prompt": "x", "n": 3, "max_tokens": 10**12}, {"prompt_logprobs": -5},
        {"stream": True, "stream_options": {"resumable": "x"}},
    ]:
        yield Case(g, "POST", p, js({**COMPLETION_OK, **extra}))
    yield Case(g, "POST", p, with_raw({"prompt": "x"}, "max_tokens", "9" * 4300))


def token_cases(quick: bool) -> Iterator[Case]:
    g = "tokenize"
    for path in ("/tokenize", "/detokenize", "/v1/chat/completions/render"):
        for _label, body in body_cases()[:6]:
            yield Case(g, "POST", path, body)
    for body in [{"prompt": "x" * 1_000_000}, {"prompt": "\ud800"}, {"messages": [{"role": "user", "content": 1}]},
                 {"prompt": "x", "add_special_tokens": "yes"}]:
        yield Case(g, "POST", "/tokenize", js(body))
    for body in [{"tokens": [-1]}, {"tokens": [2**40]}, {"tokens": list(range(300_000))}, {"tokens": "abc"},
                 {"tokens": [1.5]}]:
        yield Case(g, "POST", "/detokenize", js(body))
    yield Case(g, "POST", "/v1/chat/completions/render", js({**CHAT_OK, "tools": [tool(nested_schema(150))]}))


def session_cases(quick: bool) -> Iterator[Case]:
    g = "sessions"
    for _label, body in body_cases()[:8]:
        yield Case(g, "POST", "/v1/sessions", body)
    for body in [{"ttl_seconds": 10**12}, {"ttl_seconds": -1}, {"ttl_seconds": "NaN"}, {"system_prompt": 5},
                 {"metadata": {"a": nested_json_text(3000)}}, {"defaults": {"temperature": 99}},
                 {"defaults": {"stop": ["x"] * 1000}}, {"system_prompt": "\ud800"}]:
        yield Case(g, "POST", "/v1/sessions", js(body))
    yield Case(g, "POST", "/v1/sessions", with_raw({}, "ttl_seconds", "9" * 4300))
    for sid in ("sess_x", "sess_" + "0" * 25, "../../etc", "%00", "x" * 5000, "sess_0000000000000000000000000:lock",
                "*", "sess_{a}"):
        q = urllib.parse.quote(sid, safe="")
        yield Case(g, "GET", f"/v1/sessions/{q}")
        yield Case(g, "POST", f"/v1/sessions/{q}/messages", js({"content": "x", "max_tokens": 1}))
        if not quick:
            yield Case(g, "DELETE", f"/v1/sessions/{q}")
            yield Case(g, "PATCH", f"/v1/sessions/{q}", js({"title": "x"}))
    for query in ("limit=0", "limit=100000", "limit=x", "after=sess_zz", "after=" + "x" * 5000, "limit=-1&after=",
                  "limit=1e9"):
        yield Case(g, "GET", f"/v1/sessions?{query}")
    # on a real session: created by the runner, its id put in place of SID
    real = "/v1/sessions/SID"
    for body in [b"", b"null", js({"content": 5}), js({"content": "x", "n": 2}), js({"content": "x", "max_tokens": 10**9}),
                 js({"content": "\ud800", "max_tokens": 1}), js({"content": "x", "max_tokens": 1, "stream": "yes"}),
                 js({"content": "x", "max_tokens": 1, "tools": [tool(nested_schema(150))]}),
                 with_raw({"content": "x"}, "max_tokens", "9" * 4300)]:
        yield Case(g, "POST", real + "/messages", body)
    for body in [js({"keep_turns": -1}), js({"keep_turns": 10**9}), js({"keep_turns": "1"}), b"[]"]:
        yield Case(g, "POST", real + "/fork", body)
    for body in [js({"temperature": "x"}), js({"max_tokens": 10**9}), b"{"]:
        yield Case(g, "POST", real + "/regenerate", body)
    for body in [js({"title": "x" * 10_000}), js({"metadata": 5}), js({"defaults": {"top_p": 7}}), b"null"]:
        yield Case(g, "PATCH", real, body)
    yield Case(g, "POST", real + "/messages", js({"content": "Hi", "max_tokens": 1}),
               headers={"X-Session-Id": "sess_" + "f" * 25})


def responses_cases(quick: bool) -> Iterator[Case]:
    g, p = "responses", "/v1/responses"
    for _label, body in body_cases()[:8]:
        yield Case(g, "POST", p, body)
    for extra in [
        {"input": []}, {"input": [{"type": "reasoning"}]}, {"input": [{"type": "item_reference", "id": "x"}]},
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "\\ud800"}]},
        {"previous_response_id": "resp_" + "0" * 32}, {"previous_response_id": "../x"},
        {"tools": [{"type": "function", "name": "f", "parameters": nested_schema(150)}]},
        {"tools": [{"type": "web_search"}]}, {"text": {"format": {"type": "json_schema", "name": "x",
                                                                  "schema": nested_schema(150)}}},
        {"background": True, "store": False}, {"truncation": "auto"}, {"metadata": {str(i): "v" for i in range(100)}},
        {"stream": True, "background": "x"}, {"instructions": "\ud800"}, {"include": ["x" * 1000]},
    ]:
        yield Case(g, "POST", p, js({**RESPONSES_OK, **extra}))
    yield Case(g, "POST", p, b'{"input": "x", "max_output_tokens": 2, "tool_choice": "none", "tools": [{"type": '
                             b'"function", "name": "f", "parameters": {"type": "object", "default": NaN}}]}')
    yield Case(g, "POST", p, with_raw({"input": "x"}, "max_output_tokens", "9" * 4300))
    for rid in ("resp_x", "resp_" + "0" * 32, "x" * 3000, "%2e%2e", "resp_" + "0" * 32 + ":input"):
        q = urllib.parse.quote(rid, safe="%")
        yield Case(g, "GET", f"{p}/{q}")
        yield Case(g, "GET", f"{p}/{q}/input_items?limit=x&order=sideways")
        yield Case(g, "POST", f"{p}/{q}/cancel")
        yield Case(g, "DELETE", f"{p}/{q}")
    yield Case(g, "GET", f"{p}/RID?stream=true&starting_after=-5")
    yield Case(g, "GET", f"{p}/RID?stream=maybe")
    yield Case(g, "GET", f"{p}/RID/input_items?limit=100000&after=x")


def cancel_cases(quick: bool) -> Iterator[Case]:
    g = "cancel"
    for rid in ("nope", "x" * 5000, "%00", "a:b", "chatcmpl-x", "..", "%2F"):
        q = urllib.parse.quote(rid, safe="%")
        yield Case(g, "POST", f"/v1/requests/{q}/cancel")
        yield Case(g, "DELETE", f"/v1/requests/{q}")
    yield Case(g, "POST", "/v1/requests/x/cancel", b"[" * 10_000)
    yield Case(g, "GET", "/v1/requests/x/cancel", expect=(405,))


def resume_cases(quick: bool) -> Iterator[Case]:
    g = "resume"
    for base in ("/v1/chat/completions", "/v1/completions"):
        for sid in ("x", "chatcmpl-nope", "cmpl-nope", "chatcmpl-" + "x" * 5000, "chatcmpl-a:readers", "%00"):
            yield Case(g, "GET", f"{base}/{urllib.parse.quote(sid, safe='%')}/stream")
    path = "/v1/chat/completions/RESUME/stream"
    for cursor in ("-5", "x", "9" * 400, "1e9", "", "NaN", "0" * 1000):
        yield Case(g, "GET", path, headers={"Last-Event-ID": cursor})
        yield Case(g, "GET", f"{path}?starting_after={urllib.parse.quote(cursor)}")


def model_cases(quick: bool) -> Iterator[Case]:
    g = "models"
    yield Case(g, "GET", "/v1/models")
    for mid in ("nope", "x" * 5000, "..%2F..%2Fetc%2Fpasswd", "%00", "a/b/c"):
        yield Case(g, "GET", f"/v1/models/{mid}")
    yield Case(g, "GET", "/v1/models", headers={"anthropic-version": "x" * 1000}, anthropic=True)
    yield Case(g, "POST", "/v1/models", js({}), expect=(405,))


def messages_cases(quick: bool) -> Iterator[Case]:
    g, p = "messages", "/v1/messages"
    hdr = {"anthropic-version": "2023-06-01"}
    for _label, body in body_cases()[:10]:
        yield Case(g, "POST", p, body, headers=hdr, anthropic=True)
    for extra in [
        {"max_tokens": -1}, {"max_tokens": 10**12}, {"messages": []}, {"messages": [{"role": "system", "content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "file:///x"}}]}]},
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": 5}]}]},
        {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "1", "name": "f",
                                                          "input": {"a": "\ud800"}}]}]},
        {"system": [{"type": "text", "text": "x", "cache_control": {"type": "forever"}}]},
        {"tools": [{"name": "f", "input_schema": nested_schema(150)}]}, {"tools": [{"name": "", "input_schema": {}}]},
        {"tool_choice": {"type": "tool", "name": "nope"}}, {"thinking": {"type": "enabled", "budget_tokens": -1}},
        {"stop_sequences": ["x"] * 10_000}, {"temperature": "hot"}, {"top_k": 2**63}, {"stream": True, "max_tokens": 1},
        {"metadata": {"user_id": "x" * 100_000}}, {"output_config": {"format": {"type": "json_schema",
                                                                             "schema": nested_schema(150)}}},
    ]:
        yield Case(g, "POST", p, js({**MESSAGES_OK, **extra}), headers=hdr, anthropic=True)
    yield Case(g, "POST", p, with_raw({k: v for k, v in MESSAGES_OK.items() if k != "max_tokens"}, "max_tokens",
                                      "9" * 4300), headers=hdr, anthropic=True)
    ct = "/v1/messages/count_tokens"
    for _label, body in body_cases()[:6]:
        yield Case(g, "POST", ct, body, headers=hdr, anthropic=True)
    for extra in [{"messages": []}, {"messages": [{"role": "user", "content": "x" * 1_000_000}]},
                  {"tools": [{"name": "f", "input_schema": nested_schema(150)}]}, {"system": 5}]:
        yield Case(g, "POST", ct, js({**MESSAGES_OK, **extra}), headers=hdr, anthropic=True)
    yield Case(g, "GET", p, headers=hdr, anthropic=True, expect=(405,))


def header_cases(quick: bool) -> Iterator[Case]:
    g = "headers"
    ok = js(CHAT_OK)
    for origin in ("http://evil.example", "null", "http://127.0.0.1:1"):
        yield Case(g, "POST", "/v1/chat/completions", ok, headers={"Origin": origin, "Content-Type": "text/plain"},
                   expect=(403,))
    yield Case(g, "POST", "/v1/messages", js(MESSAGES_OK), headers={"Origin": "http://evil.example"}, anthropic=True,
               expect=(403,))
    yield Case(g, "GET", "/v1/sessions", headers={"Host": "evil.example"}, expect=(403,))
    yield Case(g, "POST", "/v1/chat/completions", ok, headers={"Content-Type": "application/x-www-form-urlencoded"},
               expect=(200,))  # curl -d
    for rid in ("a:b", "x" * 129, "{slot}", "chatcmpl-x:readers"):
        yield Case(g, "POST", "/v1/chat/completions", ok, headers={"X-Request-Id": rid})
    for value in ("Bearer", "Basic x", "Bearer " + "x" * 10_000):
        yield Case(g, "GET", "/v1/models", headers={"Authorization": value})
    yield Case(g, "POST", "/v1/chat/completions", raw=b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               b"Content-Length: 5\r\nConnection: close\r\n\r\n" + ok)  # more body than declared
    yield Case(g, "POST", "/v1/chat/completions", ok, headers={"Content-Encoding": "gzip"})
    # header bytes httpx will not send: over a bare socket
    for rid in (b"a\x01b", b"\xff\xfe", "日本".encode(), b"x" * 20_000):
        yield Case(g, "POST", "/v1/chat/completions", raw=b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                   b"Content-Type: application/json\r\nX-Request-Id: " + rid + b"\r\nContent-Length: "
                   + str(len(ok)).encode() + b"\r\nConnection: close\r\n\r\n" + ok)
    yield Case(g, "POST", "/v1/chat/completions", raw=b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               b"Content-Length: 100000\r\nConnection: close\r\n\r\n" + ok)  # the body never arrives: we close
    yield Case(g, "POST", "/v1/chat/completions", raw=b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n5\r\n{\"mes\r\nzz\r\n")
    yield Case(g, "GET", "/", raw=b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
    for method, path in (("TRACE", "/v1/models"), ("OPTIONS", "/v1/chat/completions"), ("GET", "/static/../../etc/passwd"),
                         ("GET", "/static/%2e%2e/%2e%2e/etc/passwd"), ("GET", "/debug/cache"), ("GET", "/v1/cache/stats"),
                         ("GET", "/get_server_info"), ("GET", "/kv_event_sources"), ("GET", "/metrics"),
                         ("GET", "/" + "x" * 2000)):
        yield Case(g, method, path)


GROUPS: list[Callable[[bool], Iterator[Case]]] = [
    chat_cases, completion_cases, token_cases, session_cases, responses_cases, cancel_cases, resume_cases,
    model_cases, messages_cases, header_cases]


def all_cases(quick: bool) -> list[Case]:
    """Every case; `quick`: no slow ones, and of the rest every other one of each route family (those
    with an expected status, and the raw-socket ones, all), for a run of a minute or two on two cores."""
    cases = []
    for make in GROUPS:
        group = [c for c in make(quick) if not (quick and c.slow)]
        cases += [c for i, c in enumerate(group) if not quick or i % 2 == 0 or c.expect is not None or c.raw is not None]
    return cases


# ---- running them ---------------------------------------------------------------------------------------
@dataclass
class Failure:
    kind: str  # "5xx", "reset", "timeout", "shape"
    case: str
    detail: str


@dataclass
class Summary:
    requests: int = 0
    by_status: collections.Counter = field(default_factory=collections.Counter)
    by_group: collections.Counter = field(default_factory=collections.Counter)
    failures: list[Failure] = field(default_factory=list)
    healthy_after: bool = False
    after_notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def count(self, kind: str) -> int:
        return sum(1 for f in self.failures if f.kind == kind)

    def as_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "by_status": {str(k): v for k, v in sorted(self.by_status.items(), key=str)},
                "by_group": dict(self.by_group), "5xx": self.count("5xx"), "resets": self.count("reset"),
                "timeouts": self.count("timeout"), "bad_error_shape": self.count("shape"),
                "unexpected_status": self.count("status"),
                "healthy_after": self.healthy_after, "after_notes": self.after_notes, "seconds": round(self.seconds, 1),
                "failures": [f.__dict__ for f in self.failures]}

    @property
    def ok(self) -> bool:
        return not self.failures and self.healthy_after


def error_shape_problem(resp: httpx.Response, anthropic: bool) -> str | None:
    try:
        body = resp.json()
    except ValueError:
        return f"not JSON: {resp.text[:200]!r}"
    if anthropic:
        ok = (isinstance(body, dict) and body.get("type") == "error" and isinstance(body.get("error"), dict)
              and isinstance(body["error"].get("type"), str) and isinstance(body["error"].get("message"), str))
        return None if ok else f"not Anthropic's error shape: {str(body)[:200]}"
    if not (isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], dict)
            and set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]):
        return f"not OpenAI's error shape: {str(body)[:200]}"
    return None


def send_raw(base_url: str, data: bytes, timeout: float) -> int:
    """One request as raw bytes over a new socket: its status (0 when the server answered nothing)."""
    u = urllib.parse.urlsplit(base_url)
    with socket.create_connection((u.hostname or "127.0.0.1", u.port or 80), timeout=timeout) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    line = reply.split(b"\r\n", 1)[0].split()
    return int(line[1]) if len(line) > 1 and line[1].isdigit() else 0


class Runner:
    def __init__(self, base_url: str, api_key: str | None, timeout: float, verbose: bool = False) -> None:
        self.base_url = base_url.rstrip("/")
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = timeout
        self.verbose = verbose
        self.client = httpx.Client(base_url=self.base_url, timeout=timeout, headers=self.auth)
        self.summary = Summary()
        self.subs: dict[str, str] = {}

    def setup(self) -> None:
        """A real session (SID), a stored response (RID) and a resumable stream (RESUME) for the cases to poke."""
        sid = self.client.post("/v1/sessions", json={}).json()["id"]
        rid = self.client.post("/v1/responses", json=RESPONSES_OK).json()["id"]
        self.client.post("/v1/chat/completions", json={**CHAT_OK, "stream": True, "stream_options": {"resumable": True}},
                         headers={"X-Request-Id": "fuzz-resume"})
        self.subs = {"SID": sid, "RID": rid, "RESUME": "chatcmpl-fuzz-resume"}

    def teardown(self) -> None:
        for path in (f"/v1/sessions/{self.subs.get('SID')}", f"/v1/responses/{self.subs.get('RID')}"):
            try:
                self.client.delete(path)
            except httpx.HTTPError:
                pass

    def run_case(self, case: Case) -> None:
        s = self.summary
        s.requests += 1
        s.by_group[case.group] += 1
        path = case.path
        for key, value in self.subs.items():
            path = path.replace(key, value)
        what = Case(**{**case.__dict__, "path": path}).describe()
        if case.raw is not None:
            try:
                status = send_raw(self.base_url, case.raw, self.timeout)
            except TimeoutError:
                s.failures.append(Failure("timeout", what, f"no answer in {self.timeout} s"))
                return
            except OSError:  # a server may close on bytes that are not HTTP; /health below says it lives
                status = 0
            s.by_status[status if status else "closed"] += 1
            if status >= 500:
                s.failures.append(Failure("5xx", what, f"status {status}"))
            self._probe(what)
            return
        headers = {**case.headers}
        if case.body is not None and not any(k.lower() == "content-type" for k in headers):
            headers["Content-Type"] = "application/json"
        try:
            resp = self.client.request(case.method, path, content=case.body, headers=headers)
        except httpx.TimeoutException as exc:
            s.failures.append(Failure("timeout", what, repr(exc)))
            self._fresh_client()
            return
        except httpx.TransportError as exc:
            s.failures.append(Failure("reset", what, repr(exc)))
            self._fresh_client()
            return
        s.by_status[resp.status_code] += 1
        if self.verbose:
            print(f"{resp.status_code} {what[:160]}", flush=True)
        if resp.status_code >= 500:
            s.failures.append(Failure("5xx", what, f"{resp.status_code} {resp.text[:500]}"))
        elif case.expect is not None and resp.status_code not in case.expect:
            s.failures.append(Failure("status", what, f"expected {case.expect}, got {resp.status_code} {resp.text[:300]}"))
        elif resp.status_code >= 400 and case.method != "HEAD" and path.split("?")[0] not in ("/",):
            problem = error_shape_problem(resp, case.anthropic or path.startswith("/v1/messages"))
            if problem:
                s.failures.append(Failure("shape", what, f"{resp.status_code} {problem}"))
        self._probe(what)

    def _probe(self, what: str) -> None:
        """The next request on the same connection: an exception that reached uvicorn closes it after the
        answer, and a client that reuses it (every pooled client) sees a reset."""
        s = self.summary
        try:
            probe = self.client.get("/health")
            if probe.status_code != 200:
                s.failures.append(Failure("5xx" if probe.status_code >= 500 else "status", "GET /health after: " + what,
                                          f"{probe.status_code} {probe.text[:200]}"))
        except httpx.TransportError as exc:
            s.failures.append(Failure("reset", "GET /health on the same connection after: " + what, repr(exc)))
            self._fresh_client()

    def _fresh_client(self) -> None:
        self.client.close()
        self.client = httpx.Client(base_url=self.base_url, timeout=self.timeout, headers=self.auth)

    def check_after(self, idle_timeout_s: float = 60.0) -> None:
        """The server serves normally afterwards: healthy, answers a chat, idle, KV cache intact."""
        s = self.summary
        notes = s.after_notes
        try:
            health = self.client.get("/health")
            notes.append(f"/health: {health.status_code} {health.text.strip()}")
            reply = self.client.post("/v1/chat/completions", json={**CHAT_OK, "max_tokens": 4})
            good_reply = reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
            notes.append(f"a normal chat: {reply.status_code}" + (f", {reply.json()['usage']['completion_tokens']} "
                                                                   "tokens" if good_reply else f" {reply.text[:200]}"))
            stream = self.client.post("/v1/chat/completions", json={**CHAT_OK, "stream": True})
            good_stream = stream.status_code == 200 and stream.text.rstrip().endswith("data: [DONE]")
            notes.append(f"a normal stream: {stream.status_code}, ends with [DONE]: {good_stream}")
            deadline = time.monotonic() + idle_timeout_s
            idle = False
            while time.monotonic() < deadline and not idle:
                metrics = self.client.get("/metrics").text
                running = _metric(metrics, "chatserve:num_requests_running")
                waiting = _metric(metrics, "chatserve:num_requests_waiting")
                idle = running == 0 and waiting == 0
                if not idle:
                    time.sleep(0.25)
            notes.append(f"idle afterwards: {idle}")
            cache = self.client.get("/debug/cache")
            intact = cache.status_code == 200 and cache.json().get("ok") is True
            notes.append(f"/debug/cache: {cache.status_code}, ok: {intact}")
            s.healthy_after = health.status_code == 200 and good_reply and good_stream and idle and intact
        except httpx.HTTPError as exc:
            notes.append(f"the server did not answer normally afterwards: {exc!r}")
            s.healthy_after = False

    def run(self, cases: list[Case]) -> Summary:
        start = time.monotonic()
        self.setup()
        try:
            for case in cases:
                self.run_case(case)
        finally:
            self.teardown()
        self.check_after()
        self.summary.seconds = time.monotonic() - start
        return self.summary


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            try:
                return float(line.rsplit(" ", 1)[1])
            except ValueError:
                return None
    return None


def run(base_url: str, *, quick: bool = False, api_key: str | None = None, timeout: float = 60.0,
        verbose: bool = False) -> Summary:
    return Runner(base_url, api_key, timeout, verbose).run(all_cases(quick))


def print_summary(s: Summary) -> None:
    d = s.as_dict()
    print(f"fuzzed {d['requests']} hostile requests (each followed by GET /health on the same connection) "
          f"in {d['seconds']} s")
    print("  by route: " + ", ".join(f"{k} {v}" for k, v in d["by_group"].items()))
    print("  by status: " + ", ".join(f"{k}: {v}" for k, v in d["by_status"].items()))
    print(f"  5xx: {d['5xx']}  connection resets: {d['resets']}  timeouts: {d['timeouts']}  "
          f"bad error shape: {d['bad_error_shape']}  unexpected status: {d['unexpected_status']}")
    print(f"  served normally afterwards: {'yes' if s.healthy_after else 'NO'} ({'; '.join(s.after_notes)})")
    for f in s.failures:
        print(f"  FAIL {f.kind}: {f.case}\n      -> {f.detail[:600]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server [default: %(default)s]")
    parser.add_argument("--api-key", default=None, help="sent as a Bearer key with every request")
    parser.add_argument("--quick", action="store_true", help="leave out the cases that are slow even when handled well")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per request [default: %(default)s]")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the summary as JSON here (- : stdout)")
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every answer's status")
    args = parser.parse_args(argv)
    cases = all_cases(args.quick)
    if args.list:
        for c in cases:
            print(f"[{c.group}] {c.describe()[:200]}")
        print(f"{len(cases)} cases")
        return 0
    summary = Runner(args.url, args.api_key, args.timeout, args.verbose).run(cases)
    print_summary(summary)
    if args.json:
        text = json.dumps(summary.as_dict(), indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text)
    return 0 if summary.ok else 1


if __name__ == "__main__":
    sys.exit(main())
