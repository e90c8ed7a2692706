"""Text with the characters str.splitlines() takes for line ends (NEL, LINE/PARAGRAPH SEPARATOR) must
reach SSE clients in one event: httpx's `iter_lines` (what clients reading SSE over httpx use) splits
on them, so a raw U+2028 in a data line cut a chunk's JSON in two (a JSONDecodeError in a long stream
of tests/server/test_server_shutdown.py). The openai SDK's own decoder must read it whole too."""

import json

from httpx._decoders import LineDecoder
from openai._streaming import SSEDecoder

from chatserve.server.streams.sse import dumps

TEXT = "a\u2028b\x85c\u2029d\u00e9\u4e2d\U0001f600\x1ce\n"


def test_dumps_escapes_what_splitlines_splits_and_keeps_the_rest_utf8():
    line = dumps({"choices": [{"delta": {"content": TEXT}}]})
    assert len(line.splitlines()) == 1
    decoder = LineDecoder()
    assert decoder.decode(f"data: {line}\n") + decoder.flush() == [f"data: {line}"]
    assert json.loads(line)["choices"][0]["delta"]["content"] == TEXT
    assert "\u00e9\u4e2d\U0001f600" in line  # not ASCII-escaped


def test_openai_sdk_decoder_reads_the_event_whole():
    body = f"data: {dumps({'content': TEXT})}\n\ndata: [DONE]\n\n".encode()
    events = list(SSEDecoder().iter_bytes(iter([body])))
    assert [e.data for e in events][-1] == "[DONE]"
    assert json.loads(events[0].data)["content"] == TEXT
