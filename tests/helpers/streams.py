"""Server-sent events: parsing the raw lines, and a streamed POST read in a background thread
(so a test can act, e.g. cancel or send SIGTERM, while the stream is still open)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

from .net import HTTP


def parse_sse_lines(lines: Iterable[str]) -> list[tuple[str | None, str]]:
    """(id, data) per event, from the raw lines: checks the framing itself, not a library's view of it."""
    events: list[tuple[str | None, str]] = []
    cur_id: str | None = None
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                events.append((cur_id, "\n".join(data)))
            cur_id, data = None, []
        elif line.startswith(":"):
            continue  # keepalive comment
        elif line.startswith("id:"):
            cur_id = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
        else:
            assert line.startswith(("event:", "retry:")), f"unexpected SSE line {line!r}"
    return events


def blank_line_messages(raw: str) -> list[str]:
    """The data of each message as a reader that splits the stream at blank lines reads it (vLLM's
    benchmark client, many hand-written ones): every message must be one `data:` line, or comments
    only (a keepalive), which it skips. Anything else (an `id:` line, a comment glued to the next
    event) fails here, as it fails there."""
    out = []
    for message in raw.replace("\r\n", "\n").split("\n\n"):
        lines = [line for line in message.split("\n") if line]
        if not lines or all(line.startswith(":") for line in lines):
            continue
        assert len(lines) == 1 and lines[0].startswith("data: "), f"not one data line: {message!r}"
        out.append(lines[0][len("data: "):])
    return out


def sse_events(resp: httpx.Response) -> list[tuple[str | None, str]]:
    return parse_sse_lines(resp.iter_lines())


def finish_reasons_of(payloads: Iterable[str]) -> list[str]:
    """Every non-null finish_reason in the chunks' choices, in order ("[DONE]" skipped)."""
    out: list[str] = []
    for payload in payloads:
        if payload != "[DONE]":
            out += [c["finish_reason"] for c in json.loads(payload).get("choices", []) if c.get("finish_reason")]
    return out


@dataclass
class Stream:
    """One streamed POST, filled in by its thread as lines arrive (read `lines` to see progress)."""

    thread: threading.Thread | None = None
    status: int | None = None
    lines: list[str] = field(default_factory=list)
    body: Any = None  # the JSON body of a non-200 answer
    headers: dict[str, str] = field(default_factory=dict)
    error: BaseException | None = None

    @property
    def data(self) -> list[str]:
        """The payloads of the `data:` lines so far, e.g. [chunk JSON, ..., "[DONE]"]."""
        return [line[5:].strip() for line in list(self.lines) if line.startswith("data:")]

    @property
    def events(self) -> list[tuple[str | None, str]]:
        return parse_sse_lines(list(self.lines))

    @property
    def finish_reasons(self) -> list[str]:
        return finish_reasons_of(self.data)

    def join(self, timeout: float = 30.0) -> Stream:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the stream did not end within {timeout:g} s"
        return self


def stream_in_thread(url: str, path: str, body: dict[str, Any], *, headers: dict[str, str] | None = None,
                     timeout: float = 120.0) -> Stream:
    """POST `body` to `url + path` and read the answer line by line in a new thread.

    A failed connection or read ends up in `Stream.error` instead of vanishing with the thread.
    """
    stream = Stream()

    def run() -> None:
        try:
            with HTTP.stream("POST", f"{url}{path}", json=body, headers=headers, timeout=timeout) as r:
                stream.status = r.status_code
                stream.headers = dict(r.headers)
                if r.status_code != 200:
                    r.read()
                    stream.body = r.json()
                    return
                for line in r.iter_lines():
                    stream.lines.append(line)
        except Exception as exc:  # noqa: BLE001 - kept for the test to assert on
            stream.error = exc

    stream.thread = threading.Thread(target=run, daemon=True)
    stream.thread.start()
    return stream


async def cancel_agent_stream_after(streamed: Any, deltas: int = 3) -> int:
    """Cancel an OpenAI Agents SDK `Runner.run_streamed` run once `deltas` text deltas arrived, as a user
    pressing stop would; returns how many deltas were seen (the run must still end cleanly)."""
    from openai.types.responses import ResponseTextDeltaEvent

    n = 0
    async for e in streamed.stream_events():
        if e.type == "raw_response_event" and isinstance(e.data, ResponseTextDeltaEvent):
            n += 1
            if n == deltas:
                streamed.cancel()
    assert n >= deltas and streamed.is_complete
    return n


def total_aborts(metrics: dict[str, float]) -> float:
    """All requests the server aborted, whatever the reason (chatserve:request_aborts_total)."""
    return sum(v for k, v in metrics.items() if k.startswith("chatserve:request_aborts_total{"))


def sse_chunks(text: str) -> list[dict[str, Any]]:
    """The JSON chunks of an OpenAI-framed stream's body, checked to end in `[DONE]`."""
    events = parse_sse_lines(text.replace("\r\n", "\n").split("\n"))
    assert events[-1][1] == "[DONE]", events[-1]
    return [json.loads(data) for _, data in events[:-1]]
