"""A chat request's images: its `image_url` content parts fetched (a `data:` URL always; an http(s) URL only
where `limits.allow_remote_images` is on), bounded and decoded with Pillow, in message order.

Every refusal is a 400 naming the part (`messages.0.content.1.image_url`): images sent to a text-only
model, more than `limits.max_images_per_request`, a file over `limits.max_image_bytes` or an image over
`limits.max_image_pixels`, a file Pillow cannot decode or of a format other than PNG, JPEG and WebP, a
remote URL while fetching is off, a fetch that fails or outlasts `limits.remote_image_timeout_s`.

The content hash of an image is the sha256 of its file: the prefix cache keys the KV blocks that hold
its placeholders on it, so the same file reuses them and another one does not.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import re
import warnings
from dataclasses import dataclass
from typing import Any

import httpx
from PIL import Image

from izh.api.common.chat_protocol import (
    ChatMessageParam,
    ContentPart,
)
from izh.errors import InvalidRequest
from izh.settings import LimitSettings

IMAGE_FORMATS = frozenset({"PNG", "JPEG", "WEBP"})
_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,(?P<data>.*)", re.S)
_DETAILS = ("auto", "low", "high")


@dataclass(frozen=True, slots=True)
class ChatImage:
    """One decoded image of a request and where it came from."""

    image: Image.Image
    content_hash: str
    """sha256 of the file (hex)."""
    detail: str
    """auto | low | high: "low" makes it one tile (no splitting)."""
    param: str
    """The part it came from (messages.I.content.J.image_url), for the errors about it."""


def image_parts(messages: list[ChatMessageParam]) -> list[tuple[str, ContentPart]]:
    """(param, part) of every image part, in order: `messages.I.content.J`."""
    found = []
    for i, message in enumerate(messages):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if part.type == "image_url":
                    found.append((f"messages.{i}.content.{j}", part))
    return found


async def load_chat_images(
    messages: list[ChatMessageParam], limits: LimitSettings, *, accepts_images: bool, model_name: str
) -> list[ChatImage]:
    """The request's images, decoded, or the 400 that refuses the first bad one."""
    parts = image_parts(messages)
    if not parts:
        return []
    if not accepts_images:
        param = f"{parts[0][0]}.image_url"
        raise InvalidRequest(
            f"{param}: the model {model_name} takes no images (it is not a vision-language model)",
            param=param,
            code="images_not_supported",
        )
    if len(parts) > limits.max_images_per_request:
        param = f"{parts[limits.max_images_per_request][0]}.image_url"
        raise InvalidRequest(
            f"{param}: a request may hold at most {limits.max_images_per_request} images, this one has "
            f"{len(parts)} (limits.max_images_per_request)",
            param=param,
            code="too_many_images",
        )
    images = []
    for base, part in parts:
        param = f"{base}.image_url"
        url, detail = _url_and_detail(part, param)
        data = await _fetch(url, param, limits)
        image = await asyncio.to_thread(_decode, data, param, limits)
        images.append(ChatImage(image, hashlib.sha256(data).hexdigest(), detail, param))
    return images


def _url_and_detail(part: ContentPart, param: str) -> tuple[str, str]:
    value: Any = part.image_url
    if isinstance(value, str):
        return value, "auto"
    if isinstance(value, dict):
        url = value.get("url")
        detail = value.get("detail") or "auto"
        unknown = sorted(set(value) - {"url", "detail"})
        if unknown:
            raise InvalidRequest(f"{param}.{unknown[0]}: unknown field", param=f"{param}.{unknown[0]}")
        if not isinstance(url, str):
            raise InvalidRequest(f"{param}.url: expected a string", param=f"{param}.url")
        if detail not in _DETAILS:
            raise InvalidRequest(
                f"{param}.detail: expected one of {', '.join(_DETAILS)}, got {detail!r}",
                param=f"{param}.detail",
            )
        return url, str(detail)
    raise InvalidRequest(
        f"{param}: an image_url part needs an 'image_url' (a URL, or an object with 'url')", param=param
    )


