"""The browser client (web/) end to end: a real headless Chromium against a real server.

The server is `python -m chatserve serve` on a free port of 127.0.0.1 with the default model;
the browser is Debian's chromium driven through its own chromedriver by selenium (nothing is ever
downloaded; `scripts/setup_env.sh --with-redis` installs both packages when missing). Screenshots
go to tests/artifacts/ (override with CHATSERVE_TEST_ARTIFACTS).

CHATSERVE_WEB_TEST_URL=http://host:port/ runs the same tests against a server you already run.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.net import wait_until
from tests.helpers.server import ROOT, start_server

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
ARTIFACTS = Path(os.environ.get("CHATSERVE_TEST_ARTIFACTS", ROOT / "tests" / "artifacts"))
SERVER_START_TIMEOUT = 300.0  # a hang guard: a loaded 2-core CI box has taken over 120 s to load the model

if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
    pytest.skip(
        f"browser tests need {CHROMIUM} and {CHROMEDRIVER} (Debian packages chromium, chromium-driver); "
        "`scripts/setup_env.sh --with-redis` installs them",
        allow_module_level=True,
    )
pytest.importorskip("selenium", reason="selenium is missing: pip install -e '.[dev]'")

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.remote.webelement import WebElement  # noqa: E402

pytestmark = pytest.mark.timeout(600)  # the first test also waits for the server to load the model

# Records alert()/confirm()/prompt() calls instead of showing them: an injected handler that ran
# would leave a trace here, and no modal dialog can wedge the driver.
ALERT_TRAP = """
window.__dialogs = [];
for (const name of ['alert', 'confirm', 'prompt']) {
  window[name] = (...args) => { window.__dialogs.push([name, String(args[0])]); return null; };
}
"""

# Samples the length of the newest reply's text every 15 ms while it streams.
# Samples, every 15 ms, how much of the reply is on screen: its markdown source drawn so far
# (data-source-length, which only grows) and its rendered text, which may shrink by a marker's few
# characters while streaming ("**bold" shows its asterisks until the closing pair arrives).
LENGTH_SAMPLER = """
window.__lengths = [];
window.__rendered = [];
window.__sampler = setInterval(() => {
  const replies = document.querySelectorAll('[data-testid="assistant-message"] .msg-body');
  const last = replies[replies.length - 1];
  const push = (seen, n) => { if (seen.length === 0 || seen[seen.length - 1] !== n) seen.push(n); };
  push(window.__lengths, last ? Number(last.dataset.sourceLength || 0) : 0);
  push(window.__rendered, last ? last.textContent.length : 0);
}, 15);
"""


# ---------------------------------------------------------------------------------------------
# Server and browser


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as res:
            return res.status, res.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _request(method: str, url: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as res:
            return res.status, json.loads(res.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


@pytest.fixture(scope="module")
def base_url() -> Any:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    external = os.environ.get("CHATSERVE_WEB_TEST_URL")
    if external:
        yield external.rstrip("/") + "/"
        return

    server = start_server("--max-num-seqs", "8", startup_timeout=SERVER_START_TIMEOUT,
                          log_path=ARTIFACTS / "server.log")
    try:
        yield server.url + "/"
    finally:
        server.stop(timeout=15)


@pytest.fixture(scope="module")
def driver() -> Any:
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium Manager must never fetch a browser or driver
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in (
        "--headless=new",
        "--no-sandbox",  # containers run as root
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,860",
        "--no-first-run",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-renderer-backgrounding",
        "--disable-background-timer-throttling",
        # No network but this machine: a page that needed a CDN (or any outside host) would break.
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1, EXCLUDE localhost",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    drv = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    drv.set_script_timeout(20)
    drv.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": ALERT_TRAP})
    try:
        yield drv
    finally:
        try:
            logs = drv.get_log("browser")
            (ARTIFACTS / "browser-console.log").write_text("\n".join(json.dumps(e) for e in logs))
        except Exception:  # noqa: BLE001 - diagnostics only
            pass
        drv.quit()


@pytest.fixture
def page(driver: Any, base_url: str, request: pytest.FixtureRequest) -> Any:
    """A fresh load of the page with the given settings; a screenshot of the end state, pass or fail."""

    def load(hash_: str = "", **settings: Any) -> Any:
        driver.get(base_url)
        driver.execute_script("localStorage.clear();")
        if settings:
            driver.execute_script(
                "localStorage.setItem('chatserve.settings.v1', arguments[0]);",
                json.dumps({"systemPrompt": "", "temperature": "", "maxTokens": "", "apiKey": "", **settings}),
            )
        driver.get(base_url + hash_)
        wait_until(lambda: driver.execute_script("return document.documentElement.dataset.ready === '1'"), 10, "page ready")
        return driver

    yield load
    shot(driver, f"{request.node.name}-end")


def shot(driver: Any, name: str) -> Path:
    path = ARTIFACTS / f"web-{name}.png"
    driver.save_screenshot(str(path))
    return path


def by_testid(driver: Any, testid: str) -> list[WebElement]:
    return driver.find_elements(By.CSS_SELECTOR, f'[data-testid="{testid}"]')


def one(driver: Any, testid: str) -> WebElement:
    found = by_testid(driver, testid)
    assert len(found) == 1, f"expected one [data-testid={testid}], found {len(found)}"
    return found[0]


def last_reply_text(driver: Any) -> str:
    return driver.execute_script(
        "const r = document.querySelectorAll('[data-testid=\"assistant-message\"] .msg-body');"
        "return r.length ? r[r.length - 1].textContent : null;"
    )


def user_texts(driver: Any) -> list[str]:
    """The user messages as shown (their text, without the Copy / Edit actions under them)."""
    return [e.find_element(By.CSS_SELECTOR, ".msg-body").text for e in by_testid(driver, "user-message")]


def type_and_send(driver: Any, text: str, *, with_enter: bool = True) -> None:
    box = one(driver, "message-input")
    box.send_keys(text)
    if with_enter:
        box.send_keys(Keys.ENTER)
    else:
        one(driver, "send-button").click()


def wait_reply_done(driver: Any, timeout: float = 120) -> WebElement:
    wait_until(lambda: not driver.execute_script(
        "return document.querySelector('[data-testid=\"assistant-message\"].streaming') !== null"
    ) and one(driver, "stop-button").get_attribute("hidden") is not None, timeout, "the reply to finish")
    return by_testid(driver, "assistant-message")[-1]


def session_id_from_url(driver: Any) -> str:
    h = driver.execute_script("return location.hash")
    assert h.startswith("#session="), h
    return h[len("#session="):]


def num_requests_running(base_url: str) -> float:
    status, body = _get(base_url + "metrics")
    assert status == 200, status
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in body.decode().splitlines()
        if line.startswith("chatserve:num_requests_running")
    ]
    assert values, "chatserve:num_requests_running missing from /metrics"
    return sum(values)


def set_in_settings_panel(driver: Any, **fields: str) -> None:
    """Fill the settings panel like a user (fields: temperature, max_tokens, system_prompt, api_key)."""
    one(driver, "settings-button").click()
    for name, value in fields.items():
        field = one(driver, "settings-" + name.replace("_", "-"))
        field.clear()
        field.send_keys(value)
    one(driver, "settings-save").click()
    wait_until(lambda: not driver.execute_script("return document.getElementById('settings').open"), 5, "settings to close")
    saved = json.loads(driver.execute_script("return localStorage.getItem('chatserve.settings.v1')"))
    if "max_tokens" in fields:
        assert saved["maxTokens"] == fields["max_tokens"], saved


def assert_no_dialogs(driver: Any) -> None:
    assert driver.execute_script("return window.__dialogs") == []


# ---------------------------------------------------------------------------------------------
# In-page units (no model): the SSE parser and the Markdown renderer


def test_sse_parser_and_markdown_in_browser(page: Any) -> None:
    driver = page()
    result = driver.execute_async_script(
        """
        const done = arguments[arguments.length - 1];
        Promise.all([import('./static/sse.js'), import('./static/markdown.js')]).then(([sse, md]) => {
          const stream = 'id: 1\\r\\ndata: {"a":1}\\r\\n\\r\\n: keepalive\\n\\nid: 2\\ndata: {"b":"\\u00e9\\u4e2d"}\\n\\n'
            + 'data: line1\\ndata: line2\\n\\ndata: [DONE]\\n\\n';
          const parse = (pieces) => {
            const out = [];
            const p = new sse.SSEParser((e) => out.push(e.data));
            for (const piece of pieces) p.push(piece);
            p.end();
            return JSON.stringify(out);
          };
          const whole = parse([stream]);
          const splits = [];
          for (let i = 1; i < stream.length; i++) splits.push(parse([stream.slice(0, i), stream.slice(i)]));
          const bytes = parse(stream.split(''));
          const box = document.createElement('div');
          md.renderMarkdown('Hi <img src=x onerror=alert(1)> and `<b>code</b>`\\n\\n- one\\n- **two**\\n\\n'
            + '```html\\n<script>alert(2)</script>\\n```\\n1. first\\n2. second', box);
          done({whole, splits, bytes, tags: Array.from(box.querySelectorAll('*'), (e) => e.tagName.toLowerCase()),
                text: box.textContent});
        }).catch((e) => done({error: String(e)}));
        """
    )
    assert "error" not in result, result
    assert json.loads(result["whole"]) == ['{"a":1}', '{"b":"é中"}', "line1\nline2", "[DONE]"], result["whole"]
    assert all(s == result["whole"] for s in result["splits"]), "an event split across two reads parsed differently"
    assert result["bytes"] == result["whole"]
    assert "img" not in result["tags"] and "script" not in result["tags"] and "b" not in result["tags"]
    assert {"p", "code", "ul", "li", "strong", "pre", "ol"} <= set(result["tags"]), result["tags"]
    assert "<img src=x onerror=alert(1)>" in result["text"] and "<script>alert(2)</script>" in result["text"]
    assert_no_dialogs(driver)


# ---------------------------------------------------------------------------------------------
# End to end with the model


def test_reply_streams_in_steps_then_shows_stats(page: Any) -> None:
    driver = page()
    assert one(driver, "stop-button").get_attribute("hidden") is not None
    set_in_settings_panel(driver, temperature="0", max_tokens="32")  # greedy, a modest reply length

    driver.execute_script(LENGTH_SAMPLER)
    message = "Write three short sentences about the sea."
    type_and_send(driver, message, with_enter=False)
    wait_until(lambda: one(driver, "stop-button").is_displayed(), 10, "the Stop button while streaming")
    assert not one(driver, "message-input").is_enabled()
    reply = wait_reply_done(driver)
    stats = wait_until(lambda: reply.find_elements(By.CSS_SELECTOR, '[data-testid="reply-stats"]'), 5, "reply stats")
    driver.execute_script("clearInterval(window.__sampler)")
    shot(driver, "streamed-reply")

    lengths = [n for n in driver.execute_script("return window.__lengths") if n > 0]
    text = last_reply_text(driver)
    assert text.strip(), "the reply is empty"
    assert len(lengths) >= 3, f"the reply did not grow in steps: sampled lengths {lengths}"
    assert lengths == sorted(lengths), f"the reply's drawn source shrank while streaming: {lengths}"
    rendered = [n for n in driver.execute_script("return window.__rendered") if n > 0]
    assert len(rendered) >= 3 and rendered[-1] > rendered[0], f"the rendered reply did not grow in steps: {rendered}"
    stats_text = stats[0].text
    assert "TTFT" in stats_text and "tok/s" in stats_text and "cached" in stats_text, stats_text
    assert one(driver, "message-input").is_enabled()
    assert user_texts(driver) == [message]

    # The first message created a session, titled after it, now first in the sidebar.
    sid = session_id_from_url(driver)
    items = by_testid(driver, "session-item")
    assert items and items[0].get_attribute("data-session-id") == sid
    assert items[0].text.startswith("Write three short sentences")
    assert_no_dialogs(driver)


def test_stop_mid_stream(page: Any, base_url: str) -> None:
    driver = page()
    set_in_settings_panel(driver, temperature="0", max_tokens="400")
    type_and_send(driver, "Tell me a long story about a lighthouse keeper and a storm.")
    wait_until(lambda: len(last_reply_text(driver) or "") >= 15, 60, "the first tokens of the reply")
    stop = one(driver, "stop-button")
    assert stop.is_displayed()
    shot(driver, "before-stop")
    stop.click()

    reply = wait_until(
        lambda: driver.execute_script(
            "const r = document.querySelectorAll('[data-testid=\"assistant-message\"]');"
            "const last = r[r.length - 1];"
            "return last && last.dataset.finishReason === 'abort' && !last.classList.contains('streaming') ? last : null;"
        ),
        10,
        "the reply to end as stopped",
    )
    assert "Stopped" in reply.text
    assert one(driver, "stop-button").get_attribute("hidden") is not None
    assert one(driver, "message-input").is_enabled()
    partial = last_reply_text(driver)
    assert len(partial) >= 15
    time.sleep(0.5)
    assert last_reply_text(driver) == partial, "text kept arriving after Stop"
    shot(driver, "stopped")

    wait_until(lambda: num_requests_running(base_url) == 0, 5, "chatserve:num_requests_running to return to 0")
    # The server kept the partial reply, marked as aborted.
    sid = session_id_from_url(driver)
    status, session = _request("GET", base_url + f"v1/sessions/{sid}")
    assert status == 200, session
    assert session["messages"][-1]["role"] == "assistant"
    assert session["messages"][-1]["finish_reason"] == "abort"
    assert_no_dialogs(driver)


def test_reload_finds_session_with_history(page: Any, driver: Any, base_url: str) -> None:
    page(temperature="0", maxTokens="12")
    message = "Name two colors of the rainbow."
    type_and_send(driver, message)
    wait_reply_done(driver)
    reply = last_reply_text(driver)
    sid = session_id_from_url(driver)

    driver.get(base_url)  # a reload, on the bare URL: nothing is open until the sidebar is used
    wait_until(lambda: driver.execute_script("return document.documentElement.dataset.ready === '1'"), 10, "page ready")
    item = wait_until(
        lambda: [e for e in by_testid(driver, "session-item") if e.get_attribute("data-session-id") == sid],
        10,
        "the session in the sidebar",
    )[0]
    assert by_testid(driver, "user-message") == []
    item.click()
    wait_until(lambda: user_texts(driver) == [message], 10, "the history to show")
    assert last_reply_text(driver) == reply
    assert session_id_from_url(driver) == sid
    assert item.get_attribute("aria-current") == "page"
    shot(driver, "history")
    assert_no_dialogs(driver)


def test_html_in_messages_renders_as_text(page: Any, driver: Any, base_url: str) -> None:
    page(temperature="0", maxTokens="12")
    payload = "<img src=x onerror=alert(1)>"
    type_and_send(driver, payload)
    wait_reply_done(driver)
    time.sleep(0.3)  # an injected <img> would have fired onerror by now

    def check() -> None:
        assert user_texts(driver) == [payload]
        assert driver.find_elements(By.CSS_SELECTOR, "#messages img, #sidebar img, #messages script") == []
        assert_no_dialogs(driver)

    check()
    shot(driver, "html-literal")
    # The same through the history path (a fresh load of the session).
    sid = session_id_from_url(driver)
    page(f"#session={sid}")
    wait_until(lambda: by_testid(driver, "user-message"), 10, "the history")
    time.sleep(0.3)
    check()
    assert payload in driver.find_element(By.ID, "sidebar").text  # the title, literally


def test_server_error_is_shown_in_conversation(page: Any, driver: Any, base_url: str) -> None:
    status, session = _request("POST", base_url + "v1/sessions", {"metadata": {"title": "soon deleted"}})
    assert status == 201, session
    page(f"#session={session['id']}")
    wait_until(lambda: "soon deleted" in driver.find_element(By.ID, "chat-title").text, 10, "the session to open")
    status, _ = _request("DELETE", base_url + f"v1/sessions/{session['id']}")
    assert status == 200
    type_and_send(driver, "Hello?")
    error = wait_until(lambda: driver.find_elements(By.CSS_SELECTOR, "#messages .msg-error"), 10, "an error message")
    assert error[0].text.strip()
    assert one(driver, "message-input").is_enabled()
    assert one(driver, "stop-button").get_attribute("hidden") is not None


def test_screenshot_light_desktop(page: Any, driver: Any, base_url: str) -> None:
    """A picture for people: a real chat in the light theme with the cache panel open, plus the
    Markdown sample rendered by the page's own renderer as one more reply (the small model here
    rarely writes tables)."""
    page(temperature="0", maxTokens="24")
    type_and_send(driver, "Write a Python function that adds two numbers, in a code block.")
    wait_reply_done(driver)
    _wait_turn_stored(driver, 2)
    driver.execute_script("""
      const box = document.createElement('article');
      box.className = 'msg assistant';
      const body = document.createElement('div');
      body.className = 'msg-body';
      box.append(body);
      document.getElementById('messages').append(box);
      window.chatserve.renderMarkdown(arguments[0], body);
    """, MARKDOWN_SAMPLE)
    one(driver, "cache-button").click()
    wait_until(lambda: by_testid(driver, "cache-kv-usage"), 10, "the cache panel")
    shot(driver, "light-desktop")
    one(driver, "cache-button").click()


def test_screenshots_dark_and_narrow(page: Any, driver: Any) -> None:
    """Not a check of looks, just pictures for people: dark scheme, and a phone-sized window."""
    page()
    item = wait_until(lambda: by_testid(driver, "session-item"), 10, "a session in the sidebar")
    item[0].click()
    wait_until(lambda: by_testid(driver, "assistant-message"), 10, "history")
    driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme", "value": "dark"}]})
    shot(driver, "dark")
    size = driver.get_window_size()
    try:
        driver.set_window_size(400, 800)
        time.sleep(0.2)
        shot(driver, "narrow")
        driver.find_element(By.ID, "sidebar-open").click()
        time.sleep(0.4)
        shot(driver, "narrow-sidebar")
    finally:
        driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})
        driver.set_window_size(size["width"], size["height"])


# ---------------------------------------------------------------------------------------------
# Issue 24: Markdown and code, branches (regenerate, edit), stored stats, the cache panel, offline

MARKDOWN_SAMPLE = (
    "| name | value |\n|:--|--:|\n| alpha | **1** |\n| beta | `2` |\n\n"
    "See [the docs](https://example.com/docs), [bad](javascript:alert(3)) and <https://example.org>.\n\n"
    "```python\ndef add(a, b):\n    return a + b  # the sum\n```\n\n"
    "<script>alert(1)</script> <img src=x onerror=alert(2)> <a href=\"javascript:alert(4)\">x</a>\n\n"
    "> quoted *emphasis* and ~~struck~~\n\n1. one\n   - nested\n2. two\n"
)

# Renders `arguments[0]` at once and streamed in small pieces (one per task, like network reads),
# then reports the elements built and the streaming renderer's frame times.
RENDER_BOTH_WAYS = """
const [text, pieceLen, done] = [arguments[0], arguments[1], arguments[arguments.length - 1]];
import('./static/markdown.js').then(async (md) => {
  const once = document.createElement('div');
  const streamed = document.createElement('div');
  document.body.append(once, streamed);
  md.renderMarkdown(text, once);
  const view = new md.StreamingMarkdown(streamed);
  let sent = '';
  let reads = 0;
  for (let i = 0; i < text.length; i += pieceLen) {
    sent += text.slice(i, i + pieceLen);
    view.set(sent);
    reads += 1;
    if (reads % 4 === 0) await new Promise((r) => setTimeout(r, 0));
  }
  await new Promise((r) => requestAnimationFrame(() => requestAnimationFrame(r)));
  const framesWhileStreaming = view.frameTimes.length;
  view.finish();
  const describe = (box) => ({
    tags: Array.from(box.querySelectorAll('*'), (e) => e.tagName.toLowerCase()),
    links: Array.from(box.querySelectorAll('a'), (a) => [a.getAttribute('href'), a.textContent]),
    cells: Array.from(box.querySelectorAll('th, td'), (c) => [c.tagName.toLowerCase(), c.textContent, c.style.textAlign]),
    keywords: Array.from(box.querySelectorAll('pre code .hljs-keyword'), (e) => e.textContent),
    comments: Array.from(box.querySelectorAll('pre code .hljs-comment'), (e) => e.textContent),
    code: Array.from(box.querySelectorAll('pre code'), (e) => [e.className, e.textContent]),
    text: box.textContent,
    html: box.innerHTML,
  });
  const times = view.frameTimes.slice().sort((a, b) => a - b);
  done({once: describe(once), streamed: describe(streamed), reads, framesWhileStreaming,
        frameMs: {n: times.length, mean: times.reduce((a, b) => a + b, 0) / Math.max(1, times.length),
                  p95: times[Math.floor(times.length * 0.95)] || 0, max: times[times.length - 1] || 0}});
}).catch((e) => done({error: String(e) + ' ' + e.stack}));
"""


def test_markdown_table_link_and_highlighted_python(page: Any) -> None:
    driver = page()
    result = driver.execute_async_script(RENDER_BOTH_WAYS, MARKDOWN_SAMPLE, 3)
    assert "error" not in result, result
    for view in (result["once"], result["streamed"]):
        tags = set(view["tags"])
        assert {"table", "thead", "tbody", "th", "td", "a", "pre", "code", "blockquote", "em", "s", "ol", "ul"} <= tags, tags
        assert not tags & {"script", "img", "iframe", "style"}, tags
        assert ["th", "name", "left"] in view["cells"] and ["td", "1", "right"] in view["cells"]
        assert view["links"] == [["https://example.com/docs", "the docs"], ["https://example.org", "https://example.org"]]
        assert view["keywords"] == ["def", "return"] and view["comments"] == ["# the sum"]
        assert view["code"][0][0] == "hljs language-python"
        assert "<script>alert(1)</script>" in view["text"] and "<img src=x onerror=alert(2)>" in view["text"]
        assert "[bad](javascript:alert(3))" in view["text"]
    assert result["streamed"]["html"] == result["once"]["html"]  # finish() leaves exactly the one-shot rendering
    time.sleep(0.3)  # an injected handler would have run by now
    assert_no_dialogs(driver)


def test_long_reply_renders_once_per_frame(page: Any) -> None:
    """A 2,000-token reply (6,712 characters of prose, lists and code: 2,115 tokens for SmolLM2's
    tokenizer) arrives in 3-character reads, about one token each; the renderer draws at most once
    per animation frame, not once per read. Frame times go to tests/artifacts/ for the notes."""
    driver = page()
    para = "The **radix tree** shares `KV blocks` between requests, so a [branch](https://example.com) costs no prefill. "
    parts = []
    for i in range(24):
        parts.append(f"### Part {i}\n\n{para * 2}\n\n- first point {i}\n- second point\n\n")
        if i % 4 == 0:
            parts.append(f"```python\ndef step_{i}(x):\n    return x * {i}  # scaled\n```\n\n")
    text = "".join(parts)
    result = driver.execute_async_script(RENDER_BOTH_WAYS, text, 3)
    assert "error" not in result, result
    timing = {"chars": len(text), "reads": result["reads"], "frames": result["framesWhileStreaming"], **result["frameMs"]}
    (ARTIFACTS / "render-timing.json").write_text(json.dumps(timing, indent=1))
    assert result["reads"] > 2000
    assert 0 < result["framesWhileStreaming"] < result["reads"] / 4, timing  # coalesced into frames
    assert result["streamed"]["html"] == result["once"]["html"]


def _wait_turn_stored(driver: Any, count: int) -> None:
    """The page has read the stored session back after its turn (regenerate shows on the last reply)."""
    wait_until(lambda: driver.execute_script(
        "const s = window.chatserve.state; return s.current && (s.current.messages || []).length === arguments[0]"
        " && document.querySelector('[data-testid=\"regenerate-button\"]') !== null", count), 20, "the turn to be stored")


def _branch_positions(driver: Any) -> list[str]:
    return [e.text for e in by_testid(driver, "branch-pos")]


def test_regenerate_gives_a_second_branch_and_back_shows_the_first(page: Any, driver: Any, base_url: str) -> None:
    page(temperature="1", maxTokens="6")
    type_and_send(driver, "Say one random word.")
    wait_reply_done(driver)
    _wait_turn_stored(driver, 2)
    first_sid, first_text = session_id_from_url(driver), last_reply_text(driver)

    one(driver, "regenerate-button").click()
    wait_until(lambda: session_id_from_url(driver) != first_sid, 10, "the new branch to open")
    wait_reply_done(driver)
    _wait_turn_stored(driver, 2)
    second_sid, second_text = session_id_from_url(driver), last_reply_text(driver)
    wait_until(lambda: _branch_positions(driver) == ["2/2"], 10, "‹ 2/2 › on the reply")
    assert by_testid(driver, "branch-nav")[0].find_element(By.XPATH, "ancestor::article").get_attribute("data-index") == "1"

    # On the server: a fork of the first session, its reply regenerated from a fully cached prompt.
    _, branch = _request("GET", base_url + f"v1/sessions/{second_sid}")
    assert branch["forked_from"] == {"session_id": first_sid, "turn": 1} and branch["metadata"]["branch_at"] == 1
    assert branch["num_turns"] == 1 and branch["messages"][0]["content"] == "Say one random word."
    stats = branch["messages"][1]["stats"]
    assert stats["cached_tokens"] >= stats["prompt_tokens"] - 16, stats

    one(driver, "branch-prev").click()
    wait_until(lambda: session_id_from_url(driver) == first_sid, 10, "the first branch")
    wait_until(lambda: _branch_positions(driver) == ["1/2"], 10, "‹ 1/2 ›")
    assert last_reply_text(driver) == first_text
    one(driver, "branch-next").click()
    wait_until(lambda: session_id_from_url(driver) == second_sid and _branch_positions(driver) == ["2/2"], 10, "back to 2/2")
    assert last_reply_text(driver) == second_text
    # One chat in the sidebar for both branches.
    ids = [e.get_attribute("data-session-id") for e in by_testid(driver, "session-item")]
    assert first_sid in ids and second_sid not in ids
    assert_no_dialogs(driver)


def test_edit_turn_one_of_three_branches_with_the_shared_history_cached(page: Any, driver: Any, base_url: str) -> None:
    page(temperature="0", maxTokens="5")
    questions = ["Name a fruit.", "Name a colour.", "Name an animal."]
    for i, q in enumerate(questions):
        type_and_send(driver, q)
        wait_reply_done(driver)
        _wait_turn_stored(driver, 2 * (i + 1))
    sid = session_id_from_url(driver)
    _, source = _request("GET", base_url + f"v1/sessions/{sid}")
    first_usage = source["messages"][1]["usage"]
    shared = first_usage["prompt_tokens"] + first_usage["completion_tokens"]  # turn 0: prompt + reply tokens

    second_user = by_testid(driver, "user-message")[1]
    second_user.find_element(By.CSS_SELECTOR, '[data-testid="edit-button"]').click()
    box = one(driver, "edit-input")
    box.clear()
    box.send_keys("Name a vegetable.")
    one(driver, "edit-save").click()
    wait_until(lambda: session_id_from_url(driver) != sid, 10, "the edited branch to open")
    wait_reply_done(driver)
    _wait_turn_stored(driver, 4)
    branch_sid = session_id_from_url(driver)
    _, branch = _request("GET", base_url + f"v1/sessions/{branch_sid}")
    assert branch["forked_from"] == {"session_id": sid, "turn": 1}
    assert [m["content"] for m in branch["messages"] if m["role"] == "user"] == ["Name a fruit.", "Name a vegetable."]
    stats = branch["messages"][3]["stats"]
    # The branch's first request found all of turn 0 in the cache (less at most a part of a block).
    assert stats["cached_tokens"] >= shared - 16 and stats["cached_tokens"] >= 32, (stats, shared)
    assert stats["prompt_tokens"] > shared
    wait_until(lambda: f"cached {stats['cached_tokens']}/{stats['prompt_tokens']} prompt" in by_testid(driver, "reply-stats")[-1].text,
               10, "the branch's stats line")
    wait_until(lambda: _branch_positions(driver) == ["2/2"], 10, "‹ 2/2 › on the edited message")
    nav = by_testid(driver, "branch-nav")[0]
    assert nav.find_element(By.XPATH, "ancestor::article").get_attribute("data-index") == "2"
    assert user_texts(driver)[1].startswith("Name a vegetable.")
    shot(driver, "edited-branch")


def _metrics(base_url: str) -> dict[str, float]:
    _, body = _get(base_url + "metrics")
    out: dict[str, float] = {}
    for line in body.decode().splitlines():
        if line.startswith("chatserve:") and "{" in line:
            name = line.split("{", 1)[0].removeprefix("chatserve:").removesuffix("_total")
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def test_cache_panel_matches_the_server(page: Any, driver: Any, base_url: str) -> None:
    page(temperature="0", maxTokens="4")
    type_and_send(driver, "Hello there.")
    wait_reply_done(driver)
    _wait_turn_stored(driver, 2)
    type_and_send(driver, "And again.")
    wait_reply_done(driver)
    _wait_turn_stored(driver, 4)
    one(driver, "cache-button").click()
    wait_until(lambda: by_testid(driver, "cache-kv-usage") and len(by_testid(driver, "cache-turn")) == 2, 10, "the cache panel")
    shown = {k: float(one(driver, k).get_attribute("data-value"))
             for k in ("cache-kv-usage", "cache-cached-blocks", "cache-hit-rate", "cache-hit-tokens")}
    m = _metrics(base_url)  # the server is idle: nothing changed since the panel read its numbers
    assert shown["cache-kv-usage"] == pytest.approx(m["kv_cache_usage_perc"])
    assert shown["cache-cached-blocks"] == m["kv_cache_cached_blocks"] > 0
    assert shown["cache-hit-tokens"] == m["prefix_cache_hits"] > 0
    assert shown["cache-hit-rate"] == pytest.approx(m["prefix_cache_hits"] / m["prefix_cache_queries"])
    # A bar per turn with the turn's own cached and prompt tokens, as the server stored them.
    _, session = _request("GET", base_url + f"v1/sessions/{session_id_from_url(driver)}")
    stored = [(m_["stats"]["cached_tokens"], m_["stats"]["prompt_tokens"]) for m_ in session["messages"] if m_["role"] == "assistant"]
    bars = [(int(b.get_attribute("data-cached")), int(b.get_attribute("data-prompt"))) for b in by_testid(driver, "cache-turn")]
    assert bars == stored and bars[1][0] > bars[0][0]
    shot(driver, "cache-panel")
    one(driver, "cache-button").click()


def test_reload_restores_each_replys_stats(page: Any, driver: Any, base_url: str) -> None:
    page(temperature="0", maxTokens="5")
    type_and_send(driver, "Name a planet.")
    wait_reply_done(driver)
    _wait_turn_stored(driver, 2)
    sid = session_id_from_url(driver)
    _, session = _request("GET", base_url + f"v1/sessions/{sid}")
    stats = session["messages"][1]["stats"]
    assert stats["ttft_s"] > 0

    page(f"#session={sid}")  # a fresh load: nothing of the live turn is left in the page
    line = wait_until(lambda: by_testid(driver, "reply-stats"), 10, "the stats line")[0].text
    ms = stats["ttft_s"] * 1000
    ttft = f"TTFT {int(ms + 0.5)} ms" if ms < 1000 else "TTFT " + re.escape(f"{ms / 1000:.2f}"[:-1])
    assert re.search(ttft, line), (line, stats)
    assert f"{stats['completion_tokens']} tokens" in line and f"cached {stats['cached_tokens']}/{stats['prompt_tokens']} prompt" in line
    if stats["decode_tokens_per_s"] is not None:
        shown = float(re.search(r"([\d.]+) tok/s", line).group(1))  # type: ignore[union-attr]
        assert shown == pytest.approx(stats["decode_tokens_per_s"], abs=0.06)


def test_rename_search_and_paging_in_the_sidebar(page: Any, driver: Any, base_url: str) -> None:
    made = []
    for i in range(55):  # more than one page of the sidebar
        status, s = _request("POST", base_url + "v1/sessions", {"metadata": {"title": f"bulk chat {i:02d}"}})
        assert status == 201
        made.append(s["id"])
    try:
        page()
        wait_until(lambda: len(by_testid(driver, "session-item")) == 50, 10, "the first 50 chats")
        one(driver, "sessions-more").click()
        wait_until(lambda: len(by_testid(driver, "session-item")) > 55, 10, "more chats after Show more")
        search = one(driver, "session-search")
        search.send_keys("bulk chat 07")
        wait_until(lambda: [e.get_attribute("data-session-id") for e in by_testid(driver, "session-item")] == [made[7]], 5, "one match")
        item = by_testid(driver, "session-item")[0]
        item.find_element(By.CSS_SELECTOR, '[data-testid="rename-session"]').click()
        box = one(driver, "rename-input")
        box.send_keys(Keys.CONTROL, "a")
        box.send_keys("Renamed <b>chat</b>", Keys.ENTER)
        wait_until(lambda: _request("GET", base_url + f"v1/sessions/{made[7]}")[1]["title"] == "Renamed <b>chat</b>", 5, "PATCH")
        search.clear()
        search.send_keys("renamed")
        wait_until(lambda: [e.text.split("\n")[0] for e in by_testid(driver, "session-item")] == ["Renamed <b>chat</b>"], 5, "the new name")
        assert driver.find_elements(By.CSS_SELECTOR, "#sidebar b") == []
    finally:
        for sid in made:
            _request("DELETE", base_url + f"v1/sessions/{sid}")


def test_settings_panel_sets_this_chats_sampling(page: Any, driver: Any, base_url: str) -> None:
    status, s = _request("POST", base_url + "v1/sessions", {"metadata": {"title": "tuned"}, "defaults": {"temperature": 0.5}})
    assert status == 201
    page(f"#session={s['id']}")
    wait_until(lambda: "tuned" in driver.find_element(By.ID, "chat-title").text, 10, "the chat")
    one(driver, "settings-button").click()
    assert one(driver, "settings-temperature").get_attribute("value") == "0.5"
    for name, value in (("top-p", "0.9"), ("top-k", "20"), ("seed", "42"), ("repetition-penalty", "1.1"), ("max-tokens", "7")):
        field = one(driver, f"settings-{name}")
        field.clear()
        field.send_keys(value)
    one(driver, "settings-stop").send_keys("END")
    one(driver, "settings-save").click()
    wait_until(lambda: not driver.execute_script("return document.getElementById('settings').open"), 5, "settings to close")
    _, got = _request("GET", base_url + f"v1/sessions/{s['id']}")
    assert got["defaults"] == {"temperature": 0.5, "top_p": 0.9, "top_k": 20, "seed": 42, "repetition_penalty": 1.1,
                               "max_tokens": 7, "stop": ["END"]}
    # A value the server would refuse is caught in the panel, naming the field.
    one(driver, "settings-button").click()
    field = one(driver, "settings-top-p")
    field.clear()
    field.send_keys("3")
    one(driver, "settings-save").click()
    assert "Top p" in wait_until(lambda: driver.find_element(By.ID, "settings-error").text, 5, "the error")
    driver.find_element(By.ID, "settings-cancel").click()
    _request("DELETE", base_url + f"v1/sessions/{s['id']}")


def test_nothing_is_loaded_from_outside_and_every_page_file_is(page: Any, driver: Any, base_url: str) -> None:
    from tests.helpers.web_files import page_files

    page()
    wait_until(lambda: driver.execute_script("return document.querySelector('[data-testid=\"status-text\"], #status-text').textContent"
                                             " === 'Connected'"), 10, "the server status")
    loaded = driver.execute_script("return performance.getEntriesByType('resource').map((e) => e.name)")
    outside = [u for u in loaded if not u.startswith(base_url)]
    assert outside == [], outside
    static = sorted({u[len(base_url + "static/"):] for u in loaded if u.startswith(base_url + "static/")})
    assert static == page_files()  # the list the wheel test checks is what the browser fetched


# A reply stream as the server sends it, with HTML in the model's text and a tool call (served to the
# page in place of POST .../messages by a stand-in fetch: the page's own streaming path renders it).
FAKE_REPLY_STREAM = r"""
const chunks = [
  {choices: [{index: 0, delta: {role: 'assistant', content: ''}}]},
  {choices: [{index: 0, delta: {content: '<script>alert(1)</script> '}}]},
  {choices: [{index: 0, delta: {content: '<img src=x onerror=alert(2)> **bold** [x](javascript:alert(3))'}}]},
  {choices: [{index: 0, delta: {tool_calls: [{index: 0, id: 'call_1', type: 'function',
                                              function: {name: 'get_weather', arguments: ''}}]}}]},
  {choices: [{index: 0, delta: {tool_calls: [{index: 0, function: {arguments: '{"city": "<b>Paris</b>"}'}}]}}]},
  {choices: [{index: 0, delta: {}, finish_reason: 'tool_calls'}]},
  {choices: [], usage: {prompt_tokens: 10, completion_tokens: 5, prompt_tokens_details: {cached_tokens: 0}}},
];
const realFetch = window.fetch;
window.fetch = (url, opts) => {
  if (String(url).endsWith('/messages') && opts && opts.method === 'POST') {
    const body = chunks.map((c) => `data: ${JSON.stringify(c)}\n\n`).join('') + 'data: [DONE]\n\n';
    return Promise.resolve(new Response(body, {status: 200, headers: {'Content-Type': 'text/event-stream'}}));
  }
  return realFetch(url, opts);
};
"""


def test_streamed_model_html_stays_text_and_tool_calls_fold(page: Any, driver: Any, base_url: str) -> None:
    status, s = _request("POST", base_url + "v1/sessions", {"metadata": {"title": "stand-in stream"}})
    assert status == 201
    page(f"#session={s['id']}")
    wait_until(lambda: "stand-in stream" in driver.find_element(By.ID, "chat-title").text, 10, "the chat")
    driver.execute_script(FAKE_REPLY_STREAM)
    type_and_send(driver, "What is the weather?")
    reply = wait_reply_done(driver)
    time.sleep(0.3)  # an injected handler would have fired by now
    assert driver.find_elements(By.CSS_SELECTOR, "#messages script, #messages img, #messages b") == []
    text = last_reply_text(driver)
    assert "<script>alert(1)</script>" in text and "<img src=x onerror=alert(2)>" in text
    assert reply.find_elements(By.CSS_SELECTOR, ".msg-body strong")[0].text == "bold"
    assert reply.find_elements(By.CSS_SELECTOR, ".msg-body a") == []  # a javascript: link is text
    call = one(driver, "tool-call")
    assert call.tag_name == "details" and call.get_attribute("open") is None  # folded
    assert "get_weather" in call.text and "call_1" in call.text
    call.find_element(By.TAG_NAME, "summary").click()
    assert json.loads(call.find_element(By.TAG_NAME, "pre").text) == {"city": "<b>Paris</b>"}
    assert reply.get_attribute("data-finish-reason") == "tool_calls"
    assert_no_dialogs(driver)
    _request("DELETE", base_url + f"v1/sessions/{s['id']}")


def test_copy_buttons_work_without_a_secure_context(page: Any, driver: Any) -> None:
    """Over http://<LAN-IP> there is no navigator.clipboard: a click on Copy still copies, through
    the hidden-textarea fallback (the clipboard API is removed here to stand for that)."""
    driver = page()
    driver.execute_async_script("""
      const done = arguments[arguments.length - 1];
      Object.defineProperty(navigator, 'clipboard', {value: undefined, configurable: true});
      window.__copied = [];
      document.addEventListener('copy', (e) => window.__copied.push(e.target.value ?? String(document.getSelection())));
      import('./static/markdown.js').then((md) => {
        const box = document.createElement('article');
        box.className = 'msg assistant';
        document.getElementById('messages').append(box);
        md.renderMarkdown('```python\\nprint("hi")\\n```', box);
        document.getElementById('empty-state').hidden = true;
        done(true);
      });
    """)
    button = one(driver, "copy-button")
    button.click()
    wait_until(lambda: button.text == "Copied", 5, "Copied on the button")
    assert driver.execute_script("return window.__copied") == ['print("hi")']
    assert driver.execute_script("return document.querySelectorAll('textarea[readonly]').length") == 0


def test_shortcuts_help_and_theme_toggle(page: Any, driver: Any) -> None:
    page()
    body = driver.find_element(By.TAG_NAME, "body")
    body.send_keys("?")
    wait_until(lambda: driver.execute_script("return document.getElementById('help').open"), 5, "the help popover")
    text = one(driver, "help-dialog").text
    assert "New chat" in text and "Stop" in text and "Regenerate" in text and "Focus" in text
    driver.find_element(By.ID, "help-close").click()
    assert driver.execute_script("return document.documentElement.dataset.theme") is None  # follows the system
    one(driver, "theme-toggle").click()
    assert driver.execute_script("return document.documentElement.dataset.theme") == "light"
    one(driver, "theme-toggle").click()
    assert driver.execute_script("return document.documentElement.dataset.theme") == "dark"
    bg = driver.execute_script("return getComputedStyle(document.body).backgroundColor")
    assert bg == "rgb(17, 19, 24)", bg
    shot(driver, "theme-dark-toggle")
    one(driver, "theme-toggle").click()
    assert driver.execute_script("return document.documentElement.dataset.theme") is None
    body.send_keys("/")
    assert driver.switch_to.active_element.get_attribute("data-testid") == "message-input"


# Records every fetch the page makes (URL and headers), so a test can see what a router would see.
FETCH_RECORDER = r"""
window.__fetches = [];
const recordedFetch = window.fetch;
window.fetch = (url, opts) => {
  const headers = {};
  for (const [k, v] of Object.entries((opts && opts.headers) || {})) headers[k.toLowerCase()] = v;
  window.__fetches.push({url: String(url), method: (opts && opts.method) || 'GET', headers});
  return recordedFetch(url, opts);
};
"""


def test_session_turns_and_their_cancel_carry_x_session_id(page: Any, base_url: str) -> None:
    """A router in front of replicas keys session affinity on X-Session-Id: the page sends it on the
    turn, on the cancel of that turn (whose URL names only the request) and on session reads."""
    driver = page()
    driver.execute_script(FETCH_RECORDER)
    set_in_settings_panel(driver, temperature="0", max_tokens="400")
    type_and_send(driver, "Tell me a long story about a lighthouse keeper.")
    wait_until(lambda: len(last_reply_text(driver) or "") >= 5, 60, "the first tokens of the reply")
    one(driver, "stop-button").click()
    wait_until(lambda: driver.execute_script(
        "return window.__fetches.some((f) => f.url.includes('/cancel'))"), 10, "the cancel call")
    sid = session_id_from_url(driver)
    calls = driver.execute_script("return window.__fetches")
    turns = [c for c in calls if c["method"] == "POST" and c["url"].endswith(f"/v1/sessions/{sid}/messages")]
    cancels = [c for c in calls if c["url"].endswith("/cancel")]
    assert turns and all(c["headers"].get("x-session-id") == sid for c in turns), turns
    assert cancels and all(c["headers"].get("x-session-id") == sid for c in cancels), cancels
    reads = [c for c in calls if f"/v1/sessions/{sid}" in c["url"]]
    assert all(c["headers"].get("x-session-id") == sid for c in reads), reads


# ---------------------------------------------------------------------------------------------
# Reasoning: a server whose engine says a reply in the reasoning-then-answer shape with exact text
# (the real engine over the scripted worker, tests/helpers/reasoning.py), with Qwen3's thinking
# template, so the qwen3 parser splits it; one scripted step every 20 ms so the reasoning streams.

WEB_REASONING = "first i look at the question then i think about colours and then i answer briefly"
WEB_ANSWER = "Red and **blue**."


@pytest.fixture(scope="module")
def reasoning_url(smollm_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    import threading

    import uvicorn

    from chatserve.server import ServerSettings, create_app
    from chatserve.sessions import InMemorySessionStore
    from tests.helpers.fake_engine import FakeEngine
    from tests.helpers.net import free_port
    from tests.helpers.reasoning import qwen3_thinking_template, reasoning_reply

    template = tmp_path_factory.mktemp("reasoning") / "qwen3_thinking.jinja"
    template.write_text(qwen3_thinking_template(), encoding="utf-8")
    engine = FakeEngine(smollm_tokenizer, reply=reasoning_reply(WEB_REASONING, WEB_ANSWER), max_model_len=1024)
    step = engine.worker.execute

    def slow_step(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.02)
        return step(*args, **kwargs)

    engine.worker.execute = slow_step  # type: ignore[method-assign]
    app = create_app(engine, InMemorySessionStore(), ServerSettings(chat_template=str(template), serve_web=True))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, "the reasoning server to start")
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        server.should_exit = True
        thread.join(timeout=15)


# Samples the newest reply's reasoning block every 10 ms: its text length and whether it is open.
REASONING_SAMPLER = """
window.__thinking = [];
window.__thinkingSampler = setInterval(() => {
  const blocks = document.querySelectorAll('[data-testid="assistant-message"] [data-testid="reasoning"]');
  const b = blocks[blocks.length - 1];
  if (!b || b.hidden) return;
  const n = b.querySelector('[data-testid="reasoning-text"]').textContent.length;
  const last = window.__thinking[window.__thinking.length - 1];
  if (!last || last[0] !== n || last[1] !== b.open) window.__thinking.push([n, b.open]);
}, 10);
"""


def test_reasoning_streams_into_a_folded_block_above_the_answer_and_comes_back_on_reload(
        driver: Any, reasoning_url: str) -> None:
    driver.get(reasoning_url)
    driver.execute_script("localStorage.clear();")
    driver.get(reasoning_url)
    wait_until(lambda: driver.execute_script("return document.documentElement.dataset.ready === '1'"), 10, "page ready")
    driver.execute_script(REASONING_SAMPLER)
    type_and_send(driver, "Name two colours.")
    reply = wait_reply_done(driver, timeout=60)
    seen = driver.execute_script("clearInterval(window.__thinkingSampler); return window.__thinking")
    # streamed as it came: the block was open and its text grew in several steps before it folded
    growing = [n for n, is_open in seen if is_open]
    assert len(growing) >= 3 and growing == sorted(growing), seen
    assert seen[-1] == [len(WEB_REASONING), False], seen

    def shown(reply: WebElement) -> tuple[str, str, str | None, str]:
        block = reply.find_element(By.CSS_SELECTOR, '[data-testid="reasoning"]')
        text = block.find_element(By.CSS_SELECTOR, '[data-testid="reasoning-text"]').get_attribute("textContent")
        body = reply.find_element(By.CSS_SELECTOR, ".msg-body")
        above = driver.execute_script(
            "return arguments[0].compareDocumentPosition(arguments[1]) & Node.DOCUMENT_POSITION_FOLLOWING", block, body)
        assert above, "the reasoning block is above the answer"
        return text, body.text, block.get_attribute("open"), block.find_element(By.TAG_NAME, "summary").text

    text, answer, is_open, summary = shown(reply)
    assert (text, answer, is_open, summary) == (WEB_REASONING, "Red and blue.", None, "Thought")
    assert reply.find_elements(By.CSS_SELECTOR, ".msg-body strong")[0].text == "blue"  # the answer is Markdown
    assert "think>" not in answer and WEB_REASONING not in answer
    sid = session_id_from_url(driver)
    status, stored = _request("GET", reasoning_url + f"v1/sessions/{sid}")
    assert status == 200 and stored["messages"][1]["reasoning"] == WEB_REASONING
    shot(driver, "reasoning-live")

    driver.refresh()  # a reload: the reply comes back from the session store, its reasoning folded above it
    wait_until(lambda: driver.execute_script("return document.documentElement.dataset.ready === '1'"), 10, "page ready")
    reply = wait_until(lambda: by_testid(driver, "assistant-message"), 10, "the stored reply")[-1]
    text, answer, is_open, summary = shown(reply)
    assert (text, answer, is_open, summary) == (WEB_REASONING, "Red and blue.", None, "Thought")
    block = reply.find_element(By.CSS_SELECTOR, '[data-testid="reasoning"]')
    block.find_element(By.TAG_NAME, "summary").click()  # the user unfolds it
    assert block.get_attribute("open") is not None
    assert block.find_element(By.CSS_SELECTOR, '[data-testid="reasoning-text"]').text == WEB_REASONING
    shot(driver, "reasoning-reloaded")
    assert_no_dialogs(driver)
