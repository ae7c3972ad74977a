"""lm-evaluation-harness against a real `izh serve` of the default model, offline, in-process.

The `local-completions` model with the server's own tokenizer (`tokenizer_backend=remote`: GET
/tokenizer_info, POST /tokenize and /detokenize) sends token-id prompts to /v1/completions: echo +
logprobs for the loglikelihood of each multiple-choice option, greedy generations cut at a stop string
for generate_until. The tasks are local (tests/fixtures/lm_eval: JSONL data, task YAMLs). The tests
check that the harness computes its metrics from izh's answers, not what SmolLM2-135M scores.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.real_server import API_KEY, RealServer, serve_default_model

pytestmark = pytest.mark.slow

logger = logging.getLogger(__name__)

TASKS_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "lm_eval"


@pytest.fixture(scope="module")
def server(smollm2_gguf: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    yield from serve_default_model(smollm2_gguf, tmp_path_factory)


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No hub: the datasets are local JSONL files, named relative to the task folder (the cwd)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    # local-completions sends OPENAI_API_KEY as its bearer token; the remote tokenizer sends auth_token.
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    monkeypatch.chdir(TASKS_DIR)


def model_args(server: RealServer) -> dict[str, Any]:
    """local-completions' arguments: token-id prompts, the server's tokenizer, one try per request."""
    return {
        "model": server.model,
        "base_url": f"{server.base_url}/completions",
        "tokenizer_backend": "remote",
        "tokenized_requests": True,
        "auth_token": API_KEY,
        "max_length": 2048,
        "max_retries": 1,  # a failed request fails the test at once, not after backoff
        "timeout": 300,
    }


def evaluate(server: RealServer, task: str) -> dict[str, Any]:
    """lm_eval.simple_evaluate of one local task through local-completions; its results for the task."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=model_args(server),
        tasks=[task],
        task_manager=TaskManager(include_path=str(TASKS_DIR), include_defaults=False),
        batch_size=1,
        log_samples=False,
        bootstrap_iters=0,
    )
    assert results is not None
    return dict(results["results"][task])


def test_multiple_choice_by_loglikelihood(server: RealServer, offline: None) -> None:
    scores = evaluate(server, "izh_mc")
    accuracy = scores["acc,none"]
    print(f"izh_mc acc={accuracy:.3f}")
    logger.info("izh_mc scores: %s", scores)
    assert isinstance(accuracy, float) and 0.0 <= accuracy <= 1.0


def test_generate_until(server: RealServer, offline: None) -> None:
    scores = evaluate(server, "izh_gen")
    exact_match = scores["exact_match,none"]
    print(f"izh_gen exact_match={exact_match:.3f}")
    logger.info("izh_gen scores: %s", scores)
    assert isinstance(exact_match, float) and 0.0 <= exact_match <= 1.0


def test_loglikelihood_is_the_servers_logprob_of_the_continuation(server: RealServer, offline: None) -> None:
    """lm-eval sums token_logprobs[ctxlen:-1] of an echo reply with max_tokens 1: izh must answer one
    entry per prompt token plus the sampled one, in order, for that slice to be the continuation."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    context, continuation = "Question: What color is the sky on a clear day?\nAnswer:", " blue"
    lm = LocalCompletionsAPI(**model_args(server))
    request = Instance("loglikelihood", doc={}, arguments=(context, continuation), idx=0)
    ((logprob, is_greedy),) = lm.loglikelihood([request], disable_tqdm=True)

    headers = {"Authorization": f"Bearer {API_KEY}"}

    def tokenize(text: str) -> list[int]:
        body = {"prompt": text, "add_special_tokens": False}
        reply = httpx.post(f"{server.url}/tokenize", json=body, headers=headers, timeout=60)
        assert reply.status_code == 200, reply.text
        return list(reply.json()["tokens"])

    prompt_ids, num_context_tokens = tokenize(context + continuation), len(tokenize(context))
    # The server's own score of the same tokens: the prompt alone (max_tokens 0), echoed with logprobs.
    body = {"model": server.model, "prompt": prompt_ids, "max_tokens": 0, "echo": True, "logprobs": 0}
    reply = httpx.post(f"{server.base_url}/completions", json=body, headers=headers, timeout=60)
    assert reply.status_code == 200, reply.text
    token_logprobs = reply.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert len(token_logprobs) == len(prompt_ids) and num_context_tokens < len(prompt_ids)
    expected = sum(token_logprobs[num_context_tokens:])
    print(f"loglikelihood({continuation!r}) = {logprob:.4f}, greedy={is_greedy}")
    assert logprob == pytest.approx(expected, abs=1e-3)
    assert isinstance(is_greedy, bool)


def test_remote_tokenizer_is_detected_and_agrees_with_the_server(server: RealServer, offline: None) -> None:
    """tokenizer_backend auto probes GET /tokenizer_info and POST /tokenize; the remote tokenizer then
    finds the end-of-text id by tokenizing eos_token, decodes through /detokenize and renders chat
    prompts with the served chat_template."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(**{**model_args(server), "tokenizer_backend": "auto"})
    assert lm.tokenizer_backend == "remote"
    info = lm.tokenizer.tokenizer_info
    assert lm.eot_token_id == info["eos_token_id"] and lm.eos_string == info["eos_token"]
    text = "Question: What is 2 plus 2?\nAnswer: 4"
    assert lm.tokenizer.decode(lm.tok_encode(text)) == text
    rendered = lm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered.startswith(info["bos_token"]) and "hi" in rendered
