"""GET /tokenizer_info and the tokenizer routes as an eval harness's remote tokenizer uses them: the
fields match transformers' view of the same tokenizer, lm-evaluation-harness's RemoteTokenizer and
its local-completions model work against the real server, and every route needs the API key."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from izh.api.ops.tokenize import TOKENIZER_CLASS, describe_tokenizer
from izh.config import EngineConfig
from izh.tokenizer import load_tokenizer
from izh.tokenizer.gguf_metadata import read_gguf_metadata
from izh.tokenizer.gguf_tokenizer import tokenizer_from_gguf_metadata
from tests.e2e.api_server import ApiServer, api_server

MODEL = "tiny"
MAX_MODEL_LEN = 128
KEY = "sk-tokenizer-info"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXTS = ["hello world", "The capital of France is Paris.", "emoji 🙂 and 中文 text", "<|im_start|>user\nhi"]


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str) -> Iterator[ApiServer]:
    config = EngineConfig(
        model=tiny_llama_dir,
        served_model_name=MODEL,
        device="cpu",
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=1 << 22,
    )
    with api_server(config, api_keys=[KEY]) as started:
        yield started


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_llama_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def _error(reply: httpx.Response, status: int) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]  # type: ignore[no-any-return]


def test_tokenizer_info_matches_transformers(server: ApiServer, hf_tokenizer: Any) -> None:
    reply = httpx.get(f"{server.url}/tokenizer_info", headers=AUTH)
    assert reply.status_code == 200, reply.text
    info = reply.json()
    assert info["tokenizer_class"] == TOKENIZER_CLASS
    for name in ("bos", "eos", "pad", "unk"):
        assert info[f"{name}_token"] == getattr(hf_tokenizer, f"{name}_token"), name
        assert info[f"{name}_token_id"] == getattr(hf_tokenizer, f"{name}_token_id"), name
    assert info["chat_template"] == hf_tokenizer.chat_template
    assert info["model_max_length"] == MAX_MODEL_LEN
    assert info["added_tokens_decoder"] == {
        str(i): token.content for i, token in hf_tokenizer.added_tokens_decoder.items()
    }
    # The tiny tokenizer's post-processor adds nothing: transformers' encode agrees.
    assert hf_tokenizer("a").input_ids == hf_tokenizer("a", add_special_tokens=False).input_ids
    assert info["add_bos_token"] is False and info["add_eos_token"] is False
    assert info["clean_up_tokenization_spaces"] is False


def test_tokenize_and_detokenize_take_what_a_remote_tokenizer_sends(
    server: ApiServer, hf_tokenizer: Any
) -> None:
    for text in TEXTS:
        body = {"prompt": text, "add_special_tokens": False}
        tokens = httpx.post(f"{server.url}/tokenize", json=body, headers=AUTH).json()["tokens"]
        assert tokens == hf_tokenizer.encode(text, add_special_tokens=False), text
        back = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}, headers=AUTH).json()
        assert back == {"prompt": hf_tokenizer.decode(tokens)} and back["prompt"] == text
    empty = httpx.post(f"{server.url}/detokenize", json={"tokens": []}, headers=AUTH)
    assert empty.json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/tokenizer_info", None),
        ("POST", "/tokenize", {"prompt": "hi", "add_special_tokens": False}),
        ("POST", "/detokenize", {"tokens": [5, 6]}),
    ],
)
def test_the_tokenizer_routes_need_the_api_key(
    server: ApiServer, method: str, path: str, body: dict[str, Any] | None
) -> None:
    url = f"{server.url}{path}"
    missing = _error(httpx.request(method, url, json=body), 401)
    assert missing["type"] == "authentication_error"
    wrong = httpx.request(method, url, json=body, headers={"Authorization": "Bearer sk-wrong"})
    assert _error(wrong, 401)["code"] == "invalid_api_key"
    assert httpx.request(method, url, json=body, headers=AUTH).status_code == 200


def test_lm_eval_remote_tokenizer_works_against_the_server(server: ApiServer, hf_tokenizer: Any) -> None:
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    base_url = f"{server.url}/v1/completions"
    assert check_remote_tokenizer_support(base_url, auth_token=KEY)
    assert not check_remote_tokenizer_support(base_url, max_retries=1)  # no key: 401
    remote = RemoteTokenizer(base_url, auth_token=KEY)
    assert (remote.eos_token, remote.bos_token, remote.pad_token) == (
        hf_tokenizer.eos_token,
        hf_tokenizer.bos_token,
        hf_tokenizer.pad_token,
    )
    assert (remote.eos_token_id, remote.bos_token_id) == (
        hf_tokenizer.eos_token_id,
        hf_tokenizer.bos_token_id,
    )
    for text in TEXTS:
        assert remote.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)
    ids = [remote.encode(text) for text in TEXTS]
    assert remote.batch_decode(ids) == TEXTS
    messages = [{"role": "user", "content": "Hi"}]
    assert remote.apply_chat_template(messages) == hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_lm_eval_local_completions_scores_with_the_remote_tokenizer(
    server: ApiServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # what local-completions sends as its bearer token
    lm = LocalCompletionsAPI(
        base_url=f"{server.url}/v1/completions",
        model=MODEL,
        tokenizer_backend="auto",
        auth_token=KEY,
        max_length=MAX_MODEL_LEN,
    )
    assert lm.tokenizer_backend == "remote"
    pairs = [("The capital of France is", " Paris."), ("hello", " world")]
    requests = [
        Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(pairs)
    ]
    results = lm.loglikelihood(requests)
    assert len(results) == len(pairs)
    for (context, continuation), (logprob, _is_greedy) in zip(pairs, results, strict=True):
        # The same sum from izh's own prompt scoring (echo with max_tokens 0) of context + continuation.
        tokenize = f"{server.url}/tokenize"
        ctx = httpx.post(tokenize, json={"prompt": context, "add_special_tokens": False}, headers=AUTH)
        cont = httpx.post(tokenize, json={"prompt": continuation, "add_special_tokens": False}, headers=AUTH)
        ctx_ids, cont_ids = ctx.json()["tokens"], cont.json()["tokens"]
        body = {"model": MODEL, "prompt": ctx_ids + cont_ids, "max_tokens": 0, "echo": True, "logprobs": 1}
        scored = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60).json()
        token_logprobs = scored["choices"][0]["logprobs"]["token_logprobs"]
        assert math.isclose(logprob, sum(token_logprobs[len(ctx_ids) :]), abs_tol=1e-3)


def test_a_gguf_tokenizer_is_described_from_its_metadata(tiny_llama_gguf: str, hf_tokenizer: Any) -> None:
    info = describe_tokenizer(load_tokenizer(tiny_llama_gguf), 64)
    assert (info.eos_token, info.eos_token_id) == (hf_tokenizer.eos_token, hf_tokenizer.eos_token_id)
    assert (info.bos_token, info.bos_token_id) == (hf_tokenizer.bos_token, hf_tokenizer.bos_token_id)
    assert info.chat_template == hf_tokenizer.chat_template
    assert info.add_bos_token is False and info.model_max_length == 64
    # A GGUF that asks for BOS: encode() adds it, and the description says so.
    metadata = {**read_gguf_metadata(tiny_llama_gguf), "tokenizer.ggml.add_bos_token": True}
    with_bos = tokenizer_from_gguf_metadata(metadata)
    assert with_bos.encode("a")[0] == with_bos.bos_token_id
    described = describe_tokenizer(with_bos, 64)
    assert described.add_bos_token is True and described.add_eos_token is False
