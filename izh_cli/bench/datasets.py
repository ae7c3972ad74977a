"""Benchmark prompts of known token lengths: random words, shared prefixes, a JSONL file, or ShareGPT.

The bench has no tokenizer of its own (it must work against any server): prompts are built from a list
of common English words, and when the server has a ``/tokenize`` endpoint (vLLM, izh, SGLang) each prompt
is measured and trimmed or grown until it has exactly the requested number of tokens. Without one, the
lengths are estimates and the report uses the prompt tokens the server reports in its usage.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from izh_cli.http import ServerUrls

DEFAULT_INPUT_LEN = 1024
DEFAULT_OUTPUT_LEN = 128
TOKENS_PER_WORD_GUESS = 1.3  # without a tokenizer: a typical BPE rate for English words
MAX_FIT_ROUNDS = 6
FIT_CONCURRENCY = 32
# vLLM's ShareGPT filter: too short to measure, or too long for common context windows.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048

# Common short English words: almost all are one token (with their leading space) in BPE vocabularies,
# so a prompt's token count follows its word count closely and fitting converges in a round or two.
_WORD_TEXT = """
    the of and to in is was for on are with as by at be this from or have an they which one you had not but
    what all were when we there can more if no out so said up about into than them only other new some could
    time these two may then first any like now my over such our man me even most made after also did many
    before must through back years where much your way well down should because each just those people how
    too little state good very make world still own see men work long get here between both life being under
    never day same another know while last might us great old year off come since against go came right used
    take three small large next early young important few public bad same able place group number part point
    case week company system program question government night city water room mother area money story fact
    month lot study book eye job word business issue side kind head house service friend father power hour
    game line end member law car name president team minute idea body information back parent face others
    level office door health person art war history party result change morning reason research girl guy
    moment air teacher force education food light river green blue red black white open close begin turn
    start show hear play run move live believe hold bring happen write provide sit stand lose pay meet
    include continue set learn lead understand watch follow stop create speak read allow add spend grow
    offer remember love consider appear buy wait serve die send expect build stay fall cut reach kill remain
"""
WORDS = tuple(dict.fromkeys(_WORD_TEXT.split()))


@dataclass(frozen=True, slots=True)
class Sample:
    """One benchmark request: a prompt (or chat messages), its length in tokens and the tokens to generate."""

    prompt: str
    output_len: int
    prompt_len: int
    messages: tuple[dict[str, Any], ...] | None = None
    prompt_len_exact: bool = False

    def chat_messages(self) -> list[dict[str, Any]]:
        return list(self.messages) if self.messages else [{"role": "user", "content": self.prompt}]


@dataclass(frozen=True, slots=True)
class DatasetSpec:
    """What `--dataset` and its length flags ask for."""

    name: str
    input_len: int = DEFAULT_INPUT_LEN
    output_len: int | None = None
    range_ratio: float = 0.0
    prefix_len: int = 0
    num_prefixes: int = 4
    seed: int = 0

    @property
    def kind(self) -> str:
        if self.name in ("random", "prefix"):
            return self.name
        return "jsonl" if self.name.endswith(".jsonl") else "sharegpt"

    def validate(self) -> None:
        """Raises ValueError for impossible settings (usage errors)."""
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError("--range-ratio must be in [0, 1)")
        if self.input_len < 1 or (self.output_len is not None and self.output_len < 1):
            raise ValueError("--input-len and --output-len must be at least 1")
        if self.prefix_len < 0 or self.num_prefixes < 1:
            raise ValueError("--prefix-len must be >= 0 and --num-prefixes >= 1")
        if self.kind == "prefix" and self.prefix_len == 0:
            raise ValueError("the prefix dataset needs --prefix-len > 0")
        if self.kind in ("jsonl", "sharegpt") and not Path(self.name).is_file():
            raise ValueError(f"dataset file not found: {self.name}")


# --- the tokenizer -----------------------------------------------------------------------------------


class ServerTokenizer:
    """Counts tokens with the server's ``POST /tokenize``: vLLM's shape (``{"prompt"}`` in, ``{"count"}`` or
    ``{"tokens"}`` out) or llama.cpp's (``{"content"}`` in, ``{"tokens"}`` out)."""

    def __init__(self, client: httpx.AsyncClient, url: str, model: str, shape: str = "vllm") -> None:
        self._client = client
        self._url = url
        self._model = model
        self.shape = shape
        self.tokens_per_word = TOKENS_PER_WORD_GUESS

    async def count(self, text: str) -> int:
        if self.shape == "llama.cpp":
            body: dict[str, Any] = {"content": text, "add_special": False}
        else:
            body = {"model": self._model, "prompt": text, "add_special_tokens": False}
        response = await self._client.post(self._url, json=body)
        response.raise_for_status()
        data = response.json()
        if isinstance(data.get("count"), int):
            return int(data["count"])
        return len(data["tokens"])

    @classmethod
    async def probe(cls, client: httpx.AsyncClient, urls: ServerUrls, model: str) -> ServerTokenizer | None:
        """A tokenizer calibrated on the word list, or None when the server has no usable /tokenize.

        vLLM's request shape first; llama-server answers it with no tokens (it reads ``content``), so an
        empty answer tries llama.cpp's shape before giving up."""
        for shape in ("vllm", "llama.cpp"):
            tokenizer = cls(client, f"{urls.root}/tokenize", model, shape)
            try:
                num_tokens = await tokenizer.count(" ".join(WORDS))
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                return None
            if num_tokens > 0:
                tokenizer.tokens_per_word = num_tokens / len(WORDS)
                return tokenizer
        return None


