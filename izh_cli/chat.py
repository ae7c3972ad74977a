"""`izh chat`: a terminal chat client for any OpenAI-compatible server, streaming replies.

Interactive on a terminal (commands ``/exit``, ``/reset``, ``/system TEXT``, ``/save FILE``, ``/help``;
Ctrl-C stops a reply and its request, not the chat); with stdin not a terminal it reads one prompt per
line and prints one reply per line on stdout (command notes go to stderr), so it can be scripted.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from izh_cli.bench.server import API_KEY_ENVVARS, DEFAULT_URL, URL_ENVVARS

if TYPE_CHECKING:
    import httpx

    from izh_cli.bench.server import ServerUrls

EXIT_INTERRUPTED = 130
HELP = (
    "/exit  quit (or Ctrl-D)\n"
    "/reset  forget the conversation (keeps the system prompt)\n"
    "/system TEXT  set the system prompt (/system alone shows it)\n"
    "/save FILE  write the conversation as JSON\n"
    "Ctrl-C stops a reply."
)

TextSink = Callable[[str], None]


@dataclass(slots=True)
class Reply:
    content: str = ""
    reasoning: str = ""
    interrupted: bool = False
    error: str | None = None


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
    temperature: float | None = None
    max_tokens: int | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)

    def payload(self) -> dict[str, Any]:
        history = [{"role": m["role"], "content": m["content"]} for m in self.messages]
        system = [{"role": "system", "content": self.system}] if self.system else []
        body: dict[str, Any] = {"model": self.model, "messages": system + history, "stream": True}
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        return body

    def send(self, text: str, on_content: TextSink, on_reasoning: TextSink) -> Reply:
        """Add the user's message, stream the reply into the sinks, and keep it in the history.

        A failed request leaves the history as it was; an interrupted reply keeps what arrived.
        """
        self.messages.append({"role": "user", "content": text})
        reply = Reply()
        try:
            self._stream(reply, on_content, on_reasoning)
        except KeyboardInterrupt:
            reply.interrupted = True  # leaving the stream's block closes the connection: the server aborts
        except Exception as exc:
            from izh_cli.bench.server import exception_kind

            reply.error = exception_kind(exc)
        if reply.error is not None:
            self.messages.pop()
        else:
            message: dict[str, Any] = {"role": "assistant", "content": reply.content}
            if reply.reasoning:
                message["reasoning_content"] = reply.reasoning
            self.messages.append(message)
        return reply

    def _stream(self, reply: Reply, on_content: TextSink, on_reasoning: TextSink) -> None:
        from izh_cli.bench.server import DONE, SseDecoder, error_message, http_error_kind

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
                        self._on_event(json.loads(data), reply, on_content, on_reasoning)
                if reply.error is not None:
                    return

    @staticmethod
    def _on_event(event: dict[str, Any], reply: Reply, on_content: TextSink, on_reasoning: TextSink) -> None:
        if event.get("error"):
            error = event["error"]
            reply.error = str(error.get("message") if isinstance(error, dict) else error)
            return
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                reply.reasoning += reasoning
                on_reasoning(reasoning)
            if delta.get("content"):
                reply.content += delta["content"]
                on_content(delta["content"])

    # --- commands -----------------------------------------------------------------------------------

    def command(self, line: str) -> CommandResult:
        """Run one ``/command``; unknown ones are an error message, never an exception."""
        name, _, argument = line.strip().partition(" ")
        argument = argument.strip()
        if name in ("/exit", "/quit", "/bye"):
            return CommandResult(exit=True)
        if name == "/reset":
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

    def transcript(self) -> dict[str, Any]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return {
            "model": self.model,
            "url": self.urls.api,
            "saved": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "messages": system + [dict(m) for m in self.messages],
        }


# --- the command -------------------------------------------------------------------------------------


def chat(
    url: Annotated[
        str, typer.Option("--url", envvar=URL_ENVVARS, help="Server URL (with or without /v1).")
    ] = DEFAULT_URL,
    model: Annotated[
        str | None,
        typer.Option(
            "--model", "-m", help="Model name; default: the first of /v1/models.", show_default=False
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option("--api-key", envvar=API_KEY_ENVVARS, help="Bearer token.", show_default=False),
    ] = None,
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
) -> None:
    """Chat with a model in the terminal, replies streamed as they are generated.

    Commands: /exit, /reset, /system TEXT, /save FILE, /help. Ctrl-C stops a reply. When stdin is not a
    terminal, each input line is one prompt and each reply one output line.
    """
    import httpx

    from izh_cli._common import EXIT_USAGE, fail
    from izh_cli.bench.server import ServerError, auth_headers, exception_kind, first_model, resolve_urls

    try:
        urls = resolve_urls(url)
    except ValueError as exc:
        fail(str(exc), "pass --url http://HOST:PORT/v1", EXIT_USAGE)
    timeout = httpx.Timeout(600.0, connect=10.0)
    with httpx.Client(headers=auth_headers(api_key), timeout=timeout) as client:
        try:
            model = model or first_model(client, urls)
        except httpx.HTTPError as exc:
            fail(
                f"cannot reach {urls.api}: {exception_kind(exc)}",
                "is the server running? Start one with `izh serve`.",
            )
        except (ServerError, ValueError) as exc:
            fail(f"{urls.api}/models: {exc}", "pass --model, or check --url and --api-key.")
        session = ChatSession(client, urls, model, system, temperature, max_tokens)
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

    for raw in sys.stdin:
        line = raw.rstrip("\n")
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
    while True:
        try:
            line = console.input("[bold green]>[/] ")
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
    if reply.interrupted:
        console.print("(interrupted)", style="yellow", highlight=False)
    if reply.error is not None:
        console.print(f"Error: {reply.error}", style="red", markup=False, highlight=False)
