"""`izh chat`: a terminal chat client for any OpenAI-compatible server, streaming replies.

Interactive on a terminal (commands in ``HELP``; Ctrl-C stops a reply and its request, not the chat;
TTFT and tok/s shown after each reply); with stdin not a terminal it reads one prompt per line and prints
one reply per line on stdout (command notes go to stderr), so it can be scripted; ``--prompt`` sends one
message and prints only the reply. In both modes a line ending with a backslash continues on the next.
"""

from __future__ import annotations

import base64
import contextlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from izh_cli.http import DEFAULT_URL, ApiKeyOption, ModelOption, UrlOption

if TYPE_CHECKING:
    import httpx

    from izh_cli.http import ServerUrls

EXIT_INTERRUPTED = 130
HELP = (
    "/exit  quit (or Ctrl-D)\n"
    "/reset, /clear  forget the conversation (keeps the system prompt)\n"
    "/system TEXT  set the system prompt (/system alone shows it)\n"
    "/params KEY=VALUE ...  set sampling parameters (KEY=none unsets; /params alone shows them)\n"
    "/model [NAME]  switch model (/model alone lists the server's)\n"
    "/save FILE  write the conversation as JSON\n"
    "/load FILE  continue a conversation saved with /save\n"
    "/image PATH  attach a PNG, JPEG or WebP image to your next message (a vision model; /image alone "
    "lists the attached, /image clear drops them)\n"
    "A line ending with \\ continues on the next. Ctrl-C stops a reply."
)
CONTINUATION = "\\"
ParamValue = float | int
# name -> (type, lowest, highest): the sampling parameters /params accepts, checked before sending.
PARAMS: dict[str, tuple[type[float] | type[int], float | None, float | None]] = {
    "temperature": (float, 0.0, 2.0),
    "top_p": (float, 0.0, 1.0),
    "top_k": (int, -1, None),
    "max_tokens": (int, 1, None),
    "seed": (int, None, None),
    "presence_penalty": (float, -2.0, 2.0),
    "frequency_penalty": (float, -2.0, 2.0),
}

TextSink = Callable[[str], None]


@dataclass(slots=True)
class Reply:
    content: str = ""
    reasoning: str = ""
    interrupted: bool = False
    error: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    """OpenAI's ``tool_calls``, their streamed pieces joined (by index)."""
    ttft_s: float | None = None
    latency_s: float | None = None
    num_chunks: int = 0
    completion_tokens: int | None = None
    """From the usage chunk, when the server sends one."""

    def stats(self) -> str | None:
        """``TTFT 12 ms · 85.3 tok/s · 32 tokens`` (tokens counted by chunks without usage)."""
        if self.ttft_s is None or self.latency_s is None:
            return None
        tokens = self.completion_tokens if self.completion_tokens is not None else self.num_chunks
        parts = [f"TTFT {self.ttft_s * 1000:.0f} ms"]
        decode_s = self.latency_s - self.ttft_s
        if tokens > 1 and decode_s > 0:
            parts.append(f"{(tokens - 1) / decode_s:.1f} tok/s")
        parts.append(f"{tokens} tokens")
        return " · ".join(parts)

    def tool_call_lines(self) -> list[str]:
        return [
            f"Tool call: {call['function']['name']}({call['function']['arguments']})"
            for call in self.tool_calls
        ]


def parse_params(argument: str) -> dict[str, ParamValue | None]:
    """``temperature=0.2 max_tokens=200`` -> values (None for ``KEY=none``); raises ValueError."""
    values: dict[str, ParamValue | None] = {}
    for item in argument.split():
        key, sep, text = item.partition("=")
        if key not in PARAMS:
            raise ValueError(f"unknown parameter {key!r}; known: {', '.join(PARAMS)}")
        if not sep or not text:
            raise ValueError(f"{key} needs a value: {key}=VALUE (or {key}=none)")
        if text.lower() == "none":
            values[key] = None
            continue
        kind, lowest, highest = PARAMS[key]
        try:
            value: ParamValue = kind(text)
        except ValueError:
            raise ValueError(
                f"{key} takes {'an integer' if kind is int else 'a number'}, not {text!r}"
            ) from None
        if (lowest is not None and value < lowest) or (highest is not None and value > highest):
            bounds = f"[{lowest}, {highest}]" if highest is not None else f">= {lowest}"
            raise ValueError(f"{key} must be in {bounds}, not {text}")
        values[key] = value
    return values