# --- fitting prompts to a token length ----------------------------------------------------------------


def _join(prefix: str, words: Sequence[str]) -> str:
    body = " ".join(words)
    return f"{prefix} {body}" if prefix and body else prefix or body


async def fit_prompt(
    target: int,
    rng: random.Random,
    tokenizer: ServerTokenizer | None,
    prefix: str = "",
    prefix_tokens: int = 0,
) -> tuple[str, int, bool]:
    """A prompt of ``prefix_tokens + target`` tokens: (text, its token count, whether it was measured)."""
    ratio = tokenizer.tokens_per_word if tokenizer else TOKENS_PER_WORD_GUESS
    words = rng.choices(WORDS, k=max(1, round(target / ratio)))
    total = prefix_tokens + target
    if tokenizer is None:
        return _join(prefix, words), total, False
    best: tuple[int, str, int] | None = None
    for _ in range(MAX_FIT_ROUNDS):
        text = _join(prefix, words)
        count = await tokenizer.count(text)
        if best is None or abs(count - total) < best[0]:
            best = (abs(count - total), text, count)
        diff = total - count
        if diff == 0:
            break
        # Each word is about `ratio` tokens: move by whole words, never past the target in one round.
        step = max(1, math.floor(abs(diff) / ratio))
        if diff > 0:
            words.extend(rng.choices(WORDS, k=step))
        else:
            del words[max(1, len(words) - step) :]
    assert best is not None
    return best[1], best[2], True


def _lengths(rng: random.Random, mean: int, ratio: float, count: int) -> list[int]:
    """Uniform integers in [mean*(1-ratio), mean*(1+ratio)] (vLLM's --random-range-ratio), at least 1."""
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(count)]


async def _gather_limited(factories: Sequence[Callable[[], Awaitable[Sample]]]) -> list[Sample]:
    semaphore = asyncio.Semaphore(FIT_CONCURRENCY)

    async def run(factory: Callable[[], Awaitable[Sample]]) -> Sample:
        async with semaphore:
            return await factory()

    return list(await asyncio.gather(*(run(f) for f in factories)))


# --- the datasets -------------------------------------------------------------------------------------


async def random_samples(spec: DatasetSpec, count: int, tokenizer: ServerTokenizer | None) -> list[Sample]:
    """Random-word prompts of ``prefix_len + input_len`` tokens; the prefix is shared by every prompt."""
    rng = random.Random(spec.seed)
    input_lens = _lengths(rng, spec.input_len, spec.range_ratio, count)
    output_lens = _lengths(rng, spec.output_len or DEFAULT_OUTPUT_LEN, spec.range_ratio, count)
    prefix, prefix_tokens = "", 0
    if spec.prefix_len:
        prefix, prefix_tokens, _ = await fit_prompt(spec.prefix_len, rng, tokenizer)
    seeds = [rng.getrandbits(32) for _ in range(count)]
    return await _fit_all(input_lens, output_lens, seeds, tokenizer, [(prefix, prefix_tokens)] * count)


async def prefix_samples(spec: DatasetSpec, count: int, tokenizer: ServerTokenizer | None) -> list[Sample]:
    """``num_prefixes`` shared prefixes of ``prefix_len`` tokens, each prompt one of them plus its own words."""
    rng = random.Random(spec.seed)
    prefixes = [await fit_prompt(spec.prefix_len, rng, tokenizer) for _ in range(spec.num_prefixes)]
    input_lens = _lengths(rng, spec.input_len, spec.range_ratio, count)
    output_lens = _lengths(rng, spec.output_len or DEFAULT_OUTPUT_LEN, spec.range_ratio, count)
    chosen = [prefixes[i % len(prefixes)] for i in range(count)]
    rng.shuffle(chosen)
    seeds = [rng.getrandbits(32) for _ in range(count)]
    return await _fit_all(input_lens, output_lens, seeds, tokenizer, [(p[0], p[1]) for p in chosen])


