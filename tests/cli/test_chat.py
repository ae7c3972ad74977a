"""`izh chat`: whole conversations in non-tty mode against the fake server (its replies echo the history
they were sent), commands, reasoning, errors and Ctrl-C during a reply."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import typer
from typer.testing import CliRunner

from izh_cli import chat as chat_cmd
from izh_cli.bench.server import resolve_urls
from tests.cli.fake_openai_server import fake_server

app = typer.Typer()
app.command("chat")(chat_cmd.chat)


def invoke(args: list[str], lines: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(app, args, input=lines, env=env)


def test_a_whole_conversation_with_reset_system_and_save(tmp_path: Path) -> None:
    saved = tmp_path / "talk" / "transcript.json"
    lines = (
        "hello\n"
        "how are you?\n"
        "\n"
        "/reset\n"
        "again\n"
        "/system Be brief\n"
        "last one\n"
        f"/save {saved}\n"
        "/exit\n"
        "never sent\n"
    )
    with fake_server() as (url, fake):
        result = invoke(["--url", f"{url}/v1"], lines)
        bodies = fake.state.bodies
    assert result.exit_code == 0, result.output
    assert result.stdout == (
        "You said: hello (turn 1)\n"
        "You said: how are you? (turn 2)\n"
        "You said: again (turn 1)\n"
        "[Be brief] You said: last one (turn 2)\n"
    )
    assert "Conversation cleared." in result.stderr and "Saved 4 messages" in result.stderr
    assert [b["model"] for b in bodies] == ["fake-model"] * 4  # discovered from /v1/models
    assert all(b["stream"] for b in bodies) and "temperature" not in bodies[0]
    assert bodies[1]["messages"] == [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "You said: hello (turn 1)"},
        {"role": "user", "content": "how are you?"},
    ]
    transcript = json.loads(saved.read_text())
    assert transcript["model"] == "fake-model" and transcript["url"] == f"{url}/v1"
    assert transcript["messages"] == [
        {"role": "system", "content": "Be brief"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "You said: again (turn 1)"},
        {"role": "user", "content": "last one"},
        {"role": "assistant", "content": "[Be brief] You said: last one (turn 2)"},
    ]


def test_options_reach_the_request_and_reasoning_is_kept_apart() -> None:
    args = ["--system", "S", "--temperature", "0.5", "--max-tokens", "40", "--model", "fake-model"]
    with fake_server() as (url, fake):
        result = invoke(args, "please think\n/system\n", env={"IZH_URL": url})
        (body,) = fake.state.bodies
    assert result.exit_code == 0, result.output
    assert result.stdout == "[S] You said: please think (turn 1)\n"
    assert "Let me think." in result.stderr and "System prompt: 'S'" in result.stderr
    assert (body["temperature"], body["max_tokens"]) == (0.5, 40)
    assert body["messages"][0] == {"role": "system", "content": "S"}


def test_errors_are_reported_and_the_chat_goes_on() -> None:
    lines = "FAIL_429 first\nfine\nFAIL_STREAM now\n/nonsense\nstill fine\n"
    with fake_server() as (url, fake):
        result = invoke(["--url", url], lines)
        last = fake.state.bodies[-1]
    assert result.exit_code == 1
    # The mid-stream failure printed two tokens first: they stay on a line of their own.
    assert result.stdout == "You said: fine (turn 1)\nYou said:\nYou said: still fine (turn 2)\n"
    assert "Error: HTTP 429: fake failure 429 on demand" in result.stderr
    assert "Error: fake failure mid-stream" in result.stderr
    assert "Unknown command /nonsense" in result.stderr
    # Failed turns are not kept: the last request holds only the turns that worked.
    assert [m["content"] for m in last["messages"] if m["role"] == "user"] == ["fine", "still fine"]


def test_unknown_model_is_an_error_per_reply() -> None:
    with fake_server() as (url, _):
        result = invoke(["--url", url, "--model", "nope"], "hi\n")
    assert result.exit_code == 1 and result.stdout == ""
    assert "HTTP 404: The model `nope` does not exist." in result.stderr


def test_server_down_is_one_line() -> None:
    with fake_server() as (url, _):
        pass
    result = invoke(["--url", url], "hi\n")
    assert result.exit_code == 1
    assert "cannot reach" in result.output and "Traceback" not in result.output


def test_ctrl_c_stops_the_reply_and_keeps_what_arrived() -> None:
    pieces: list[str] = []

    def interrupt_after_two(text: str) -> None:
        pieces.append(text)
        if len(pieces) == 2:
            raise KeyboardInterrupt

    with fake_server() as (url, _), httpx.Client() as client:
        session = chat_cmd.ChatSession(client, resolve_urls(url), "fake-model")
        reply = session.send("tell me a long story", interrupt_after_two, lambda _: None)
        assert reply.interrupted and reply.error is None
        assert reply.content == "You said:"
        follow_up = session.send("go on", lambda _: None, lambda _: None)
    assert session.messages[:2] == [
        {"role": "user", "content": "tell me a long story"},
        {"role": "assistant", "content": "You said:"},
    ]
    assert follow_up.content == "You said: go on (turn 2)"  # the client is still usable
