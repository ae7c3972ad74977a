"""`server.chat_template` (`izh serve --chat-template FILE`): a template file that replaces the model's,
for every route and /tokenize, against a real server over a tiny random Llama. The expected prompt is
the template rendered by jinja2 itself (outside izh) and tokenized by the model's tokenizer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jinja2
import pytest

from izh.config import EngineConfig
from izh.tokenizer import load_tokenizer
from tests.e2e.api_server import ApiServer, api_server

TEMPLATE = (
    "{% if tools %}[TOOLS]{% for tool in tools %}{{ tool.function.name }};{% endfor %}[/TOOLS]{% endif %}"
    "{% for message in messages %}<<{{ message['role'] }}>>{{ message['content'] }}<</{{ message['role'] }}>>\n"
    "{% endfor %}{% if add_generation_prompt %}<<assistant>>{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}


def _expected_ids(model: str, tools: list[dict[str, Any]] | None = None) -> list[int]:
    text = (
        jinja2.Environment()
        .from_string(TEMPLATE)
        .render(messages=MESSAGES, tools=tools, add_generation_prompt=True)
    )
    return load_tokenizer(model).encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def template_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, template_file: Path) -> Iterator[ApiServer]:
    config = EngineConfig(
        model=tiny_llama_dir,
        served_model_name="tiny",
        device="cpu",
        max_model_len=512,
        kv_cache_memory_bytes=1 << 23,
    )
    with api_server(config, chat_template=str(template_file)) as started:
        yield started


def test_every_route_renders_with_the_file(server: ApiServer, tiny_llama_dir: str) -> None:
    expected = _expected_ids(tiny_llama_dir)
    assert expected != _model_template_ids(tiny_llama_dir)  # the override changes the prompt
    tokenized = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "messages": MESSAGES}).json()
    assert tokenized["tokens"] == expected
    chat = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": "tiny", "messages": MESSAGES, "max_tokens": 1},
        timeout=120,
    ).json()
    assert chat["usage"]["prompt_tokens"] == len(expected)
    counted = httpx.post(
        f"{server.url}/v1/messages/count_tokens",
        json={"model": "tiny", "system": "Be brief.", "messages": MESSAGES[1:]},
    ).json()
    assert counted["input_tokens"] == len(expected)
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info["chat_template"] == TEMPLATE


def test_tools_render_through_the_file(server: ApiServer, tiny_llama_dir: str) -> None:
    tokenized = httpx.post(
        f"{server.url}/tokenize", json={"model": "tiny", "messages": MESSAGES, "tools": [TOOL]}
    )
    assert tokenized.json()["tokens"] == _expected_ids(tiny_llama_dir, [TOOL])


def _model_template_ids(model: str) -> list[int]:
    tokenizer = load_tokenizer(model)
    return tokenizer.encode(tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False)


def test_a_broken_file_fails_at_start(tiny_llama_dir: str, tmp_path: Path) -> None:
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for message in messages %}")
    config = EngineConfig(model=tiny_llama_dir, served_model_name="tiny", device="cpu", max_model_len=512)
    with pytest.raises(ValueError, match="does not compile"), api_server(config, chat_template=str(broken)):
        pass
    with (
        pytest.raises(ValueError, match="cannot read"),
        api_server(config, chat_template=str(tmp_path / "missing")),
    ):
        pass


def test_the_template_itself_in_one_line(tiny_llama_dir: str) -> None:
    config = EngineConfig(model=tiny_llama_dir, served_model_name="tiny", device="cpu", max_model_len=512)
    with api_server(config, chat_template=TEMPLATE.replace("\n", "")) as started:
        info = httpx.get(f"{started.url}/tokenizer_info").json()
    assert info["chat_template"] == TEMPLATE.replace("\n", "")


def test_the_flag_and_the_setting() -> None:
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "izh_cli.main",
            "config",
            "show",
            "--json",
            "--chat-template",
            "/x/chat.jinja",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(shown.stdout)["server"]["chat_template"] == "/x/chat.jinja"