async def _fit_all(
    input_lens: list[int],
    output_lens: list[int],
    seeds: list[int],
    tokenizer: ServerTokenizer | None,
    prefixes: list[tuple[str, int]],
) -> list[Sample]:
    # One generator per prompt: the prompts do not depend on the order the fits finish in.
    def factory(i: int) -> Callable[[], Awaitable[Sample]]:
        async def make() -> Sample:
            prefix, prefix_tokens = prefixes[i]
            text, num_tokens, exact = await fit_prompt(
                input_lens[i], random.Random(seeds[i]), tokenizer, prefix, prefix_tokens
            )
            return Sample(
                prompt=text, output_len=output_lens[i], prompt_len=num_tokens, prompt_len_exact=exact
            )

        return make

    return await _gather_limited([factory(i) for i in range(len(input_lens))])


async def _measure(text: str, tokenizer: ServerTokenizer | None) -> tuple[int, bool]:
    if tokenizer is None:
        return max(1, round(len(text.split()) * TOKENS_PER_WORD_GUESS)), False
    return await tokenizer.count(text), True


def _jsonl_rows(path: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc})") from exc
        if not isinstance(row, dict) or not (
            isinstance(row.get("prompt"), str) or isinstance(row.get("messages"), list)
        ):
            raise ValueError(
                f'{path}:{number}: expected an object with "prompt" (a string) or "messages" (a list)'
            )
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


async def jsonl_samples(spec: DatasetSpec, count: int, tokenizer: ServerTokenizer | None) -> list[Sample]:
    """One request per line: ``{"prompt": str}`` or ``{"messages": [...]}``, optional ``"output_tokens"``.

    Lines are used in order and cycled when fewer than ``count``.
    """
    rows = _jsonl_rows(Path(spec.name))

    async def make(row: dict[str, Any]) -> Sample:
        messages = tuple(row["messages"]) if isinstance(row.get("messages"), list) else None
        prompt = row.get("prompt") or "\n".join(str(m.get("content", "")) for m in messages or ())
        prompt_len, exact = await _measure(prompt, tokenizer)
        output_len = int(
            row.get("output_tokens") or row.get("max_tokens") or spec.output_len or DEFAULT_OUTPUT_LEN
        )
        return Sample(prompt, output_len, prompt_len, messages, exact)

    distinct = await _gather_limited([functools.partial(make, row) for row in rows[:count]])
    return [distinct[i % len(distinct)] for i in range(count)]


def _sharegpt_pair(entry: Any) -> tuple[str, str] | None:
    turns = entry.get("conversations") or entry.get("conversation") if isinstance(entry, dict) else None
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    texts = [turn.get("value", turn.get("content")) if isinstance(turn, dict) else None for turn in turns[:2]]
    if not all(isinstance(text, str) for text in texts):
        return None
    return str(texts[0]), str(texts[1])


async def sharegpt_samples(spec: DatasetSpec, count: int, tokenizer: ServerTokenizer | None) -> list[Sample]:
    """ShareGPT JSON: the first human turn is the prompt, the reply's length the output (unless --output-len).

    Conversations are shuffled with the seed and filtered like vLLM's (lengths 4..1024, total <= 2048).
    """
    data = json.loads(Path(spec.name).read_text(encoding="utf-8"))
    if not isinstance(data, list):
        raise ValueError(f"{spec.name}: expected a JSON list of conversations (ShareGPT format)")
    order = list(range(len(data)))
    random.Random(spec.seed).shuffle(order)
    samples: list[Sample] = []
    for index in order:
        pair = _sharegpt_pair(data[index])
        if pair is None:
            continue
        sample = await _sharegpt_sample(pair, spec, tokenizer)
        if sample is not None:
            samples.append(sample)
            if len(samples) == count:
                break
    if not samples:
        raise ValueError(f"{spec.name}: no usable conversations (need a prompt and a reply of 4+ tokens)")
    return [samples[i % len(samples)] for i in range(count)]


async def _sharegpt_sample(
    pair: tuple[str, str], spec: DatasetSpec, tokenizer: ServerTokenizer | None
) -> Sample | None:
    prompt, reply = pair
    prompt_len, exact = await _measure(prompt, tokenizer)
    output_len = spec.output_len or (await _measure(reply, tokenizer))[0]
    too_short = prompt_len < SHAREGPT_MIN_LEN or output_len < SHAREGPT_MIN_LEN
    too_long = prompt_len > SHAREGPT_MAX_PROMPT_LEN or prompt_len + output_len > SHAREGPT_MAX_TOTAL_LEN
    if too_short or too_long:
        return None
    return Sample(prompt, output_len, prompt_len, None, exact)


_BUILDERS = {
    "random": random_samples,
    "prefix": prefix_samples,
    "jsonl": jsonl_samples,
    "sharegpt": sharegpt_samples,
}


async def build_samples(spec: DatasetSpec, count: int, tokenizer: ServerTokenizer | None) -> list[Sample]:
    """``count`` samples of the dataset ``spec`` names (deterministic for a seed and a tokenizer)."""
    return await _BUILDERS[spec.kind](spec, count, tokenizer)
