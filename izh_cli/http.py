"""The CLI's HTTP client side of an OpenAI-compatible server: its URLs, auth, errors, SSE framing and models.

``izh bench``, ``izh chat`` and ``izh inspect`` talk to a server through this module: the shared Typer
options (``--url``, ``--api-key``, ``--model``), the /v1 and root URLs, the bearer header, error
messages and short error kinds, SSE decoding and the /v1/models listing. The commands import it at
start-up, so httpx is imported only inside the functions that need it: ``izh --help`` stays instant.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    import httpx

DEFAULT_URL = "http://127.0.0.1:8000/v1"
URL_ENVVARS = ["IZH_URL", "OPENAI_BASE_URL"]
API_KEY_ENVVARS = ["IZH_API_KEY", "OPENAI_API_KEY"]
DONE = b"[DONE]"

# The options every toolkit command shares, declared once.
UrlOption = Annotated[
    str, typer.Option("--url", envvar=URL_ENVVARS, help="Server URL (with or without /v1).")
]
ModelOption = Annotated[
    str | None,
    typer.Option("--model", "-m", help="Model name; default: the first of /v1/models.", show_default=False),
]
ApiKeyOption = Annotated[
    str | None, typer.Option("--api-key", envvar=API_KEY_ENVVARS, help="Bearer token.", show_default=False)
]


@dataclass(frozen=True, slots=True)
class ServerUrls:
    """A server's two roots: ``root`` serves /metrics, /health, /version, /tokenize; ``api`` the /v1 routes."""

    root: str
    api: str

    @property
    def verify_tls(self) -> bool:
        """The client's ``verify``: an http server is never asked over TLS (redirects are not followed),
        so only an https one needs the CA bundle, which takes ~0.1 s of a command's start to load."""
        return self.root.startswith("https://")

    @property
    def chat(self) -> str:
        return f"{self.api}/chat/completions"

    @property
    def completions(self) -> str:
        return f"{self.api}/completions"


def resolve_urls(url: str) -> ServerUrls:
    """Accept ``http://host:port`` or ``http://host:port/v1`` (with or without a trailing slash).

    Raises ValueError for anything that is not an http(s) URL.
    """
    text = url.strip().rstrip("/")
    if not text.startswith(("http://", "https://")) or len(text.split("//", 1)[1]) == 0:
        raise ValueError(f"not an http(s) URL: {url!r}")
    root = text.removesuffix("/v1")
    return ServerUrls(root=root, api=f"{root}/v1")


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def error_message(body: bytes, fallback: str) -> str:
    """The message inside an error body: OpenAI's nested envelope, SGLang's flat one, TGI's or a bare string."""
    try:
        data = json.loads(body)
    except ValueError:
        text = body.decode("utf-8", "replace").strip()
        return text[:200] or fallback
    return _message_from(data) or fallback


def _message_from(data: Any) -> str | None:
    if isinstance(data, str):
        return data
    if not isinstance(data, dict):
        return None
    error = data.get("error")
    if isinstance(error, dict):
        message = error.get("message")
        return str(message) if message else None
    if isinstance(error, str):
        return error
    message = data.get("message") or data.get("detail")
    return str(message) if message else None


def http_error_kind(status: int, message: str) -> str:
    """A short, groupable label for a failed request: status code and the first line of the message."""
    first_line = message.strip().splitlines()[0] if message.strip() else ""
    return f"HTTP {status}: {first_line[:120]}".rstrip(": ")


def exception_kind(exc: BaseException) -> str:
    """A short label for a transport failure (refused connection, timeout, broken stream)."""
    import httpx

    if isinstance(exc, httpx.TimeoutException):
        return f"timeout ({type(exc).__name__})"
    detail = str(exc).strip().splitlines()[0][:120] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__


class SseDecoder:
    """Incremental SSE decoder that yields the payload of each ``data:`` line.

    Lean on purpose (it runs once per network chunk of every stream in a benchmark): splits on newlines,
    skips comments (``: ping``) and other fields, and keeps a partial line for the next chunk.
    """

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        data = self._buffer + chunk if self._buffer else chunk
        lines = data.split(b"\n")
        self._buffer = lines.pop()
        return [line[5:].strip() for line in lines if line.startswith(b"data:")]

    def flush(self) -> list[bytes]:
        """The last line, when a stream ends without a final newline."""
        rest, self._buffer = self._buffer, b""
        return [rest[5:].strip()] if rest.startswith(b"data:") else []


def model_ids(models_payload: Any) -> list[str]:
    """Model ids from a /v1/models body (OpenAI's list shape)."""
    data = models_payload.get("data") if isinstance(models_payload, dict) else None
    if not isinstance(data, list):
        return []
    return [str(entry["id"]) for entry in data if isinstance(entry, dict) and "id" in entry]


def first_model(client: httpx.Client, urls: ServerUrls) -> str:
    """The first model id from /v1/models (synchronous, for `izh chat`)."""
    response = client.get(f"{urls.api}/models")
    if response.status_code != 200:
        raise ServerError(
            http_error_kind(response.status_code, error_message(response.content, response.reason_phrase))
        )
    ids = model_ids(response.json())
    if not ids:
        raise ServerError("the server lists no models at /v1/models")
    return ids[0]


class ServerError(Exception):
    """The server answered, but not with what the tool needs (one line, shown to the user)."""
