"""Completion prompts: a string, token ids, or a batch of either, tokenized (off the event loop).

The prompts are checked once, on admission (izh.frontend.input_processor); the echo of a token-id
prompt is decoded only after that (`decode_echoes`), so an out-of-range id never reaches the
tokenizer.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from izh.api.common.protocol import CompletionPrompt
from izh.errors import InvalidRequest
from izh.tokenizer import Tokenizer


@dataclass(slots=True)
class Prompt:
    """One prompt of the batch: its token ids, and its text (None: token ids not decoded yet)."""

    token_ids: list[int]
    text: str | None = ""


def split_prompts(prompt: CompletionPrompt, param: str = "prompt") -> list[str | list[int]]:
    """The batch in `prompt` (the request field `param`): a string, a list of token ids, or a list of
    either."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequest(f"{param} must not be empty", param=param)
    if all(isinstance(item, int) for item in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def _encode_prompts(
    tokenizer: Tokenizer, prompts: list[str | list[int]], add_special_tokens: bool
) -> list[Prompt]:
    return [
        Prompt(tokenizer.encode(item, add_special_tokens=add_special_tokens), item)
        if isinstance(item, str)
        else Prompt(item, None)
        for item in prompts
    ]


async def encode_prompts(
    tokenizer: Tokenizer, prompt: CompletionPrompt, *, add_special_tokens: bool
) -> list[Prompt]:
    """Tokenize every prompt of the batch (off the event loop); token-id prompts stay undecoded."""
    items = split_prompts(prompt)
    return await asyncio.to_thread(_encode_prompts, tokenizer, items, add_special_tokens)


def _decode(tokenizer: Tokenizer, prompts: list[Prompt]) -> None:
    for prompt in prompts:
        if prompt.text is None:
            prompt.text = tokenizer.decode(prompt.token_ids)


async def decode_echoes(tokenizer: Tokenizer, prompts: list[Prompt]) -> None:
    """Fill in the text of token-id prompts, for echo (off the event loop); call after admission,
    which has checked every id against the vocabulary."""
    if any(prompt.text is None for prompt in prompts):
        await asyncio.to_thread(_decode, tokenizer, prompts)
