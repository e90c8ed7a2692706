"""Every file the web page loads, read from the page itself: the stylesheet and script of
index.html, then each ES module's static and dynamic imports, followed to the end. The wheel test
checks each ships and is served; the browser test checks it is exactly what Chromium fetched."""

from __future__ import annotations

import re
from pathlib import Path

from .server import ROOT

WEB = ROOT / "chatserve" / "web"
_HTML_REF = re.compile(r'(?:href|src)="static/([^"]+)"')
_IMPORT = re.compile(r"""(?:\bfrom\s*|\bimport\s*\(\s*|\bimport\s+)['"](\.{1,2}/[^'"]+)['"]""")


def page_files(web: Path = WEB) -> list[str]:
    """Paths under /static/ the page loads, sorted (e.g. "app.js", "vendor/markdown-it/...mjs")."""
    html = (web / "index.html").read_text()
    todo = _HTML_REF.findall(html)
    seen: set[str] = set()
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        seen.add(rel)
        if rel.endswith((".js", ".mjs")):
            base = Path(rel).parent
            for spec in _IMPORT.findall((web / rel).read_text()):
                todo.append(str((base / spec).as_posix()).replace("/./", "/").removeprefix("./"))
    return sorted(_normalise(p) for p in seen)


def _normalise(path: str) -> str:
    parts: list[str] = []
    for part in path.split("/"):
        if part == "..":
            parts.pop()
        elif part not in ("", "."):
            parts.append(part)
    return "/".join(parts)
