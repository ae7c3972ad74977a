"""Pooling (embedding) requests through the engine on a decoder (tiny random Llama): last-token
pooling equals transformers' final-normed hidden state of the last token, normalized; mean pooling
equals the mean of those states; embeddings ride in the same steps as generation without changing
its tokens; and a prompt longer than the step budget is embedded whole, in one step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from izh import LLM, SamplingParams
from izh.engine_messages import AddRequest
from izh.pooling_params import PoolingParams
from tests.engine.test_llm import GREEDY, PROMPTS, _llm


@pytest.fixture(scope="module")
def llama(tiny_llama_dir: str) -> LLM:
    return _llm(tiny_llama_dir, max_num_batched_tokens=16)


def _hf_hidden(path: str, token_ids: list[int]) -> np.ndarray:
    """transformers' last hidden states (after the final norm) [len, hidden] for one prompt."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        out = model(torch.tensor([token_ids]))
    return out.last_hidden_state[0].numpy().astype(np.float64)


def test_last_token_pooling_matches_transformers(tiny_llama_dir: str, llama: LLM) -> None:
    info = llama.engine_core.embedding_info()
    assert info["pooling_type"] == "last" and info["normalize_embeddings"] and info["can_generate"]
    outs = llama.embed(PROMPTS[:4])
    for out in outs:
        hidden = _hf_hidden(tiny_llama_dir, out.prompt_token_ids)
        want = hidden[-1] / np.linalg.norm(hidden[-1])
        got = np.asarray(out.embedding)
        assert got.shape == want.shape
        assert float(got @ want / np.linalg.norm(got)) > 0.9999
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_mean_pooling_over_a_prompt_longer_than_the_budget(tiny_llama_dir: str) -> None:
    llm = _llm(tiny_llama_dir, max_num_batched_tokens=8, pooling="mean", normalize_embeddings=False)
    text = PROMPTS[3] + " " + PROMPTS[6]
    out = llm.embed(text)[0]
    assert len(out.prompt_token_ids) > 8
    steps_before = llm.engine_core.scheduler.num_steps
    llm.embed(text)
    assert llm.engine_core.scheduler.num_steps - steps_before == 1  # whole, in one step
    want = _hf_hidden(tiny_llama_dir, out.prompt_token_ids).mean(axis=0)
    np.testing.assert_allclose(np.asarray(out.embedding), want, atol=1e-4)


def test_embeddings_beside_generation_leave_its_tokens_unchanged(llama: LLM) -> None:
    alone = [o.outputs[0].token_ids for o in llama.generate(PROMPTS[:3], GREEDY)]
    want = [o.embedding for o in llama.embed(PROMPTS[3:6])]
    core = llama.engine_core
    tokenizer = llama.get_tokenizer()
    pooling = PoolingParams(pooling_type="last", normalize=True)
    for i, prompt in enumerate(PROMPTS[:3]):
        llama._add_request(f"gen-{i}", tokenizer.encode(prompt), GREEDY)
    for i, prompt in enumerate(PROMPTS[3:6]):
        llama._add_request(
            f"emb-{i}", tokenizer.encode(prompt), SamplingParams(max_tokens=0), pooling_params=pooling
        )
    tokens: dict[str, list[int]] = {}
    vectors: dict[str, bytes] = {}
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.embedding is not None:
                vectors[out.request_id] = out.embedding
    llama._drain_finished()
    assert [tokens[f"gen-{i}"] for i in range(3)] == alone
    for i in range(3):
        assert tokens[f"emb-{i}"] == []
        np.testing.assert_allclose(np.frombuffer(vectors[f"emb-{i}"], "<f4"), want[i], atol=1e-5)


def test_the_core_refuses_a_pooling_request_that_was_not_validated(llama: LLM) -> None:
    from izh.errors import IzhError

    core = llama.engine_core
    bad = AddRequest(
        request_id="bad",
        prompt_token_ids=[5, 6, 7],
        sampling_params=SamplingParams(max_tokens=3),
        arrival_time=0.0,
        pooling_params=PoolingParams(pooling_type="last", normalize=True),
    )
    with pytest.raises(IzhError, match="internal error"):
        core.add_request(bad)
    assert not core.has_unfinished_requests()
