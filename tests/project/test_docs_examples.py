"""The documentation's code examples run, every page is in the site's nav, and the README stays a front door.

Examples: every fenced ```python block of docs/*.md and README.md runs as a script in its own process
(a fork of the worker's warm interpreter, `tests/helpers/prefork.py`: `runpy` of the script as
`python script.py` would, its imports already done; cwd the repository root, the checkout first on
PYTHONPATH, HF_HUB_OFFLINE=1, a bounded timeout) and must exit 0. A block that talks to a server at the documented address
(`http://127.0.0.1:8000`, `localhost:8000`) runs against a live `chatserve serve` this module starts
(default model, no API key, so the examples' placeholder keys work as written): the address is replaced
by the server's in the block's text before it runs. Identical blocks (the README mirrors docs/index.md)
run once, under the id of their first occurrence.

Shell blocks are not run by default: most are command lines to copy (starting servers, benchmarks,
clusters) or need ids a previous call returned (`sess_...`). A ```bash block runs only when the line
before its fence is `<!-- docs-test: run -->`; it runs under `bash -euo pipefail` with the same address
substitution and a `curl` that fails on an HTTP error status (`--fail-with-body`), so a 4xx fails the test.

A Python block that needs what this test cannot give (a GPU, Redis at a fixed URL, a second machine)
carries `<!-- docs-test: skip (the reason) -->` on the line before its fence and is reported as skipped
with that reason. Any other `docs-test` comment is an error (a typo must not silently skip a block).
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import prefork
from tests.helpers.paths import REPO_ROOT

ROOT = REPO_ROOT
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md")) + [ROOT / "README.md"]
# Model loads (and, in a new checkout, the kernel build) dominate an offline example's time.
TIMEOUT_S = float(os.environ.get("DOCS_EXAMPLE_TIMEOUT_S", "600"))
README_MAX_LINES = 200

MARKER = re.compile(r"^<!--\s*docs-test:\s*(?P<body>.*?)\s*-->$")
SKIP = re.compile(r"^skip \((?P<reason>.+)\)$")
FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")
# The documented server address, in the spellings the examples use.
SERVER_ADDRESS = re.compile(r"(?:http://)?(?:127\.0\.0\.1|localhost):8000")


@dataclass(frozen=True)
class Example:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    marker: str | None  # the docs-test comment's body, if any

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def skip_reason(self) -> str | None:
        m = SKIP.match(self.marker or "")
        return m["reason"] if m else None

    @property
    def needs_server(self) -> bool:
        return bool(SERVER_ADDRESS.search(self.code))


def fenced_blocks(page: Path) -> list[Example]:
    """Every top-level fenced block of `page`, with the docs-test comment on the line before it."""
    lines = page.read_text().splitlines()
    out: list[Example] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, lang = i, m["lang"]
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        prev = lines[start - 1].strip() if start else ""
        marker = MARKER.match(prev)
        out.append(Example(page, start + 1, lang, "\n".join(lines[start + 1 : j]) + "\n",
                           marker["body"] if marker else None))
        i = j + 1
    return out


def runnable_examples() -> list[Example]:
    seen: set[tuple[str, str]] = set()
    out = []
    for page in PAGES:
        for ex in fenced_blocks(page):
            if ex.lang == "python" or (ex.lang in ("bash", "sh") and ex.marker == "run"):
                key = (ex.lang, ex.code.strip())
                if key not in seen:
                    seen.add(key)
                    out.append(ex)
    return out


EXAMPLES = runnable_examples()


@pytest.fixture(scope="module")
def docs_server():
    """A live server for the examples that talk to one: default model and dtype, no API key."""
    from tests.helpers.server import start_server

    srv = start_server("--max-model-len", "2048", "--block-size", "16")
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def _run(ex: Example, code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    env.pop("OPENAI_API_KEY", None)
    if ex.lang == "python":  # a fork of the worker's warm interpreter (tests/helpers/prefork.py)
        script = tmp_path / "example.py"
        script.write_text(code)
        return prefork.run([str(script)], env=env, cwd=ROOT, timeout=TIMEOUT_S, out_dir=tmp_path / "output")
    else:
        curl = 'curl() { command curl --fail-with-body --max-time 120 "$@"; }\n'
        argv = ["bash", "-euo", "pipefail", "-c", curl + code]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.mark.parametrize("ex", EXAMPLES, ids=[ex.id for ex in EXAMPLES])
def test_docs_example_runs(ex: Example, request, tmp_path):
    if ex.skip_reason:
        pytest.skip(f"{ex.id}: {ex.skip_reason}")
    code = ex.code
    if ex.needs_server:
        srv = request.getfixturevalue("docs_server")
        code = SERVER_ADDRESS.sub(srv.url, code)
    proc = _run(ex, code, tmp_path)
    assert proc.returncode == 0, (f"{ex.id} ({ex.lang}) exited {proc.returncode}\n--- code\n{code}"
                                  f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    if ex.needs_server:
        srv.wait_idle(timeout=30)  # an example must not leave a request running on the shared server


def test_every_docs_test_marker_is_known_and_on_a_block():
    """A `docs-test` comment is `run` (bash) or `skip (reason)`, right before a fence: a typo fails here."""
    bad = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        for n, line in enumerate(lines):
            m = MARKER.match(line.strip())
            if not m:
                if "docs-test" in line:
                    bad.append(f"{page.name}:{n + 1}: not a docs-test comment: {line.strip()}")
                continue
            body = m["body"]
            nxt = FENCE.match(lines[n + 1]) if n + 1 < len(lines) else None
            if not nxt:
                bad.append(f"{page.name}:{n + 1}: not right before a fenced block")
            elif body == "run" and nxt["lang"] not in ("bash", "sh"):
                bad.append(f"{page.name}:{n + 1}: `run` is for bash blocks (python blocks always run)")
            elif body != "run" and not SKIP.match(body):
                bad.append(f"{page.name}:{n + 1}: unknown docs-test comment {body!r}")
    assert not bad, "\n".join(bad)


def test_there_are_examples_to_run():
    langs = [ex.lang for ex in EXAMPLES]
    assert langs.count("python") >= 5 and "bash" in langs, langs
    assert any(ex.needs_server for ex in EXAMPLES) and any(not ex.needs_server for ex in EXAMPLES)


def _nav_pages(node) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [p for item in node for p in _nav_pages(item)]
    if isinstance(node, dict):
        return [p for value in node.values() for p in _nav_pages(value)]
    return []


def test_every_docs_page_is_in_the_nav():
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(set(nav)) == sorted(nav), f"a page twice in the nav: {nav}"
    assert not set(pages) - set(nav), f"pages missing from mkdocs.yml's nav: {sorted(set(pages) - set(nav))}"
    assert not set(nav) - set(pages), f"nav entries with no page: {sorted(set(nav) - set(pages))}"
    assert config.get("strict") is True


def test_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    n = len(text.splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}: the manual is docs/)"
    for needle in ("## Quick start", "make serve", "make test"):
        assert needle in text, needle


def test_readme_links_resolve():
    """mkdocs checks the pages' links; the README is outside docs/, so its relative links are checked here."""
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert targets and not missing, missing
