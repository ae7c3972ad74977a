"""Output parsers: generated text split into reasoning, content and tool calls, streaming and not.

`reasoning`: the `<think>` block. `tool_calls`: the deltas and the streaming machine every tool-call
parser is, over `tool_json`'s scanning of call objects; `hermes` and `llama3`: the two formats, by
name in `tools`. `tool_grammar`: the grammar forcing calls. Nothing here knows of HTTP.
"""
