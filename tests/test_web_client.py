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
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from .helpers.net import wait_until
from .helpers.server import ROOT, start_server

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
ARTIFACTS = Path(os.environ.get("CHATSERVE_TEST_ARTIFACTS", ROOT / "tests" / "artifacts"))
SERVER_START_TIMEOUT = 120.0

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

pytestmark = pytest.mark.timeout(300)

# Records alert()/confirm()/prompt() calls instead of showing them: an injected handler that ran
# would leave a trace here, and no modal dialog can wedge the driver.
ALERT_TRAP = """
window.__dialogs = [];
for (const name of ['alert', 'confirm', 'prompt']) {
  window[name] = (...args) => { window.__dialogs.push([name, String(args[0])]); return null; };
}
"""

# Samples the length of the newest reply's text every 15 ms while it streams.
LENGTH_SAMPLER = """
window.__lengths = [];
window.__sampler = setInterval(() => {
  const replies = document.querySelectorAll('[data-testid="assistant-message"] .msg-body');
  const last = replies[replies.length - 1];
  const n = last ? last.textContent.length : 0;
  const seen = window.__lengths;
  if (seen.length === 0 || seen[seen.length - 1] !== n) seen.push(n);
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
    assert lengths == sorted(lengths), f"the reply text shrank while streaming: {lengths}"
    stats_text = stats[0].text
    assert "TTFT" in stats_text and "tok/s" in stats_text and "cached" in stats_text, stats_text
    assert one(driver, "message-input").is_enabled()
    assert [e.text for e in by_testid(driver, "user-message")] == [message]

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
    t0 = time.monotonic()
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
    stopped_after = time.monotonic() - t0
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
    assert stopped_after < 10
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
    wait_until(lambda: [e.text for e in by_testid(driver, "user-message")] == [message], 10, "the history to show")
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
        assert [e.text for e in by_testid(driver, "user-message")] == [payload]
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