def read_message(read_line: Callable[[bool], str]) -> str:
    """One message from ``read_line(continued)``: a line ending with a backslash continues on the next.

    EOFError propagates only when nothing was read; a message cut by the end of input is returned.
    """
    lines: list[str] = []
    while True:
        try:
            line = read_line(bool(lines))
        except EOFError:
            if lines:
                return "\n".join(lines)
            raise
        if not line.endswith(CONTINUATION):
            lines.append(line)
            return "\n".join(lines)
        lines.append(line[: -len(CONTINUATION)])


def image_mime_type(data: bytes) -> str | None:
    """image/png, image/jpeg or image/webp by the file's signature; None for anything else."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


@dataclass(slots=True)
class CommandResult:
    message: str | None = None
    exit: bool = False
    error: bool = False


@dataclass(slots=True)
class ChatSession:
    """The conversation with one model on one server; ``messages`` excludes the system prompt."""

    client: httpx.Client
    urls: ServerUrls
    model: str
    system: str | None = None
    params: dict[str, ParamValue] = field(default_factory=dict)
    """Sampling parameters sent with every request (the server's defaults for the others)."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    images: list[tuple[str, str]] = field(default_factory=list)
    """(file name, data URL) of the images attached to the next message (/image)."""

    def payload(self) -> dict[str, Any]:
        history = [{"role": m["role"], "content": m["content"] or ""} for m in self.messages]
        system = [{"role": "system", "content": self.system}] if self.system else []
        body: dict[str, Any] = {"model": self.model, "messages": system + history, "stream": True}
        body["stream_options"] = {"include_usage": True}
        body.update(self.params)
        return body

    def send(self, text: str, on_content: TextSink, on_reasoning: TextSink) -> Reply:
        """Add the user's message, stream the reply into the sinks, and keep it in the history.

        A failed request leaves the history as it was; an interrupted reply keeps what arrived.
        """
        content: str | list[dict[str, Any]] = text
        if self.images:
            content = [{"type": "image_url", "image_url": {"url": url}} for _, url in self.images]
            content.append({"type": "text", "text": text})
        self.messages.append({"role": "user", "content": content})
        reply = Reply()
        start = time.perf_counter()
        try:
            self._stream(reply, start, on_content, on_reasoning)
        except KeyboardInterrupt:
            reply.interrupted = True  # leaving the stream's block closes the connection: the server aborts
        except Exception as exc:
            from izh_cli.http import exception_kind

            reply.error = exception_kind(exc)
        reply.latency_s = time.perf_counter() - start
        if reply.error is not None:
            self.messages.pop()  # the images stay attached, for another try
        else:
            self.images.clear()
            message: dict[str, Any] = {"role": "assistant", "content": reply.content}
            if reply.reasoning:
                message["reasoning_content"] = reply.reasoning
            if reply.tool_calls:
                message["tool_calls"] = reply.tool_calls
            self.messages.append(message)
        return reply

    def _stream(self, reply: Reply, start: float, on_content: TextSink, on_reasoning: TextSink) -> None:
        from izh_cli.http import DONE, SseDecoder, error_message, http_error_kind

        with self.client.stream("POST", self.urls.chat, json=self.payload()) as response:
            if response.status_code != 200:
                body = response.read()
                reply.error = http_error_kind(
                    response.status_code, error_message(body, response.reason_phrase)
                )
                return
            decoder = SseDecoder()
            for chunk in response.iter_bytes():
                for data in decoder.feed(chunk):
                    if data != DONE:
                        on_event(json.loads(data), reply, start, on_content, on_reasoning)
                if reply.error is not None:
                    return

    # --- commands -----------------------------------------------------------------------------------

    def command(self, line: str) -> CommandResult:
        """Run one ``/command``; unknown ones are an error message, never an exception."""
        name, _, argument = line.strip().partition(" ")
        argument = argument.strip()
        if name in ("/exit", "/quit", "/bye"):
            return CommandResult(exit=True)
        if name in ("/reset", "/clear"):
            self.messages.clear()
            return CommandResult("Conversation cleared.")
        if name == "/system":
            if not argument:
                return CommandResult(
                    f"System prompt: {self.system!r}" if self.system else "No system prompt."
                )
            self.system = argument
            return CommandResult("System prompt set.")
        if name == "/save":
            return self._save(argument)
        if name == "/load":
            return self._load(argument)
        if name == "/params":
            return self._params(argument)
        if name == "/model":
            return self._model(argument)
        if name == "/image":
            return self._image(argument)
        if name in ("/help", "/?"):
            return CommandResult(HELP)
        return CommandResult(f"Unknown command {name}; /help lists them.", error=True)

    def _save(self, argument: str) -> CommandResult:
        if not argument:
            return CommandResult("/save needs a file name.", error=True)
        path = Path(argument).expanduser()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(
                json.dumps(self.transcript(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
            )
        except OSError as exc:
            return CommandResult(f"Cannot save to {path}: {exc.strerror or exc}", error=True)
        return CommandResult(f"Saved {len(self.messages)} messages to {path}.")

    def _load(self, argument: str) -> CommandResult:
        """Replace the conversation (and system prompt) with a transcript written by /save."""
        if not argument:
            return CommandResult("/load needs a file name.", error=True)
        path = Path(argument).expanduser()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return CommandResult(f"Cannot load {path}: {getattr(exc, 'strerror', None) or exc}", error=True)
        messages = data.get("messages") if isinstance(data, dict) else None
        valid = isinstance(messages, list) and all(
            isinstance(m, dict)
            and m.get("role") in ("system", "user", "assistant")
            and isinstance(m.get("content"), str | list | None)
            for m in messages
        )
        if not valid or not isinstance(messages, list):
            return CommandResult(f"{path} is not a transcript saved with /save.", error=True)
        systems = [m["content"] for m in messages if m["role"] == "system"]
        self.system = systems[-1] if systems else None
        self.messages = [dict(m) for m in messages if m["role"] != "system"]
        return CommandResult(f"Loaded {len(self.messages)} messages from {path}.")

    def _image(self, argument: str) -> CommandResult:
        """Attach an image file to the next message as a data URL (the server decodes and checks it)."""
        if not argument:
            if not self.images:
                return CommandResult("No image attached; /image PATH attaches one to your next message.")
            return CommandResult(
                "Attached to your next message: " + ", ".join(name for name, _ in self.images)
            )
        if argument == "clear":
            self.images.clear()
            return CommandResult("Images dropped.")
        path = Path(argument).expanduser()
        try:
            data = path.read_bytes()
        except OSError as exc:
            return CommandResult(f"Cannot read {path}: {exc.strerror or exc}", error=True)
        mime = image_mime_type(data)
        if mime is None:
            return CommandResult(f"{path} is not a PNG, JPEG or WebP image.", error=True)
        self.images.append((path.name, f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"))
        return CommandResult(f"Attached {path.name} ({len(data)} bytes) to your next message.")

    def _params(self, argument: str) -> CommandResult:
        try:
            values = parse_params(argument)
        except ValueError as exc:
            return CommandResult(str(exc), error=True)
        for key, value in values.items():
            if value is None:
                self.params.pop(key, None)
            else:
                self.params[key] = value
        shown = " ".join(f"{key}={value}" for key, value in sorted(self.params.items()))
        return CommandResult(f"Parameters: {shown or '(server defaults)'}")

    def _model(self, argument: str) -> CommandResult:
        from izh_cli.http import error_message, exception_kind, http_error_kind, model_ids

        try:
            response = self.client.get(f"{self.urls.api}/models")
        except Exception as exc:
            return CommandResult(f"{self.urls.api}/models: {exception_kind(exc)}", error=True)
        if response.status_code != 200:
            kind = http_error_kind(
                response.status_code, error_message(response.content, response.reason_phrase)
            )
            return CommandResult(f"{self.urls.api}/models: {kind}", error=True)
        available = model_ids(response.json())
        if not argument:
            listed = ", ".join(available) or "(none listed)"
            return CommandResult(f"Model: {self.model}. The server serves: {listed}")
        if available and argument not in available:
            return CommandResult(
                f"The server has no model {argument!r}; it serves: {', '.join(available)}", error=True
            )
        self.model = argument
        return CommandResult(f"Model set to {argument}.")

    def transcript(self) -> dict[str, Any]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return {
            "model": self.model,
            "url": self.urls.api,
            "saved": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "messages": system + [dict(m) for m in self.messages],
        }


def on_event(
    event: dict[str, Any], reply: Reply, start: float, on_content: TextSink, on_reasoning: TextSink
) -> None:
    """Fold one streamed chat chunk into the reply: text, reasoning, tool-call pieces, usage, errors."""
    if event.get("error"):
        error = event["error"]
        reply.error = str(error.get("message") if isinstance(error, dict) else error)
        return
    usage = event.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        reply.completion_tokens = usage["completion_tokens"]
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        content = delta.get("content")
        tool_calls = delta.get("tool_calls") or []
        if not (reasoning or content or tool_calls):
            continue
        reply.num_chunks += 1
        if reply.ttft_s is None:
            reply.ttft_s = time.perf_counter() - start
        if reasoning:
            reply.reasoning += reasoning
            on_reasoning(reasoning)
        if content:
            reply.content += content
            on_content(content)
        for piece in tool_calls:
            _add_tool_call_piece(reply.tool_calls, piece)


def _add_tool_call_piece(calls: list[dict[str, Any]], piece: dict[str, Any]) -> None:
    """OpenAI streams a tool call as pieces sharing an index: the first has id and name, all add arguments."""
    index = piece.get("index", len(calls))
    while len(calls) <= index:
        calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
    call = calls[index]
    if piece.get("id"):
        call["id"] = piece["id"]
    function = piece.get("function") or {}
    call["function"]["name"] += function.get("name") or ""
    call["function"]["arguments"] += function.get("arguments") or ""


# --- the command -------------------------------------------------------------------------------------


def chat(
    url: UrlOption = DEFAULT_URL,
    model: ModelOption = None,
    api_key: ApiKeyOption = None,
    system: Annotated[
        str | None, typer.Option("--system", "-s", help="System prompt.", show_default=False)
    ] = None,
    temperature: Annotated[
        float | None,
        typer.Option(
            "--temperature",
            "-t",
            min=0.0,
            help="Sampling temperature (default: the server's).",
            show_default=False,
        ),
    ] = None,
    max_tokens: Annotated[
        int | None,
        typer.Option(
            "--max-tokens", min=1, help="Longest reply in tokens (default: the server's).", show_default=False
        ),
    ] = None,
    prompt: Annotated[
        str | None,
        typer.Option(
            "--prompt",
            "-p",
            help="Send this one message, print only the reply on stdout and exit (for scripts).",
            show_default=False,
        ),
    ] = None,
    local: Annotated[
        str | None,
        typer.Option(
            "--local",
            help="Run this model in-process instead of connecting to --url: a registry name "
            "(smollm2), a .gguf file or a Hugging Face folder.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Chat with a model in the terminal, replies streamed as they are generated.

    Commands: /exit, /reset (/clear), /system TEXT, /params K=V, /model [NAME], /save FILE, /load FILE,
    /help. A line ending with \\ continues on the next; Ctrl-C stops a reply. When stdin is not a
    terminal, each input line is one prompt and each reply one output line; -p sends one prompt.
    """
    if local is not None:
        from izh_cli._common import cli_errors, stderr_console
        from izh_cli.local_server import local_server

        with cli_errors(), contextlib.ExitStack() as stack:
            with stderr_console().status(f"loading {local} (in-process)..."):
                started = stack.enter_context(local_server(local))
            key = api_key if api_key is not None else started.api_key
            _run_chat(started.url, model, key, system, temperature, max_tokens, prompt)
        return
    _run_chat(url, model, api_key, system, temperature, max_tokens, prompt)


def _run_chat(
    url: str,
    model: str | None,
    api_key: str | None,
    system: str | None,
    temperature: float | None,
    max_tokens: int | None,
    prompt: str | None,
) -> None:
    import httpx

    from izh_cli._common import EXIT_USAGE, fail
    from izh_cli.http import ServerError, auth_headers, exception_kind, first_model, resolve_urls

    try:
        urls = resolve_urls(url)
    except ValueError as exc:
        fail(str(exc), "pass --url http://HOST:PORT/v1", EXIT_USAGE)
    timeout = httpx.Timeout(600.0, connect=10.0)
    with httpx.Client(headers=auth_headers(api_key), timeout=timeout, verify=urls.verify_tls) as client:
        try:
            model = model or first_model(client, urls)
        except httpx.HTTPError as exc:
            fail(
                f"cannot reach {urls.api}: {exception_kind(exc)}",
                "is the server running? Start one with `izh serve`.",
            )
        except (ServerError, ValueError) as exc:
            fail(f"{urls.api}/models: {exc}", "pass --model, or check --url and --api-key.")
        params: dict[str, ParamValue] = {}
        if temperature is not None:
            params["temperature"] = temperature
        if max_tokens is not None:
            params["max_tokens"] = max_tokens
        session = ChatSession(client, urls, model, system, params)
        if prompt is not None:
            code = _one_shot(session, prompt)
        else:
            code = _interactive(session) if sys.stdin.isatty() else _scripted(session)
    if code:
        raise typer.Exit(code)


def _scripted(session: ChatSession) -> int:
    """One prompt per input line, one reply per output line; notes and errors on stderr."""
    from izh_cli._common import stderr_console

    notes = stderr_console()
    failed = False

    def reasoning(text: str) -> None:
        notes.print(text, style="dim", end="", markup=False, highlight=False)

    lines = (raw.rstrip("\n") for raw in sys.stdin)

    def next_line(_continued: bool) -> str:
        line = next(lines, None)
        if line is None:
            raise EOFError
        return line

    while True:
        try:
            line = read_message(next_line)
        except EOFError:
            break
        if not line.strip():
            continue
        if line.startswith("/"):
            result = session.command(line)
            if result.exit:
                break
            if result.message:
                notes.print(
                    result.message, style="red" if result.error else "dim", markup=False, highlight=False
                )
            failed |= result.error
            continue
        reply = session.send(line, lambda text: typer.echo(text, nl=False), reasoning)
        if reply.reasoning:
            notes.print()
        for call in reply.tool_call_lines():
            notes.print(call, style="cyan", markup=False, highlight=False)
        if reply.interrupted:
            typer.echo("")
            return EXIT_INTERRUPTED
        if reply.error is not None:
            if reply.content:
                typer.echo("")  # what arrived before a mid-stream failure stays on its own line
            notes.print(f"Error: {reply.error}", style="red", markup=False, highlight=False)
            failed = True
            continue
        typer.echo("")
    return 1 if failed else 0


def _one_shot(session: ChatSession, prompt: str) -> int:
    """-p: one message; stdout holds only the reply, reasoning, tool calls and errors go to stderr."""
    from izh_cli._common import stderr_console

    notes = stderr_console()

    def reasoning(text: str) -> None:
        notes.print(text, style="dim", end="", markup=False, highlight=False)

    reply = session.send(prompt, lambda text: typer.echo(text, nl=False), reasoning)
    if reply.reasoning:
        notes.print()
    if reply.content or reply.error is None:
        typer.echo("")
    for call in reply.tool_call_lines():
        notes.print(call, style="cyan", markup=False, highlight=False)
    if reply.interrupted:
        return EXIT_INTERRUPTED
    if reply.error is not None:
        notes.print(f"Error: {reply.error}", style="red", markup=False, highlight=False)
        return 1
    return 0


def _interactive(session: ChatSession) -> int:
    """The REPL: Rich prompt, streamed replies (reasoning dimmed), Ctrl-C stops a reply, Ctrl-D quits."""
    from rich.console import Console

    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and history for input())
    console = Console()
    console.print(
        f"Chatting with [bold]{session.model}[/] at {session.urls.api}. /help for commands, Ctrl-D to quit.",
        highlight=False,
    )

    def read_line(continued: bool) -> str:
        return str(console.input("[dim]...[/] " if continued else "[bold green]>[/] "))

    while True:
        try:
            line = read_message(read_line)
        except EOFError:
            console.print()
            return 0
        except KeyboardInterrupt:
            console.print("\n[dim](Ctrl-D or /exit to quit)[/]")
            continue
        if not line.strip():
            continue
        if line.startswith("/"):
            result = session.command(line)
            if result.exit:
                return 0
            if result.message:
                console.print(
                    result.message, style="red" if result.error else "dim", markup=False, highlight=False
                )
            continue
        _interactive_reply(console, session, line)


def _interactive_reply(console: Any, session: ChatSession, line: str) -> None:
    state = {"reasoning": False}

    def on_reasoning(text: str) -> None:
        state["reasoning"] = True
        console.print(text, style="dim italic", end="", markup=False, highlight=False, soft_wrap=True)

    def on_content(text: str) -> None:
        if state["reasoning"]:
            console.print("\n")
            state["reasoning"] = False
        console.print(text, end="", markup=False, highlight=False, soft_wrap=True)

    reply = session.send(line, on_content, on_reasoning)
    console.print()
    for call in reply.tool_call_lines():
        console.print(call, style="cyan", markup=False, highlight=False)
    if reply.interrupted:
        console.print("(interrupted)", style="yellow", highlight=False)
    if reply.error is not None:
        console.print(f"Error: {reply.error}", style="red", markup=False, highlight=False)
    elif (stats := reply.stats()) is not None:
        console.print(stats, style="dim", markup=False, highlight=False)
