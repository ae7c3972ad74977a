"""Chat templates render exactly as transformers' apply_chat_template, inside a sandbox that turns
every escape attempt and template error into InvalidRequest."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
from tokenizer_helpers import CHATML_TEMPLATE, SMOLLM2_GGUF, train_byte_level_bpe, write_hf_folder

from izh.errors import InvalidRequest
from izh.tokenizer import Tokenizer, load_tokenizer
from izh.tokenizer.chat_template import ChatTemplateRenderer
from izh.tokenizer.gguf_metadata import read_gguf_metadata

transformers = pytest.importorskip("transformers")

# Modelled on Qwen3's template: tools in the system prompt, <tool_call> blocks, tool responses
# folded into user turns, reasoning_content in <think> after the last query, enable_thinking.
QWEN3_LIKE_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions.\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nReturn calls in <tool_call></tool_call> tags.<|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string
        and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# tojson's HF options, special token variables, loop controls, dict(), and a generation block.
FEATURES_TEMPLATE = """\
{{ bos_token }}{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}
{% generation %}[{{ m.role }}] {{ m.content }}{% endgeneration %}
{% if loop.index > 5 %}{% break %}{% endif %}{% endfor %}
{{ tools | tojson(indent=2, sort_keys=true) }}
{{ {'é': 1, 'b': [1, 2]} | tojson(separators=(',', ':')) }}
{{ dict(a=1, b='x') | tojson }} {{ custom_flag }} {{ eos_token }}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city — «quoted»",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "single_user": [{"role": "user", "content": "Hi there!"}],
    "system_multi_turn": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? 日本語 😀"},
    ],
    "tool_round_trip": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
    ],
    "reasoning": [
        {"role": "user", "content": "Think first."},
        {"role": "assistant", "content": "<think>\nold thoughts\n</think>\n\nDone."},
        {"role": "user", "content": "Again"},
        # Read as reasoning_content, which HF fills from "reasoning" / "thinking".
        {"role": "assistant", "content": "Answer", "reasoning": "alias thoughts", "thinking": None},
    ],
    "reasoning_content": [
        {"role": "user", "content": "Think first."},
        {"role": "assistant", "content": "Done.", "reasoning_content": "Let me think."},
    ],
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Tokenizer, Any]:
    """Our tokenizer and transformers' for the same folder (with bos/eos/pad tokens)."""
    folder = write_hf_folder(
        tmp_path_factory.mktemp("chat"),
        train_byte_level_bpe("qwen2"),
        tokenizer_config={
            "bos_token": "<|endoftext|>",
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "chat_template": CHATML_TEMPLATE,
        },
    )
    return load_tokenizer(str(folder)), transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))


def assert_renders_like_transformers(pair: tuple[Tokenizer, Any], template: str, **options: Any) -> None:
    ours, reference = pair
    messages = options.pop("messages")
    expected = reference.apply_chat_template(messages, chat_template=template, tokenize=False, **options)
    assert ours.apply_chat_template(messages, chat_template=template, **options) == expected


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_qwen3_like_template_matches_transformers(
    pair: tuple[Tokenizer, Any], conversation: str, add_generation_prompt: bool
) -> None:
    for extra in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        for tools in (None, TOOLS):
            assert_renders_like_transformers(
                pair,
                QWEN3_LIKE_TEMPLATE,
                messages=CONVERSATIONS[conversation],
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **extra,
            )


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chatml_and_features_match_transformers(
    pair: tuple[Tokenizer, Any], add_generation_prompt: bool
) -> None:
    messages = [*CONVERSATIONS["system_multi_turn"], {"role": "skip", "content": "x"}]
    for template in (CHATML_TEMPLATE, FEATURES_TEMPLATE):
        assert_renders_like_transformers(
            pair,
            template,
            messages=messages,
            tools=TOOLS,
            add_generation_prompt=add_generation_prompt,
            custom_flag="on",
        )
    ours, reference = pair
    # The model's own template is the default.
    assert ours.apply_chat_template(messages) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


@pytest.mark.skipif(SMOLLM2_GGUF is None, reason="SmolLM2 GGUF not installed")
def test_smollm2_template_matches_transformers(pair: tuple[Tokenizer, Any]) -> None:
    template = read_gguf_metadata(SMOLLM2_GGUF)["tokenizer.chat_template"]
    for messages in (CONVERSATIONS["single_user"], CONVERSATIONS["system_multi_turn"]):
        for add_generation_prompt in (True, False):
            assert_renders_like_transformers(
                pair, template, messages=messages, add_generation_prompt=add_generation_prompt
            )


