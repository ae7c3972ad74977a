"""Chat templates: HF's Jinja dialect, rendered in a jinja2 sandbox like transformers' apply_chat_template.

Templates come from model files and from requests, so they are untrusted code: they run in an
ImmutableSandboxedEnvironment where every unsafe attribute access raises at once (jinja's default
would render it as an empty string), and every failure becomes InvalidRequest, never a 500.
"""

from __future__ import annotations

import json
import operator
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from threading import Lock
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from izh.errors import InvalidRequest

# Bounds on what one template expression may build: `'x' * 10**9` would otherwise eat the memory of
# the API process before any error could be raised.
_MAX_REPEAT_LENGTH = 1_000_000
_MAX_POWER_EXPONENT = 4096

# Names a message's reasoning is passed under; transformers fills each from the first one present.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "IZH_CONTINUE_FINAL_MESSAGE_TAG "


class _GenerationExtension(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask markers) renders its body as is."""

    tags = {"generation"}  # noqa: RUF012 (jinja reads this class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


class _TemplateDict:
    """The template's `dict(...)`: builds dicts, exposes no type object to poke at."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, keys: Any, value: Any = None) -> dict[Any, Any]:
        return dict.fromkeys(keys, value)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's namespace(), refusing underscore names: `{% set ns.x = %}` bypasses the sandbox."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        # jinja's own signature trick: `self` inside *args, so namespace(self=...) still works.
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_namespace_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(f"chat templates cannot set underscore attribute {name!r} on a namespace")


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, failing loudly on unsafe access and on runaway `*` / `**`."""

    intercepted_binops = frozenset({"*", "**"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context: jinja2.runtime.Context, op: str, left: Any, right: Any) -> Any:
        if op == "*":
            _check_repeat(left, right)
            _check_repeat(right, left)
            return operator.mul(left, right)
        if isinstance(left, int) and isinstance(right, int) and right > _MAX_POWER_EXPONENT:
            raise SecurityError(f"exponent {right} is too large for a chat template")
        return operator.pow(left, right)


def _check_repeat(sequence: Any, count: Any) -> None:
    is_repeat = isinstance(sequence, str | list | tuple) and isinstance(count, int)
    if is_repeat and len(sequence) * count > _MAX_REPEAT_LENGTH:
        raise SecurityError("a chat template tried to build a sequence longer than 1,000,000 items")


def _raise_exception(message: object) -> NoReturn:
    raise InvalidRequest(str(message))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: Sequence[str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF's tojson: no HTML escaping (jinja's does), non-ASCII kept, json.dumps' options exposed.
    seps = tuple(separators) if separators is not None else None
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=seps, sort_keys=sort_keys)  # type: ignore[arg-type]


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def make_environment() -> ImmutableSandboxedEnvironment:
    """The sandboxed environment with HF's options, filters and globals."""
    env = _StrictSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationExtension, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


class ChatTemplateRenderer:
    """Compiles each template source once (bounded LRU) and renders chats with it."""

    def __init__(self, max_cached_templates: int = 32) -> None:
        self._env = make_environment()
        self._cache: OrderedDict[str, jinja2.Template] = OrderedDict()
        self._max_cached = max_cached_templates
        self._lock = Lock()

    def compile(self, source: str) -> jinja2.Template:
        """The compiled template; InvalidRequest if it does not parse."""
        with self._lock:
            template = self._cache.get(source)
            if template is not None:
                self._cache.move_to_end(source)
                return template
        try:
            template = self._env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise InvalidRequest(f"chat template syntax error (line {exc.lineno}): {exc.message}") from None
        except Exception as exc:
            raise InvalidRequest(f"chat template does not compile: {exc}") from None
        with self._lock:
            self._cache[source] = template
            if len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return template

    def render(
        self,
        source: str,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The rendered prompt. Messages drop None-valued keys and get reasoning aliases, as in HF.

        `continue_final_message` renders the last message open-ended so the model continues it.
        Raises InvalidRequest on any template failure.
        """
        if not messages:
            raise InvalidRequest("messages must not be empty", param="messages")
        if continue_final_message and add_generation_prompt:
            raise InvalidRequest(
                "continue_final_message and add_generation_prompt cannot both be set",
                param="continue_final_message",
            )
        template = self.compile(source)
        chat = _alias_reasoning_fields([_normalize_message(m) for m in messages])
        final_text = _tag_final_message(chat) if continue_final_message else None
        context = {key: _plain(value) for key, value in (variables or {}).items()}
        context.update(
            messages=chat,
            tools=_plain(list(tools)) if tools is not None else None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
        )
        rendered = _render(template, context)
        return _cut_at_final_message(rendered, final_text) if final_text is not None else rendered


def _render(template: jinja2.Template, context: dict[str, Any]) -> str:
    try:
        return template.render(**context)
    except InvalidRequest:
        raise
    except SecurityError as exc:
        raise InvalidRequest(f"chat template rejected by the sandbox: {exc}") from None
    except jinja2.TemplateError as exc:
        raise InvalidRequest(f"chat template error: {exc}") from None
    except RecursionError:
        raise InvalidRequest("chat template error: recursion too deep") from None
    except Exception as exc:
        # A TypeError or KeyError inside the template is the template's (or the request's) fault.
        raise InvalidRequest(f"chat template error: {type(exc).__name__}: {exc}") from None


def _normalize_message(message: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise InvalidRequest(
            f"each message must be an object, got {type(message).__name__}", param="messages"
        )
    # Templates handle a missing key but often render None as the text "None".
    return {_plain(key): _plain(value) for key, value in message.items() if value is not None}


def _alias_reasoning_fields(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    aliased = []
    for message in chat:
        reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def _tag_final_message(chat: list[dict[str, Any]]) -> str:
    """Appends a marker to the final message's text; returns that text (before the marker)."""
    final = chat[-1]
    content = final.get("content")
    if isinstance(content, str):
        final["content"] = content + _CONTINUE_TAG
        return content
    if isinstance(content, list):
        for part in reversed(content):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                text: str = part["text"]
                part["text"] = text + _CONTINUE_TAG
                return text
    raise InvalidRequest("continue_final_message needs a final message with text content", param="messages")


def _cut_at_final_message(rendered: str, final_text: str) -> str:
    marker = _CONTINUE_TAG.strip()
    if marker not in rendered or final_text.strip() not in rendered:
        raise InvalidRequest(
            "continue_final_message: the chat template does not render the final message's content",
            param="continue_final_message",
        )
    cut = rendered.rindex(marker)
    if rendered[cut : cut + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:cut]
    # The template trimmed the trailing space after the marker, so it may have trimmed the text's too.
    return rendered[:cut].rstrip()


def _plain(value: Any) -> Any:
    """A copy of `value` made only of JSON types, so a template can reach no method of a rich object."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    model_dump = getattr(value, "model_dump", None)
    if callable(model_dump):
        return _plain(model_dump())
    return f"<{type(value).__name__}>"
