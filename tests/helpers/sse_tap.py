"""A tap on the HTTP transport of a real client: records the raw SSE lines each stream delivered.

The clients under test (the `openai` SDK and the frameworks on top of it) parse SSE themselves
and hide keepalive comments; the tap sits under them, in their own HTTP client (`httpx2`, the
transport the SDK uses), and sees the bytes exactly as their decoder does. A test then asserts
on structure, not on time: "this stream carried at least three keepalives between its events"
is what made the SDK's decoder fail, and it holds however fast or slow the machine is.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import httpx2


@dataclass
class TappedStream:
    """The raw lines of one text/event-stream response, in order, as they arrived."""

    path: str
    request_id: str | None
    lines: list[str] = field(default_factory=list)
    _partial: bytes = b""

    def feed(self, chunk: bytes) -> None:
        buf = self._partial + chunk
        held = b""
        if buf.endswith(b"\r"):  # maybe the first half of a CRLF split across chunks
            buf, held = buf[:-1], b"\r"
        *complete, rest = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        self._partial = rest + held
        self.lines += [line.decode("utf-8", errors="replace") for line in complete]

    @property
    def keepalives_between_events(self) -> int:
        """Keepalive comment lines after the first event's `id:`/`data:` line and before the last one's:
        the ones a decoder that remembers the last event id must not turn into an event."""
        kinds = ["comment" if line.startswith(":") else "field" if line else "blank" for line in self.lines]
        fields = [i for i, k in enumerate(kinds) if k == "field"]
        if not fields:
            return 0
        return sum(1 for k in kinds[fields[0]:fields[-1]] if k == "comment")

    @property
    def data(self) -> list[str]:
        return [line[5:].lstrip(" ") for line in self.lines if line.startswith("data:")]


class SSETap:
    """Shared by the transports below; `streams` holds every SSE response seen, oldest first."""

    def __init__(self) -> None:
        self.streams: list[TappedStream] = []
        self._lock = threading.Lock()

    def open(self, request: httpx2.Request, response: httpx2.Response) -> TappedStream | None:
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            return None
        tapped = TappedStream(request.url.path, response.headers.get("x-request-id"))
        with self._lock:
            self.streams.append(tapped)
        return tapped

    def clear(self) -> None:
        with self._lock:
            self.streams.clear()

    def since(self, mark: int) -> list[TappedStream]:
        with self._lock:
            return list(self.streams[mark:])

    def mark(self) -> int:
        with self._lock:
            return len(self.streams)


class _TapStream(httpx2.SyncByteStream):
    def __init__(self, inner: httpx2.SyncByteStream, tapped: TappedStream) -> None:
        self.inner, self.tapped = inner, tapped

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.inner:
            self.tapped.feed(chunk)
            yield chunk

    def close(self) -> None:
        self.inner.close()


class _AsyncTapStream(httpx2.AsyncByteStream):
    def __init__(self, inner: httpx2.AsyncByteStream, tapped: TappedStream) -> None:
        self.inner, self.tapped = inner, tapped

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.inner:
            self.tapped.feed(chunk)
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


class TapTransport(httpx2.HTTPTransport):
    def __init__(self, tap: SSETap) -> None:
        super().__init__()
        self.tap = tap

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = super().handle_request(request)
        tapped = self.tap.open(request, response)
        if tapped is None:
            return response
        assert isinstance(response.stream, httpx2.SyncByteStream)
        return httpx2.Response(response.status_code, headers=response.headers,
                               stream=_TapStream(response.stream, tapped), extensions=response.extensions)


class AsyncTapTransport(httpx2.AsyncHTTPTransport):
    def __init__(self, tap: SSETap) -> None:
        super().__init__()
        self.tap = tap

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await super().handle_async_request(request)
        tapped = self.tap.open(request, response)
        if tapped is None:
            return response
        assert isinstance(response.stream, httpx2.AsyncByteStream)
        return httpx2.Response(response.status_code, headers=response.headers,
                               stream=_AsyncTapStream(response.stream, tapped), extensions=response.extensions)
