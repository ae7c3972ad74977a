"""Completion prompts: a string, token ids, or a batch of either, tokenized (off the event loop) and
checked.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from izh.api.protocol import CompletionPrompt
from izh.errors import InvalidRequest
from izh.frontend.input_processor import check_prompt_token_ids
from izh.tokenizer import Tokenizer


@dataclass(slots=True)
class Prompt:
    """One prompt of the batch: its token ids, and its text when echo needs it."""

    token_ids: list[int]
    text: str = ""


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
    tokenizer: Tokenizer, prompts: list[str | list[int]], add_special_tokens: bool, echo: bool
) -> list[Prompt]:
    result = []
    for item in prompts:
        if isinstance(item, str):
            result.append(Prompt(tokenizer.encode(item, add_special_tokens=add_special_tokens), item))
        else:
            result.append(Prompt(item, tokenizer.decode(item) if echo else ""))
    return result


async def encode_prompts(
    tokenizer: Tokenizer, prompt: CompletionPrompt, *, add_special_tokens: bool, echo: bool, vocab_size: int
) -> list[Prompt]:
    """Tokenize (off the event loop) and check every prompt of the batch."""
    items = split_prompts(prompt)
    prompts = await asyncio.to_thread(_encode_prompts, tokenizer, items, add_special_tokens, echo)
    for i, item in enumerate(prompts):
        param = "prompt" if len(prompts) == 1 else f"prompt.{i}"
        check_prompt_token_ids(item.token_ids, vocab_size, param)
    return prompts
