"""LLM's progress callback (the library reports, never draws) and izh_cli's Rich bar that draws it."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from izh import LLM, SamplingParams
from izh.llm import GENERATING, LOADING_WEIGHTS
from izh_cli.progress import ProgressBar


def test_llm_reports_loading_and_each_generate_call(tiny_llama_dir: str) -> None:
    calls: list[tuple[int, int, str]] = []
    llm = LLM(tiny_llama_dir, kv_cache_memory_bytes=8 << 20, progress=lambda *a: calls.append(a))
    loading = [c for c in calls if c[2] == LOADING_WEIGHTS]
    assert loading and loading == calls
    total = loading[0][1]
    assert [done for done, _, _ in loading] == list(range(1, total + 1))
    assert {t for _, t, _ in loading} == {total}

    calls.clear()
    params = SamplingParams(temperature=0.0, max_tokens=3, n=2)
    llm.generate(["hello world", "a"], params)
    assert calls == [(done, 4, GENERATING) for done in range(5)]  # from 0, one per finished request


def test_llm_without_a_callback_writes_nothing(
    tiny_llama_dir: str, capfd: pytest.CaptureFixture[str]
) -> None:
    llm = LLM(tiny_llama_dir, kv_cache_memory_bytes=8 << 20)
    llm.generate(["hello"] * 20, SamplingParams(max_tokens=2))
    out, err = capfd.readouterr()
    assert out == "" and "generating" not in err and "loading" not in err


def _bar() -> tuple[ProgressBar, io.StringIO]:
    sink = io.StringIO()
    console = Console(file=sink, force_terminal=True, width=80)
    return ProgressBar(console=console), sink


def test_progress_bar_draws_a_phase_and_takes_it_down_when_done() -> None:
    bar, sink = _bar()
    bar(1, 2, LOADING_WEIGHTS)
    assert bar._bar is not None
    bar(2, 2, LOADING_WEIGHTS)
    assert bar._bar is None  # done: the next phase gets a bar of its own
    assert LOADING_WEIGHTS in sink.getvalue()


def test_progress_bar_skips_small_generate_calls_and_closes_on_exit() -> None:
    bar, sink = _bar()
    for done in range(4):
        bar(done, 3, GENERATING)
    assert sink.getvalue() == ""
    with bar:
        bar(0, 32, GENERATING)
        assert bar._bar is not None
    assert bar._bar is None  # a phase cut short is taken down by the context manager
