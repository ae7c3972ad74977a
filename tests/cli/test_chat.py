"""`izh chat`: whole conversations in non-tty mode against the fake server (its replies echo the history
they were sent), commands, reasoning, errors and Ctrl-C during a reply."""

from __future__ import annotations

import importlib.util
import json
import os
import pty
import re
import select
import signal
import sys
import termios
import time
from pathlib import Path
from typing import Any

import httpx
import typer
from typer.testing import CliRunner

from izh_cli import chat as chat_cmd
from izh_cli.http import resolve_urls
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


def test_params_model_load_and_multi_line_input(tmp_path: Path) -> None:
    saved = tmp_path / "saved.json"
    saved.write_text(
        json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "Old system"},
                    {"role": "user", "content": "earlier"},
                    {"role": "assistant", "content": "an old answer"},
                ]
            }
        )
    )
    lines = (
        "/params temperature=0.2 max_tokens=200\n"
        "/params temperature=9\n"
        "/params nope=1\n"
        "/params max_tokens=many\n"
        "first \\\n"
        "second\n"
        "/model\n"
        "/model other-model\n"
        "/model fake-model\n"
        f"/load {saved}\n"
        "/params max_tokens=none\n"
        "next\n"
        f"/load {tmp_path / 'missing.json'}\n"
    )
    with fake_server() as (url, fake):
        result = invoke(["--url", url], lines)
        first, last = fake.state.bodies
    assert result.exit_code == 1  # the bad /params and /load lines count as errors
    assert result.stdout == "You said: first \nsecond (turn 1)\n[Old system] You said: next (turn 2)\n"
    assert "Parameters: max_tokens=200 temperature=0.2" in result.stderr
    assert "temperature must be in [0.0, 2.0], not 9" in result.stderr
    assert "unknown parameter 'nope'" in result.stderr
    assert "max_tokens takes an integer, not 'many'" in result.stderr
    assert "Model: fake-model. The server serves: fake-model" in result.stderr
    assert "The server has no model 'other-model'; it serves: fake-model" in result.stderr
    assert "Model set to fake-model." in result.stderr and "Loaded 2 messages" in result.stderr
    assert "Cannot load" in result.stderr and "Parameters: temperature=0.2" in result.stderr
    assert (first["temperature"], first["max_tokens"]) == (0.2, 200)
    assert first["stream_options"] == {"include_usage": True}
    assert last["temperature"] == 0.2 and "max_tokens" not in last
    assert last["messages"] == [
        {"role": "system", "content": "Old system"},
        {"role": "user", "content": "earlier"},
        {"role": "assistant", "content": "an old answer"},
        {"role": "user", "content": "next"},
    ]


def test_prompt_option_prints_only_the_reply() -> None:
    with fake_server() as (url, fake):
        result = invoke(["--url", url, "-p", "please think", "--system", "S"], "ignored\n")
        wrong = invoke(["--url", url, "--model", "nope", "--prompt", "hi"], "")
        (body, _) = fake.state.bodies
    assert result.exit_code == 0 and result.stdout == "[S] You said: please think (turn 1)\n"
    assert "Let me think." in result.stderr  # reasoning stays off stdout
    assert [m["content"] for m in body["messages"]] == ["S", "please think"]
    assert wrong.exit_code == 1 and wrong.stdout == ""
    assert "HTTP 404: The model `nope` does not exist." in wrong.stderr


def test_streamed_tool_calls_usage_and_timing_are_folded_into_the_reply() -> None:
    reply = chat_cmd.Reply()
    seen: list[str] = []
    chunks: list[dict[str, Any]] = [
        {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"delta": {"content": "Checking."}}]},
        {"choices": [{"delta": {"tool_calls": [
            {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
        ]}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}}]},
        {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}},
    ]  # fmt: skip
    for chunk in chunks:
        chat_cmd.on_event(chunk, reply, 0.0, seen.append, seen.append)
    reply.latency_s = reply.ttft_s + 1.1 if reply.ttft_s is not None else None
    assert seen == ["Checking."] and reply.content == "Checking."
    assert reply.tool_calls == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
        }
    ]
    assert reply.tool_call_lines() == ['Tool call: get_weather({"city": "Oslo"})']
    assert (reply.num_chunks, reply.completion_tokens) == (4, 12)
    stats = reply.stats()
    assert stats is not None and stats.endswith(
        " ms · 10.0 tok/s · 12 tokens"
    )  # 11 tokens after the 1st in 1.1 s


ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\r")


