"""The built-in web UI: a chat page at / and a live dashboard at /dashboard, served from the package.

The pages are plain HTML, CSS and hand-written ES modules in izh/api/webui/static/ (package data:
nothing to build, nothing fetched at run time). They call the API the way any client does (the chat
page /v1/models and /v1/chat/completions, the dashboard /metrics and /v1/izh/stats), so the pages
themselves are public (`register_web_ui` returns their paths for the guard) while, with API keys, the
API behind them still needs a key: the page asks for it once and sends it as a bearer token.

Every file is read once, and served with its content type, a strong ETag (a conditional GET gets a
304), `Cache-Control: no-cache` (the browser revalidates, so an upgrade shows at once), gzip when
the client accepts it, and on the pages a Content-Security-Policy that allows only this origin.
"""

from __future__ import annotations

import gzip
import hashlib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from izh.errors import NotFound

STATIC_PACKAGE = "izh.api.webui"
STATIC_FOLDER = "static"
ASSET_PREFIX = "/webui/"
PAGES = {"/": "index.html", "/dashboard": "dashboard.html"}
"""Page path → its file in the static folder."""
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@dataclass(frozen=True, slots=True)
class Asset:
    """One static file as served: its bytes (plain and gzipped), content type and ETag."""

    name: str
    body: bytes
    gzipped: bytes
    content_type: str
    etag: str


@cache
def load_assets() -> dict[str, Asset]:
    """Every file of the static folder by name, read once."""
    assets: dict[str, Asset] = {}
    folder = resources.files(STATIC_PACKAGE).joinpath(STATIC_FOLDER)
    for entry in folder.iterdir():
        suffix = "." + entry.name.rpartition(".")[2]
        if not entry.is_file() or suffix not in CONTENT_TYPES:
            continue
        body = entry.read_bytes()
        digest = hashlib.sha256(body).hexdigest()[:20]
        assets[entry.name] = Asset(
            name=entry.name,
            body=body,
            gzipped=gzip.compress(body, compresslevel=9, mtime=0),
            content_type=CONTENT_TYPES[suffix],
            etag=f'"{digest}"',
        )
    missing = set(PAGES.values()) - assets.keys()
    if missing:
        raise RuntimeError(f"the web UI's files are missing from the package: {sorted(missing)}")
    return assets


def _if_none_match(request: Request, etag: str) -> bool:
    header = request.headers.get("if-none-match")
    if not header:
        return False
    tags = {tag.strip().removeprefix("W/") for tag in header.split(",")}
    return etag in tags or "*" in tags


def _accepts_gzip(request: Request) -> bool:
    for part in request.headers.get("accept-encoding", "").split(","):
        coding, _, params = part.strip().partition(";")
        if coding.strip().lower() == "gzip":
            return params.replace(" ", "") not in ("q=0", "q=0.0", "q=0.00", "q=0.000")
    return False


def serve_asset(request: Request, asset: Asset, *, page: bool) -> Response:
    """`asset` as the answer to `request`: 304 on a matching If-None-Match, else the bytes."""
    headers = {
        "ETag": asset.etag,
        "Cache-Control": "no-cache",
        "Vary": "Accept-Encoding",
        **_SECURITY_HEADERS,
    }
    if page:
        headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
    if _if_none_match(request, asset.etag):
        return Response(status_code=304, headers=headers)
    body = asset.body
    if _accepts_gzip(request) and len(asset.gzipped) < len(asset.body):
        body = asset.gzipped
        headers["Content-Encoding"] = "gzip"
    return Response(body, media_type=asset.content_type, headers=headers)


async def chat_page(request: Request) -> Response:
    """The chat page (GET /)."""
    return serve_asset(request, load_assets()[PAGES["/"]], page=True)


async def dashboard_page(request: Request) -> Response:
    """The live dashboard (GET /dashboard)."""
    return serve_asset(request, load_assets()[PAGES["/dashboard"]], page=True)


async def static_asset(request: Request) -> Response:
    """A script, style sheet or icon of the pages (GET /webui/NAME)."""
    name = request.path_params["name"]
    asset = load_assets().get(name)
    if asset is None:
        raise NotFound(f"no web UI file {name!r}", code="not_found")
    return serve_asset(request, asset, page=name.endswith(".html"))


WEBUI_ROUTES: list[tuple[str, Any, list[str]]] = [
    ("/", chat_page, ["GET"]),
    ("/dashboard", dashboard_page, ["GET"]),
    (ASSET_PREFIX + "{name}", static_asset, ["GET"]),
]
"""(path, endpoint, methods) of the web UI's routes."""


def public_paths() -> frozenset[str]:
    """The paths the guard lets through without a key: the pages and each of their files."""
    return frozenset(PAGES) | {ASSET_PREFIX + name for name in load_assets()}


def register_web_ui(app: FastAPI) -> frozenset[str]:
    """Add the web UI's routes to `app` (outside its OpenAPI document); returns their public paths."""
    for path, endpoint, methods in WEBUI_ROUTES:
        app.add_api_route(path, endpoint, methods=methods, include_in_schema=False)
    return public_paths()


__all__ = ["CONTENT_SECURITY_POLICY", "WEBUI_ROUTES", "load_assets", "public_paths", "register_web_ui"]