def test_continue_final_message_matches_transformers(pair: tuple[Tokenizer, Any]) -> None:
    messages = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2, "}]
    for template in (CHATML_TEMPLATE, QWEN3_LIKE_TEMPLATE):
        assert_renders_like_transformers(
            pair, template, messages=messages, add_generation_prompt=False, continue_final_message=True
        )


def test_strftime_now_renders_the_current_date(pair: tuple[Tokenizer, Any]) -> None:
    before = datetime.date.today().isoformat()
    rendered = pair[0].apply_chat_template(
        [{"role": "user", "content": "x"}], chat_template="{{ strftime_now('%Y-%m-%d') }}"
    )
    assert rendered in {before, datetime.date.today().isoformat()}


# ---- the sandbox --------------------------------------------------------------------------------

ESCAPES = [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__ }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ joiner.__init__.__globals__.os }}",
    "{{ lipsum.__globals__['os'].system('true') }}",
    "{{ self.__init__.__globals__ }}",
    "{{ [].__class__.__base__.__subclasses__() }}",
    "{{ messages[0].__class__.__init__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ namespace.__init__.__globals__ }}",
    "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
    "{{ dict.__call__.__globals__ }}",
    "{{ messages.append(1) }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{{ 'a' * 100000000 }}",
    "{{ 9 ** 999999999 }}",
    "{{ ''.format.__globals__ }}",
    "{{ '{0.__class__}'.format(messages) }}",
    "{{ (1).__class__.__subclasses__() }}",
]


@pytest.mark.parametrize("template", ESCAPES)
def test_sandbox_escapes_fail_with_invalid_request(pair: tuple[Tokenizer, Any], template: str) -> None:
    with pytest.raises(InvalidRequest):
        pair[0].apply_chat_template([{"role": "user", "content": "x"}], chat_template=template)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{ raise_exception('Only user and assistant roles, got ' + messages[0].role) }}", "got system"),
        ("{{ not_a_function() }}", "not_a_function"),
        ("{{ 'a' + 1 }}", "TypeError"),
        ("{{ messages[0].content.missing_method() }}", "missing_method"),
        ("{% for m in messages %}", "syntax error"),
        ("{{ messages | selectattr('role', 'no_such_test') | list }}", "no_such_test"),
    ],
)
def test_template_errors_are_invalid_requests(
    pair: tuple[Tokenizer, Any], template: str, message: str
) -> None:
    with pytest.raises(InvalidRequest, match=message):
        pair[0].apply_chat_template([{"role": "system", "content": "x"}], chat_template=template)


def test_raise_exception_message_is_exact(pair: tuple[Tokenizer, Any]) -> None:
    with pytest.raises(InvalidRequest) as excinfo:
        pair[0].apply_chat_template(
            [{"role": "user", "content": "x"}],
            chat_template="{{ raise_exception('Bad role: ' + messages[0].role) }}",
        )
    assert excinfo.value.message == "Bad role: user"


def test_bad_messages_are_invalid_requests(pair: tuple[Tokenizer, Any]) -> None:
    with pytest.raises(InvalidRequest, match="empty"):
        pair[0].apply_chat_template([])
    with pytest.raises(InvalidRequest, match="object"):
        pair[0].apply_chat_template(["just a string"])  # type: ignore[list-item]


def test_templates_compile_once() -> None:
    renderer = ChatTemplateRenderer(max_cached_templates=2)
    first = renderer.compile(CHATML_TEMPLATE)
    assert renderer.compile(CHATML_TEMPLATE) is first
    renderer.compile("a")
    renderer.compile("b")
    # The bounded cache evicted the least recently used template.
    assert renderer.compile(CHATML_TEMPLATE) is not first


def test_rich_objects_reach_templates_as_plain_data(pair: tuple[Tokenizer, Any]) -> None:
    class Content(str):
        def dangerous(self) -> str:
            return "ran"

    rendered = pair[0].apply_chat_template(
        [{"role": "user", "content": Content("hi")}],
        chat_template="{{ messages[0].content }}{{ messages[0].content.dangerous is defined }}",
    )
    assert rendered == "hiFalse"


def test_gguf_templates_are_loaded(tmp_path: Path) -> None:
    from tokenizer_helpers import write_tokenizer_gguf

    path = write_tokenizer_gguf(
        tmp_path / "t.gguf", train_byte_level_bpe("gpt2"), pre="gpt2", chat_template=CHATML_TEMPLATE
    )
    ours = load_tokenizer(str(path))
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False) == (
        "<|im_start|>user\nhi<|im_end|>\n"
    )