class Terminal:
    """The master side of a pseudo-terminal: type into it, wait for text to appear on it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.output = ""
        self.seen = 0

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def expect(self, text: str, timeout_s: float = 30.0) -> str:
        """Read until ``text`` appears after the last match; returns the output up to its end."""
        while (found := self.output.find(text, self.seen)) < 0:
            ready, _, _ = select.select([self.fd], [], [], timeout_s)
            assert ready, f"no {text!r} in {self.output[self.seen :]!r}"
            try:
                data = os.read(self.fd, 4096)
            except OSError:  # EIO: the child closed the terminal
                data = b""
            assert data, f"the chat exited before {text!r}: {self.output[self.seen :]!r}"
            self.output += ANSI.sub("", data.decode(errors="replace"))
        start, self.seen = self.seen, found + len(text)
        return self.output[start : self.seen]

    def wait_for_line_editor(self, timeout_s: float = 30.0) -> None:
        """Wait until readline has taken the terminal out of canonical mode to read a line.

        A Ctrl-D typed before that is queued by the kernel as a NUL byte, not an end of file.
        """
        if importlib.util.find_spec("readline") is None:
            return  # plain input(): the terminal stays canonical and Ctrl-D is an end of file
        deadline = time.monotonic() + timeout_s
        while termios.tcgetattr(self.fd)[3] & termios.ICANON:  # the master reports the slave's modes
            assert time.monotonic() < deadline, "readline never took the terminal"
            select.select([], [], [], 0.01)


def test_a_terminal_session_with_system_multi_line_ctrl_c_and_ctrl_d() -> None:
    env = {**os.environ, "TERM": "dumb", "COLUMNS": "200", "NO_COLOR": "1"}
    with fake_server() as (url, fake):
        pid, fd = pty.fork()
        if pid == 0:  # the child becomes `izh chat` on the terminal at once
            os.execve(sys.executable, [sys.executable, "-m", "izh_cli.main", "chat", "--url", url], env)
        term = Terminal(fd)
        status: int | None = None
        try:
            term.expect("Chatting with fake-model")
            term.expect("> ")
            term.type("hello\n")
            term.expect("You said: hello (turn 1)")
            assert re.search(r"TTFT \d+ ms · [\d.]+ tok/s · \d+ tokens", term.expect("> "))
            term.type("/system Be brief\n")
            term.expect("System prompt set.")
            term.type("two \\\n")
            term.expect("... ")
            term.type("lines\n")
            term.expect("[Be brief] You said: two \nlines (turn 2)")
            term.type("/params temperature=0.3\n")
            term.expect("Parameters: temperature=0.3")
            term.type("tell me a BLOCK story\n")
            assert fake.state.blocked.wait(30)  # one token arrived; the reply is in flight
            term.type("\x03")  # Ctrl-C, through the terminal's line discipline
            term.expect("(interrupted)")
            term.expect("> ")
            term.type("/clear\n")  # the interrupted turn is kept; clear it so BLOCK is not sent again
            term.expect("Conversation cleared.")
            term.type("still here\n")
            term.expect("[Be brief] You said: still here (turn 1)")
            term.expect("> ")
            term.wait_for_line_editor()
            term.type("\x04")  # Ctrl-D leaves
            _, status = os.waitpid(pid, 0)
        finally:
            if status is None:  # a failed expectation: do not leave the chat running
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            os.close(fd)
        assert os.waitstatus_to_exitcode(status) == 0, term.output
        bodies = fake.state.bodies
    assert len(bodies) == 4
    assert bodies[2]["temperature"] == 0.3 and "temperature" not in bodies[1]
    assert bodies[3]["messages"] == [
        {"role": "system", "content": "Be brief"},
        {"role": "user", "content": "still here"},
    ]
    assert "Traceback" not in term.output


def _png_file(path: Path, seed: int = 1) -> Path:
    import numpy as np
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (40, 60, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, format="PNG")
    return path


def test_image_attaches_to_the_next_message(tmp_path: Path) -> None:
    import base64

    png = _png_file(tmp_path / "cat.png")
    (tmp_path / "notes.txt").write_text("not an image")
    lines = (
        f"/image {tmp_path / 'notes.txt'}\n"
        f"/image {tmp_path / 'missing.png'}\n"
        "/image\n"
        f"/image {png}\n"
        "/image\n"
        "what is this?\n"
        "and now?\n"
        f"/image {png}\n"
        "/image clear\n"
        "bye\n"
    )
    with fake_server() as (url, fake):
        # wide enough that no path is broken mid-name (a long tmp_path was, at the default 80 columns)
        result = invoke(["--url", f"{url}/v1"], lines, env={"COLUMNS": "1000"})
        bodies = fake.state.bodies
    assert result.exit_code == 1, result.output  # the chat goes on, but the failed commands count
    notes = " ".join(result.stderr.split())  # the console wraps long lines
    assert "notes.txt is not a PNG, JPEG or WebP image." in notes
    assert "Cannot read" in notes and "No image attached" in notes
    assert "Attached to your next message: cat.png" in notes and "Images dropped." in notes
    data_url = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
    assert bodies[0]["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url}},
                {"type": "text", "text": "what is this?"},
            ],
        }
    ]
    # Sent once: the next messages (and the one after /image clear) are text, the history keeps the image.
    assert bodies[1]["messages"][0] == bodies[0]["messages"][0]
    assert bodies[1]["messages"][2] == {"role": "user", "content": "and now?"}
    assert bodies[2]["messages"][4] == {"role": "user", "content": "bye"}


def test_image_chat_with_a_vision_model(tmp_path: Path, tiny_idefics3_dir: str) -> None:
    """`izh chat` against a real server of a tiny random VLM: the reply is the API's for the same image."""
    import base64

    from izh.config import EngineConfig
    from tests.e2e.api_server import api_server

    png = _png_file(tmp_path / "cat.png", seed=3)
    config = EngineConfig(model=tiny_idefics3_dir, served_model_name="vlm", device="cpu", dtype="float32")
    with api_server(config) as server:
        result = invoke(
            ["--url", f"{server.url}/v1", "--temperature", "0", "--max-tokens", "6"],
            f"/image {png}\nWhat is it?\n",
        )
        url = "data:image/png;base64," + base64.b64encode(png.read_bytes()).decode()
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What is it?"}]
        body = {
            "model": "vlm",
            "messages": [{"role": "user", "content": content}],
            "temperature": 0,
            "max_tokens": 6,
        }
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    assert result.exit_code == 0, result.output
    assert result.stdout == reply["choices"][0]["message"]["content"].replace("\n", " ") + "\n"
