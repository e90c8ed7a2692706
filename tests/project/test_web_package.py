"""The web page ships whole: a wheel built from this checkout, installed into a fresh folder,
serves every file the page loads (vendored libraries and their licences included) from the
installed package, not from the checkout."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers.server import ROOT
from tests.helpers.web_files import WEB, page_files

pytestmark = pytest.mark.timeout(600)

# Run in the installed copy: fetch each path through the package's own web routes.
_SERVE_CHECK = """
import json, sys
import chatserve.server.web as web
from starlette.applications import Starlette
from starlette.testclient import TestClient
assert "site" in web.__file__ or sys.argv[1] in web.__file__, web.__file__
client = TestClient(Starlette(routes=web.routes()))
out = {"module": web.__file__, "/": client.get("/").status_code}
for path in json.loads(sys.argv[2]):
    r = client.get("/static/" + path)
    out[path] = [r.status_code, r.headers.get("content-type", ""), len(r.content)]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(ROOT), "-w", str(out)],
                   check=True, timeout=500)
    (found,) = out.glob("chatserve-*.whl")
    return found


def test_the_page_loads_vendored_libraries_with_their_licences() -> None:
    files = page_files()
    assert "vendor/markdown-it/markdown-it.esm.min.mjs" in files
    assert "vendor/highlight.js/core.min.js" in files
    assert len([f for f in files if f.startswith("vendor/highlight.js/languages/")]) >= 12
    for lib in ("markdown-it", "highlight.js"):
        assert (WEB / "vendor" / lib / "LICENSE").read_text().strip()
    assert not any("://" in f for f in files)


def test_installed_wheel_serves_every_file_the_page_loads(wheel: Path, tmp_path: Path) -> None:
    files = page_files()
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    missing = [f for f in files + ["index.html", "vendor/markdown-it/LICENSE", "vendor/markdown-it/NOTICE",
                                   "vendor/highlight.js/LICENSE"] if f"chatserve/web/{f}" not in names]
    assert missing == [], f"not in {wheel.name}: {missing}"

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, timeout=300)
    # cwd outside the checkout and PYTHONPATH the install only: `chatserve` is the installed copy.
    run = subprocess.run([sys.executable, "-c", _SERVE_CHECK, str(target), json.dumps(files)], cwd=tmp_path,
                         env={"PYTHONPATH": str(target) + ":" + ":".join(p for p in sys.path if "site-packages" in p),
                              "HF_HUB_OFFLINE": "1"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    served = json.loads(run.stdout.strip().splitlines()[-1])
    assert served["module"].startswith(str(target)), served["module"]
    assert served["/"] == 200
    for path in files:
        status, ctype, size = served[path]
        assert status == 200 and size > 0, (path, served[path])
        if path.endswith((".js", ".mjs")):
            assert ctype.startswith("text/javascript"), (path, ctype)  # module scripts need a JavaScript type