async def _fetch(url: str, param: str, limits: LimitSettings) -> bytes:
    """The file behind the URL: a data URL's decoded bytes, or (where allowed) a bounded download."""
    max_bytes = limits.max_image_bytes
    if url.startswith("data:"):
        match = _DATA_URL.fullmatch(url)
        if match is None:
            raise InvalidRequest(
                f"{param}: a data URL must be base64 (data:image/png;base64,...)",
                param=param,
                code="invalid_image",
            )
        mime = (match["mime"] or "").lower()
        if mime and not mime.startswith("image/"):
            raise InvalidRequest(f"{param}: {mime} is not an image type", param=param, code="invalid_image")
        encoded = match["data"]
        if len(encoded) > (max_bytes + 2) // 3 * 4 + 4:
            raise _too_large(param, max_bytes)
        try:
            data = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequest(
                f"{param}: the data URL's base64 does not decode", param=param, code="invalid_image"
            ) from None
        if len(data) > max_bytes:
            raise _too_large(param, max_bytes)
        return data
    if not url.startswith(("http://", "https://")):
        raise InvalidRequest(
            f"{param}: expected a data: URL (or an http(s) URL where the server allows them)",
            param=param,
            code="invalid_image",
        )
    if not limits.allow_remote_images:
        raise InvalidRequest(
            f"{param}: this server does not fetch remote images (limits.allow_remote_images is off); "
            "send the image as a data: URL",
            param=param,
            code="remote_images_disabled",
        )
    return await _download(url, param, max_bytes, limits.remote_image_timeout_s)


async def _download(url: str, param: str, max_bytes: int, timeout_s: float) -> bytes:
    try:
        async with asyncio.timeout(timeout_s):
            async with (
                httpx.AsyncClient(timeout=timeout_s, follow_redirects=True, max_redirects=3) as client,
                client.stream("GET", url) as response,
            ):
                if response.status_code != 200:
                    raise InvalidRequest(
                        f"{param}: fetching the image answered HTTP {response.status_code}",
                        param=param,
                        code="invalid_image",
                    )
                length = response.headers.get("content-length")
                if length is not None and length.isdigit() and int(length) > max_bytes:
                    raise _too_large(param, max_bytes)
                chunks = bytearray()
                async for chunk in response.aiter_bytes():
                    chunks.extend(chunk)
                    if len(chunks) > max_bytes:
                        raise _too_large(param, max_bytes)
                return bytes(chunks)
    except TimeoutError:
        raise InvalidRequest(
            f"{param}: fetching the image took longer than {timeout_s:g} s (limits.remote_image_timeout_s)",
            param=param,
            code="invalid_image",
        ) from None
    except httpx.HTTPError as e:
        raise InvalidRequest(
            f"{param}: cannot fetch the image: {type(e).__name__}", param=param, code="invalid_image"
        ) from None


def _too_large(param: str, max_bytes: int) -> InvalidRequest:
    return InvalidRequest(
        f"{param}: the image file is larger than {max_bytes} bytes (limits.max_image_bytes)",
        param=param,
        code="image_too_large",
    )


def _decode(data: bytes, param: str, limits: LimitSettings) -> Image.Image:
    """Pillow's image of a PNG, JPEG or WebP file, its pixels checked against the limit before they are
    decoded (a small file can declare a huge image)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=sorted(IMAGE_FORMATS))
            width, height = image.size
            if width * height > limits.max_image_pixels:
                raise InvalidRequest(
                    f"{param}: the image is {width}x{height} pixels, over the limit of {limits.max_image_pixels} "
                    "(limits.max_image_pixels)",
                    param=param,
                    code="image_too_large",
                )
            image.load()
    except InvalidRequest:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InvalidRequest(
            f"{param}: the image is too large to decode", param=param, code="image_too_large"
        ) from None
    except Exception:  # Pillow raises many types for a bad file: UnidentifiedImageError, OSError, ...
        raise InvalidRequest(
            f"{param}: the file is not a PNG, JPEG or WebP image that can be decoded",
            param=param,
            code="invalid_image",
        ) from None
    return image
