"""The browser client: `/` and its static files (vendored libraries under vendor/ included), shipped
inside the package (`chatserve.web`)."""

from __future__ import annotations

import importlib.resources
import mimetypes
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from chatserve.server.errors import error_body

# The vendored markdown-it is an ES module file (.mjs); a module script needs a JavaScript type,
# and not every platform's mimetypes table knows the suffix.
mimetypes.add_type("text/javascript", ".mjs")


def _web_dir() -> Any:
    return importlib.resources.files("chatserve.web")


async def index(request: Request) -> Response:
    page = _web_dir() / "index.html"
    if not page.is_file():
        return JSONResponse(error_body(404, "the web client is not installed (web/index.html missing)"), status_code=404)
    return FileResponse(str(page), media_type="text/html")


def routes() -> list[BaseRoute]:
    return [
        Route("/", index, methods=["GET"]),
        Mount("/static", app=StaticFiles(directory=str(_web_dir())), name="static"),
    ]


__all__ = ["routes"]
