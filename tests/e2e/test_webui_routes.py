"""The web UI's routes over HTTP (izh.api.webui.routes), on a real server over the FakeEngineCore: the pages
and their files are public while the API behind them needs the key, each is served with its content
type, an ETag that turns a reload into a 304, gzip, and a CSP on the pages; `web_ui=False` serves
none of them."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from izh.api.webui.routes import CONTENT_SECURITY_POLICY, load_assets
from izh.config import EngineConfig
from tests.e2e.api_server import ApiServer, api_server
from tests.engine.fake_core import make_fake_model

KEY = "webui-key"
FAKE_CORE = "tests.engine.fake_core:FakeEngineCore"


@pytest.fixture(scope="module")
def fake_model_dir(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_fake_model(
        tiny_llama_dir,
        tmp_path_factory.mktemp("fake_model"),
        step_delay_s=0.0,
        max_model_len=256,
        vocab_size=1000,
    )


def _server(model_dir: Path, **app_kwargs: object) -> object:
    config = EngineConfig(model=str(model_dir), served_model_name="fake")
    return api_server(config, start_kwargs={"core_factory": FAKE_CORE}, **app_kwargs)


@pytest.fixture(scope="module")
def server(fake_model_dir: Path) -> Iterator[ApiServer]:
    with _server(fake_model_dir, api_keys=[KEY]) as started:  # type: ignore[attr-defined]
        yield started


def test_the_pages_and_their_files_are_public_and_the_api_is_not(server: ApiServer) -> None:
    for path in ["/", "/dashboard", *(f"/webui/{name}" for name in load_assets())]:
        assert httpx.get(server.url + path).status_code == 200, path
    for path in ["/v1/models", "/v1/izh/stats", "/webui/not-a-file.js"]:
        response = httpx.get(server.url + path)
        assert response.status_code == 401, path
        assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_a_missing_file_is_a_404_in_the_error_envelope(server: ApiServer) -> None:
    response = httpx.get(server.url + "/webui/nope.js", headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 404
    assert "nope.js" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("path", "content_type", "page"),
    [
        ("/", "text/html; charset=utf-8", True),
        ("/dashboard", "text/html; charset=utf-8", True),
        ("/webui/chat.js", "text/javascript; charset=utf-8", False),
        ("/webui/dashboard.js", "text/javascript; charset=utf-8", False),
        ("/webui/style.css", "text/css; charset=utf-8", False),
        ("/webui/icon.svg", "image/svg+xml", False),
    ],
)
def test_content_type_security_headers_and_revalidation(
    server: ApiServer, path: str, content_type: str, page: bool
) -> None:
    response = httpx.get(server.url + path, headers={"Accept-Encoding": "identity"})
    assert response.status_code == 200
    assert response.headers["content-type"] == content_type
    assert response.headers["x-content-type-options"] == "nosniff"
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers.get("content-security-policy") == (CONTENT_SECURITY_POLICY if page else None)
    assert "content-encoding" not in response.headers
    etag = response.headers["etag"]
    assert etag.startswith('"') and etag.endswith('"')
    again = httpx.get(server.url + path, headers={"If-None-Match": etag})
    assert again.status_code == 304 and again.content == b"" and again.headers["etag"] == etag
    other = httpx.get(server.url + path, headers={"If-None-Match": '"stale"'})
    assert other.status_code == 200 and other.content == response.content


def test_gzip_when_the_client_accepts_it(server: ApiServer) -> None:
    with httpx.Client() as client:
        request = client.build_request(
            "GET", server.url + "/webui/chat.js", headers={"Accept-Encoding": "gzip"}
        )
        response = client.send(request, stream=True)
        raw = b"".join(response.iter_raw())
    assert response.headers["content-encoding"] == "gzip"
    assert response.headers["vary"] == "Accept-Encoding"
    assert gzip.decompress(raw) == load_assets()["chat.js"].body
    refused = httpx.get(server.url + "/webui/chat.js", headers={"Accept-Encoding": "gzip;q=0"})
    assert "content-encoding" not in refused.headers


def test_the_pages_stay_out_of_the_openapi_document(server: ApiServer) -> None:
    paths = httpx.get(server.url + "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()[
        "paths"
    ]
    assert "/" not in paths and "/dashboard" not in paths and "/v1/chat/completions" in paths


def test_web_ui_off_serves_no_page(fake_model_dir: Path) -> None:
    with _server(fake_model_dir, web_ui=False) as started:  # type: ignore[attr-defined]
        for path in ["/", "/dashboard", "/webui/chat.js"]:
            response = httpx.get(started.url + path)
            assert response.status_code == 404, path
        assert httpx.get(started.url + "/v1/models").status_code == 200
