"""The playground page of `dgemma serve` (`GET /`; `--no-ui` turns it off): a chat that streams
over the server's own OpenAI endpoints and draws the draft frames of the block being denoised.

The page is three static files beside this module (index.html, app.js, style.css): no build step,
no CDN, no external fonts. They are served with a Content-Security-Policy that lets the page load
and connect to its own origin only (images: also the data: and blob: URLs of uploads), so it works
offline and cannot reach anything else.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, Response

STATIC = Path(__file__).parent
FILES = {"app.js": "text/javascript", "style.css": "text/css"}
POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {"Content-Security-Policy": POLICY, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


def add_playground(app: FastAPI) -> None:
    """Serve the page at `/` and its two assets under `/ui/`."""

    @app.get("/", include_in_schema=False)
    async def page() -> Response:
        return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8", headers=HEADERS)

    for name, kind in FILES.items():
        app.add_api_route(f"/ui/{name}", _asset(STATIC / name, kind), methods=["GET"], include_in_schema=False)


def _asset(path: Path, kind: str):
    """The route of one asset: a handler without parameters (FastAPI turns a handler's arguments
    into query parameters, so nothing a client sends may choose the file or its type)."""

    async def asset() -> Response:
        return FileResponse(path, media_type=f"{kind}; charset=utf-8", headers=HEADERS)

    return asset
