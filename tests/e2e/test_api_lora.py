"""LoRA over HTTP with the official openai SDK: adapters in /v1/models, `model: <adapter>` on chat and
completions, the runtime load/unload routes (on, off, behind auth), their errors, metrics, izh bench."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from typer.testing import CliRunner

from izh import LLM, SamplingParams
from izh.config import EngineConfig
from izh_cli.bench import cli as bench_cli
from tests.e2e.api_server import ApiServer, api_server
from tests.engine.fake_core import make_fake_model
from tests.fixtures.lora import build_peft_adapter

BASE = "tiny-base"
KEY = "sk-lora-test"
PROMPT = [5, 17, 33, 9, 61, 2, 88, 140]


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("lora_http")
    return {
        "a": build_peft_adapter(tiny_llama_dir, root / "a", r=8, alpha=16, seed=11),
        "b": build_peft_adapter(
            tiny_llama_dir, root / "b", r=4, alpha=8, targets=("q_proj", "down_proj"), seed=12
        ),
        "too-big": build_peft_adapter(
            tiny_llama_dir, root / "big", r=32, alpha=32, targets=("q_proj",), seed=13
        ),
    }


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, adapter_dirs: dict[str, str]) -> Iterator[ApiServer]:
    config = EngineConfig(
        model=tiny_llama_dir,
        served_model_name=BASE,
        kv_cache_memory_bytes=8 << 20,
        lora_modules=(("a", adapter_dirs["a"]),),
        max_loras=2,
    )
    with api_server(config, allow_runtime_lora_updating=True, api_keys=[KEY]) as started:
        yield started


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: str, adapter_dirs: dict[str, str]) -> dict[str | None, str]:
    """Offline greedy text for PROMPT with each adapter (the engine's parity with peft is tested in
    tests/engine/test_lora.py)."""
    llm = LLM(
        tiny_llama_dir,
        kv_cache_memory_bytes=8 << 20,
        lora_modules={"a": adapter_dirs["a"], "b": adapter_dirs["b"]},
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return {
        name: llm.generate({"prompt_token_ids": PROMPT}, params, lora_name=name)[0].outputs[0].text
        for name in (None, "a", "b")
    }


@pytest.fixture
def client(server: ApiServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, _strict_response_validation=True
    ) as c:
        yield c


def _post(server: ApiServer, path: str, body: Any, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


def _completion_text(client: openai.OpenAI, model: str) -> tuple[str, str]:
    out = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return out.model, out.choices[0].text


def _error(response: httpx.Response) -> dict[str, Any]:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_models_lists_the_adapters_with_their_parent(
    client: openai.OpenAI, server: ApiServer, adapter_dirs: dict[str, str]
) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [BASE, "a"]
    card = client.models.retrieve("a")
    assert card.model_extra["parent"] == BASE  # type: ignore[index]
    assert card.model_extra["root"] == str(Path(adapter_dirs["a"]).resolve())  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("b")


def test_model_adapter_on_completions_and_chat(
    client: openai.OpenAI, reference: dict[str | None, str]
) -> None:
    model, text = _completion_text(client, "a")
    assert (model, text) == ("a", reference["a"])
    model, text = _completion_text(client, BASE)
    assert (model, text) == (BASE, reference[None])
    assert reference["a"] != reference[None]
    chat_a = client.chat.completions.create(
        model="a", messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=0
    )
    chat_base = client.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=0
    )
    assert chat_a.model == "a" and chat_base.model == BASE
    assert chat_a.choices[0].message.content != chat_base.choices[0].message.content
    stream = client.chat.completions.create(
        model="a", messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == chat_a.choices[0].message.content
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert err.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_runtime_load_and_unload(
    client: openai.OpenAI,
    server: ApiServer,
    adapter_dirs: dict[str, str],
    reference: dict[str | None, str],
) -> None:
    response = _post(server, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": adapter_dirs["b"]})
    assert response.status_code == 200, response.text
    assert [m.id for m in client.models.list().data] == [BASE, "a", "b"]
    assert _completion_text(client, "b") == ("b", reference["b"])
    assert _completion_text(client, "a") == ("a", reference["a"])  # two adapters, both resident

    duplicate = _post(server, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": adapter_dirs["a"]})
    assert duplicate.status_code == 400 and "already loaded" in _error(duplicate)["message"]

    response = _post(server, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert response.status_code == 200, response.text
    assert [m.id for m in client.models.list().data] == [BASE, "a"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="b", prompt="hi", max_tokens=2)
    again = _post(server, "/v1/unload_lora_adapter", {"lora_name": "b"})
    assert again.status_code == 404 and _error(again)["type"] == "not_found_error"

    # Loaded again under a new name, the same weights give the same tokens.
    assert (
        _post(
            server, "/v1/load_lora_adapter", {"lora_name": "b2", "lora_path": adapter_dirs["b"]}
        ).status_code
        == 200
    )
    assert _completion_text(client, "b2") == ("b2", reference["b"])
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "b2"}).status_code == 200


def test_load_errors_are_400s_that_say_why(
    server: ApiServer, adapter_dirs: dict[str, str], tmp_path: Path
) -> None:
    cases = [
        ({"lora_name": "x", "lora_path": str(tmp_path / "missing")}, "not a folder"),
        ({"lora_name": "x", "lora_path": str(tmp_path)}, "no adapter_config.json"),
        ({"lora_name": "x", "lora_path": adapter_dirs["too-big"]}, "above max_lora_rank 16"),
        ({"lora_name": BASE, "lora_path": adapter_dirs["b"]}, "base model"),
        ({"lora_name": "x"}, "lora_path"),
        ({"lora_name": "x", "lora_path": adapter_dirs["b"], "lora_int_id": 3}, "lora_int_id"),
    ]
    for body, words in cases:
        response = _post(server, "/v1/load_lora_adapter", body)
        assert response.status_code == 400, (body, response.text)
        assert words in json.dumps(_error(response)), (body, response.text)
    unknown = _post(server, "/v1/unload_lora_adapter", {"lora_name": "never"})
    assert unknown.status_code == 404 and _error(unknown)["code"] == "model_not_found"


def test_lora_routes_need_the_api_key(server: ApiServer, adapter_dirs: dict[str, str]) -> None:
    response = _post(
        server, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": adapter_dirs["b"]}, key=None
    )
    assert response.status_code == 401
    assert _post(server, "/v1/unload_lora_adapter", {"lora_name": "a"}, key="wrong").status_code == 401


def test_metrics_count_requests_by_adapter(client: openai.OpenAI, server: ApiServer) -> None:
    client.completions.create(model="a", prompt=PROMPT, max_tokens=3, temperature=0)
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    lines = [line for line in text.splitlines() if line.startswith("izh:lora_")]
    assert any(line.startswith("izh:lora_requests_info{") and 'max_lora="2"' in line for line in lines)
    requests_a = [
        line for line in lines if line.startswith("izh:lora_requests_total{") and 'lora_name="a"' in line
    ]
    assert requests_a and float(requests_a[0].split()[-1]) >= 1
    assert any(
        line.startswith("izh:lora_generation_tokens_total{") and 'lora_name="a"' in line for line in lines
    )


def test_izh_bench_runs_on_an_adapter(
    server: ApiServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IZH_API_KEY", KEY)
    app = __import__("typer").Typer()
    app.command("bench")(bench_cli.bench)
    result = CliRunner().invoke(
        app,
        [
            "--url",
            server.url,
            "--model",
            "a",
            "--json",
            "--out",
            str(tmp_path / "r.json"),
            "-c",
            "2",
            "-n",
            "4",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--ignore-eos",
        ],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["server"]["model"] == "a"
    (run,) = doc["runs"]
    assert (run["metrics"]["completed"], run["metrics"]["failed"]) == (4, 0)


def test_runtime_routes_are_off_by_default(tiny_llama_dir: str, tmp_path: Path) -> None:
    (tmp_path / "fake").mkdir()
    model_dir = make_fake_model(tiny_llama_dir, tmp_path / "fake")
    config = EngineConfig(model=str(model_dir), served_model_name=BASE)
    with api_server(config, start_kwargs={"core_factory": "tests.engine.fake_core:FakeEngineCore"}) as off:
        for path, body in (
            ("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(tmp_path)}),
            ("/v1/unload_lora_adapter", {"lora_name": "a"}),
        ):
            response = _post(off, path, body, key=None)
            assert response.status_code == 404
            assert "--allow-runtime-lora-updating" in _error(response)["message"]
        models = httpx.get(f"{off.url}/v1/models").json()
        assert [m["id"] for m in models["data"]] == [BASE]


def test_a_restarted_core_gets_the_runtime_adapters_back(
    tiny_llama_dir: str, adapter_dirs: dict[str, str], reference: dict[str | None, str]
) -> None:
    import os
    import signal
    import time

    config = EngineConfig(
        model=tiny_llama_dir,
        served_model_name=BASE,
        kv_cache_memory_bytes=8 << 20,
        lora_modules=(("a", adapter_dirs["a"]),),
        max_loras=2,
    )
    start = {"core_mode": "process", "restart_dead_core": True}
    with api_server(config, start_kwargs=start, allow_runtime_lora_updating=True) as served:
        assert (
            _post(
                served, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": adapter_dirs["b"]}
            ).status_code
            == 200
        )
        assert _post(served, "/v1/unload_lora_adapter", {"lora_name": "a"}).status_code == 200
        llm = served.llm
        assert llm is not None
        old_core = llm.client.core_pid
        assert old_core is not None
        os.kill(old_core, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (llm.num_core_restarts == 1 and llm.is_ready):
            time.sleep(0.2)
        assert llm.num_core_restarts == 1 and llm.client.core_pid != old_core
        with openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0) as c:
            assert [m.id for m in c.models.list().data] == [BASE, "b"]
            assert _completion_text(c, "b") == ("b", reference["b"])  # the new core loaded it again
            with pytest.raises(openai.NotFoundError):
                c.completions.create(model="a", prompt="hi", max_tokens=2)


def test_embeddings_run_on_the_adapter(client: openai.OpenAI) -> None:
    base = (
        client.embeddings.create(model=BASE, input="hello adapters", encoding_format="float")
        .data[0]
        .embedding
    )
    again = (
        client.embeddings.create(model=BASE, input="hello adapters", encoding_format="float")
        .data[0]
        .embedding
    )
    adapted = client.embeddings.create(model="a", input="hello adapters", encoding_format="float")
    assert adapted.model == "a"
    assert base == again and adapted.data[0].embedding != base
