"""Images in chat over real HTTP with the official openai SDK, on a tiny random Idefics3 (SmolVLM): data
URLs answer as transformers does, every refusal is a 400 naming the part, remote URLs only where allowed
(and bounded), and the prefix cache reuses an image's blocks for the same image only."""

from __future__ import annotations

import base64
import http.server
import io
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from izh.config import EngineConfig
from izh.settings import LimitSettings
from tests.e2e.api_server import ApiServer, api_server

MODEL = "tiny-vlm"
QUESTION = "What is in the image?"


def _png(seed: int, height: int = 50, width: int = 70, fmt: str = "PNG") -> bytes:
    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=fmt)
    return buffer.getvalue()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _messages(*urls: Any, text: str = QUESTION) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": url} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


LIMITS = LimitSettings(max_images_per_request=2, max_image_bytes=64 * 2**10, max_image_pixels=300 * 300)


@pytest.fixture(scope="module")
def server(tiny_idefics3_dir: str) -> Iterator[ApiServer]:
    config = EngineConfig(model=tiny_idefics3_dir, served_model_name=MODEL, device="cpu", dtype="float32")
    with api_server(config, limits=LIMITS) as started:
        yield started


@pytest.fixture
def client(server: ApiServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def _hf_answer(path: str, messages: list[dict[str, Any]], images: list[bytes], max_tokens: int) -> list[int]:
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(path)
    model = Idefics3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    hf_messages = [
        {
            "role": m["role"],
            "content": [
                {"type": "image"} if p["type"] == "image_url" else {"type": "text", "text": p["text"]}
                for p in m["content"]
            ],
        }
        for m in messages
    ]
    text = processor.apply_chat_template(hf_messages, add_generation_prompt=True)
    pil = [Image.open(io.BytesIO(data)) for data in images]
    inputs = processor(text=text, images=pil or None, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def test_data_url_images_answer_as_transformers(
    client: openai.OpenAI, server: ApiServer, tiny_idefics3_dir: str
) -> None:
    first, second = _png(1), _png(2, 90, 40, "JPEG")
    cases = [
        ([first], [_data_url(first)]),
        (
            [first, second],
            [{"url": _data_url(first)}, {"url": _data_url(second, "image/jpeg"), "detail": "high"}],
        ),
        ([], []),
    ]
    assert server.llm is not None
    tokenizer = server.llm.tokenizer
    for images, urls in cases:
        messages = _messages(*urls)
        reply = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=10,
            temperature=0,
            logprobs=True,  # type: ignore[arg-type]
        )
        expected = _hf_answer(tiny_idefics3_dir, messages, images, 10)
        logprobs = reply.choices[0].logprobs
        assert logprobs is not None and logprobs.content is not None
        assert len(logprobs.content) == len(expected)
        assert reply.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)


def test_low_detail_is_one_tile(client: openai.OpenAI) -> None:
    url = _data_url(_png(3))
    high = client.chat.completions.create(model=MODEL, messages=_messages({"url": url}), max_tokens=1)  # type: ignore[arg-type]
    low = client.chat.completions.create(
        model=MODEL,
        messages=_messages({"url": url, "detail": "low"}),  # type: ignore[arg-type]
        max_tokens=1,
    )
    assert high.usage is not None and low.usage is not None
    # 50x70 -> 3 x 4 tiles + the global image at 4 <image> tokens each, versus the global image alone.
    assert high.usage.prompt_tokens > low.usage.prompt_tokens + 12 * 4


def test_same_image_hits_the_prefix_cache_another_does_not(client: openai.OpenAI) -> None:
    first, other = _data_url(_png(10)), _data_url(_png(11))

    def cached(url: str) -> int:
        reply = client.chat.completions.create(
            model=MODEL,
            messages=_messages(url, text="Tell me everything."),
            max_tokens=2,  # type: ignore[arg-type]
        )
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        return reply.usage.prompt_tokens_details.cached_tokens or 0

    assert cached(first) == 0
    assert cached(first) >= 64  # every full block of the prompt, the image's placeholders included
    assert cached(other) == 0  # the image starts in the first block: nothing before it to reuse


def _error(client: openai.OpenAI, messages: list[dict[str, Any]]) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)  # type: ignore[arg-type]
    body = info.value.response.json()["error"]
    assert set(body) >= {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"
    return body  # type: ignore[no-any-return]


def test_refusals_name_the_part(client: openai.OpenAI) -> None:
    small = _data_url(_png(1, 20, 20))
    error = _error(client, _messages(small, small, small))
    assert error["param"] == "messages.0.content.2.image_url" and error["code"] == "too_many_images"

    big = _png(4, 200, 250)  # random pixels compress badly: > 64 KiB
    assert len(big) > LIMITS.max_image_bytes
    error = _error(client, _messages(small, _data_url(big)))
    assert error["param"] == "messages.0.content.1.image_url" and error["code"] == "image_too_large"

    wide = Image.new("RGB", (400, 400))  # compresses to a few hundred bytes, but 160000 pixels
    buffer = io.BytesIO()
    wide.save(buffer, format="PNG")
    error = _error(client, _messages(_data_url(buffer.getvalue())))
    assert error["code"] == "image_too_large" and "pixels" in error["message"]

    for bad in (
        _data_url(b"\x89PNG\r\n\x1a\n not really a png"),
        _data_url(b"GIF89a" + bytes(64), "image/gif"),
        "data:image/png;base64,%%%not-base64%%%",
        "data:text/plain;base64,aGVsbG8=",
        "ftp://example.com/cat.png",
    ):
        error = _error(client, _messages(bad))
        assert error["param"] == "messages.0.content.0.image_url" and error["code"] == "invalid_image", bad

    error = _error(client, _messages({"url": small, "detail": "ultra"}))
    assert error["param"] == "messages.0.content.0.image_url.detail"

    error = _error(client, _messages("https://example.com/cat.png"))
    assert error["code"] == "remote_images_disabled" and error["param"] == "messages.0.content.0.image_url"

    assistant = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": small}}]},
    ]
    assert _error(client, assistant)["param"] == "messages.1.content.0"

    typed = [{"role": "user", "content": "Look: <image> here"}]
    assert _error(client, typed)["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="Look: <image> here", max_tokens=2)
    assert info.value.response.json()["error"]["param"] == "prompt"


def test_text_only_model_refuses_images(tiny_llama_dir: str) -> None:
    config = EngineConfig(model=tiny_llama_dir, served_model_name="tiny-text", device="cpu")
    with (
        api_server(config) as started,
        openai.OpenAI(base_url=f"{started.url}/v1", api_key="unused", max_retries=0) as client,
        pytest.raises(openai.BadRequestError) as info,
    ):
        client.chat.completions.create(
            model="tiny-text",
            messages=_messages(_data_url(_png(1))),  # type: ignore[arg-type]
            max_tokens=2,
        )
    error = info.value.response.json()["error"]
    assert error["param"] == "messages.0.content.0.image_url" and error["code"] == "images_not_supported"


class _ImageHandler(http.server.BaseHTTPRequestHandler):
    images: ClassVar[dict[str, bytes]] = {}
    slow = threading.Event()

    def do_GET(self) -> None:
        if self.path == "/slow":
            self.slow.wait(10)
        data = self.images.get(self.path)
        if data is None:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    _ImageHandler.images = {"/cat.png": _png(1), "/big.png": _png(4, 200, 250), "/slow": _png(1)}
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ImageHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    _ImageHandler.slow.set()
    httpd.shutdown()


def test_remote_images_where_allowed(tiny_idefics3_dir: str, image_host: str) -> None:
    limits = LIMITS.model_copy(update={"allow_remote_images": True, "remote_image_timeout_s": 1.0})
    config = EngineConfig(model=tiny_idefics3_dir, served_model_name=MODEL, device="cpu", dtype="float32")
    with (
        api_server(config, limits=limits) as started,
        openai.OpenAI(base_url=f"{started.url}/v1", api_key="unused", max_retries=0) as client,
    ):
        remote = client.chat.completions.create(
            model=MODEL,
            messages=_messages(f"{image_host}/cat.png"),
            max_tokens=6,
            temperature=0,  # type: ignore[arg-type]
        )
        inline = client.chat.completions.create(
            model=MODEL,
            messages=_messages(_data_url(_png(1))),
            max_tokens=6,
            temperature=0,  # type: ignore[arg-type]
        )
        assert remote.choices[0].message.content == inline.choices[0].message.content
        assert remote.usage is not None and remote.usage.prompt_tokens > 50
        for path, code in (
            ("/big.png", "image_too_large"),
            ("/missing.png", "invalid_image"),
            ("/slow", "invalid_image"),
        ):
            error = _error(client, _messages(f"{image_host}{path}"))
            assert error["code"] == code and error["param"] == "messages.0.content.0.image_url", path
        reply = httpx.get(f"{started.url}/health", timeout=10)
        assert reply.status_code == 200  # a slow image host holds no one else up


def test_responses_input_image_answers_as_chat(client: openai.OpenAI) -> None:
    url = _data_url(_png(12))
    chat = client.chat.completions.create(
        model=MODEL,
        messages=_messages(url),
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
    )
    response = client.responses.create(
        model=MODEL,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": url, "detail": "auto"},
                    {"type": "input_text", "text": QUESTION},
                ],
            }
        ],
        max_output_tokens=8,
        temperature=0,
        store=False,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens

    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(
            model=MODEL,
            input=[
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}],
                }
            ],
            max_output_tokens=2,
        )
    error = info.value.response.json()["error"]
    assert error["code"] == "remote_images_disabled" and error["param"] == "input.0.content.0.image_url"

    # The second input item's second part, after a stored conversation with an image of its own.
    first = client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": url}]}],
        max_output_tokens=2,
    )
    bad_detail = {"type": "input_image", "image_url": url, "detail": "ultra"}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(
            model=MODEL,
            previous_response_id=first.id,
            input=[
                {"role": "user", "content": "Again:"},
                {"role": "user", "content": [{"type": "input_text", "text": "x"}, bad_detail]},  # type: ignore[list-item]
            ],
            max_output_tokens=2,
        )
    assert info.value.response.json()["error"]["param"] == "input.1.content.1.detail"


def test_tokenize_expands_the_images(client: openai.OpenAI, server: ApiServer) -> None:
    messages = _messages(_data_url(_png(13)))
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    reply = httpx.post(
        f"{server.url}/tokenize", json={"model": MODEL, "messages": messages, "add_generation_prompt": True}
    )
    assert reply.status_code == 200, reply.text
    assert chat.usage is not None and reply.json()["count"] == chat.usage.prompt_tokens
    refused = httpx.post(
        f"{server.url}/tokenize", json={"model": MODEL, "messages": _messages("http://example.com/a.png")}
    )
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "remote_images_disabled"
