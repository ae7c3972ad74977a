"""Idefics3 (SmolVLM) against transformers on a tiny random checkpoint: our image processor's pixels and
prompt token ids, the model's logits with an image, and the engine's greedy tokens (one image, two
images, no image; chunked prefill splitting an image's placeholders; the prefix cache keyed on images)."""

from __future__ import annotations

import hashlib
import io

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoProcessor, Idefics3ForConditionalGeneration

from izh.config import EngineConfig
from izh.engine.core import EngineCore
from izh.engine_messages import AddRequest, ImageInput
from izh.frontend.image_processor import load_image_processor
from izh.model import AttentionMetadata, load_model
from izh.sampling_params import SamplingParams
from izh.tokenizer import load_tokenizer

PROMPT_ONE = "<|im_start|>User: Look at this.<image>What is in the image?<end_of_utterance>\nAssistant:"
PROMPT_TWO = "<|im_start|>User:<image>and<image>Which one is brighter?<end_of_utterance>\nAssistant:"
PROMPT_NONE = "<|im_start|>User: Describe the sky at night.<end_of_utterance>\nAssistant:"


def _image(seed: int, height: int, width: int, mode: str = "RGB") -> Image.Image:
    channels = 4 if mode == "RGBA" else 3
    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, channels), dtype=np.uint8)
    image = Image.fromarray(pixels, "RGBA" if mode == "RGBA" else "RGB")
    return image if mode in ("RGB", "RGBA") else image.convert(mode)


def _hash(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return hashlib.sha256(buffer.getvalue()).hexdigest()


@pytest.fixture(scope="module")
def hf_processor(tiny_idefics3_dir: str):
    return AutoProcessor.from_pretrained(tiny_idefics3_dir)


@pytest.fixture(scope="module")
def hf_model(tiny_idefics3_dir: str) -> Idefics3ForConditionalGeneration:
    return Idefics3ForConditionalGeneration.from_pretrained(
        tiny_idefics3_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.mark.parametrize(
    ("height", "width", "mode"),
    [(50, 70, "RGB"), (20, 20, "RGB"), (130, 40, "RGBA"), (33, 33, "L"), (300, 500, "RGB"), (32, 32, "P")],
)
def test_processor_matches_transformers(
    tiny_idefics3_dir: str, hf_processor, height: int, width: int, mode: str
) -> None:
    ours = load_image_processor(tiny_idefics3_dir)
    assert ours is not None
    tokenizer = load_tokenizer(tiny_idefics3_dir)
    images = [_image(1, height, width, mode), _image(2, width, height, mode)]
    ref = hf_processor(text=PROMPT_TWO, images=images)
    token_ids, inputs = ours.build_prompt(
        PROMPT_TWO, [(image, _hash(image)) for image in images], tokenizer.encode
    )
    assert token_ids == ref["input_ids"][0]
    ref_pixels = ref["pixel_values"][0]
    start = 0
    for image in inputs:
        pixels = np.frombuffer(image.pixel_values, dtype="<f4").reshape(image.shape)
        assert np.array_equal(pixels, ref_pixels[start : start + image.shape[0]])
        assert token_ids[image.offset] == token_ids[image.offset + image.length - 1] == ours.image_token_id
        start += image.shape[0]
    assert not ref_pixels[start:].any()  # transformers pads the shorter image's tile list with zeros


def test_processor_refuses_a_mismatch(tiny_idefics3_dir: str) -> None:
    ours = load_image_processor(tiny_idefics3_dir)
    assert ours is not None
    tokenizer = load_tokenizer(tiny_idefics3_dir)
    image = _image(1, 40, 40)
    with pytest.raises(ValueError, match="markers"):
        ours.build_prompt("no marker", [(image, "h")], tokenizer.encode)
    with pytest.raises(ValueError, match="tokens"):  # <image> typed as text beside the image's marker
        ours.build_prompt("look: <image>", [(image, "h")], lambda t: tokenizer.encode(t + "<image>"))


def test_text_only_model_has_no_image_processor(tiny_llama_dir: str) -> None:
    assert load_image_processor(tiny_llama_dir) is None


def test_logits_with_an_image_match_transformers(tiny_idefics3_dir: str, hf_processor, hf_model) -> None:
    ours, config = load_model(tiny_idefics3_dir, dtype=torch.float32)
    inputs = hf_processor(text=PROMPT_ONE, images=[_image(3, 50, 70)], return_tensors="pt")
    ids = inputs["input_ids"][0]
    with torch.inference_mode():
        ref = hf_model(**inputs).logits[0]
        embeds = ours.model.embed_tokens(ids)
        embeds[ids == config.image_token_id] = ours.encode_images(inputs["pixel_values"][0])
        meta = AttentionMetadata.for_prefill([len(ids)])
        got = ours.compute_logits(ours(ids, torch.arange(len(ids)), meta, inputs_embeds=embeds))
    assert (got - ref).abs().max().item() < 1e-4


def _hf_greedy(hf_processor, hf_model, prompt: str, images: list[Image.Image], max_tokens: int) -> list[int]:
    inputs = hf_processor(text=prompt, images=images or None, return_tensors="pt")
    with torch.inference_mode():
        out = hf_model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


class _Engine:
    def __init__(self, path: str, **options: object) -> None:
        options = {"kv_cache_memory_bytes": 16 << 20, **options}
        config = EngineConfig(model=path, dtype="float32", **options)  # type: ignore[arg-type]
        self.core = EngineCore(config)
        self.processor = load_image_processor(path)
        self.tokenizer = load_tokenizer(path)
        self.count = 0

    def prompt(self, text: str, images: list[Image.Image]) -> tuple[list[int], list[ImageInput]]:
        assert self.processor is not None
        return self.processor.build_prompt(text, [(i, _hash(i)) for i in images], self.tokenizer.encode)

    def run(self, text: str, images: list[Image.Image], max_tokens: int) -> tuple[list[int], int]:
        """(greedy tokens, prefix-cache hit in tokens)."""
        token_ids, inputs = self.prompt(text, images)
        self.count += 1
        request_id = f"r{self.count}"
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        self.core.add_request(
            AddRequest(
                request_id=request_id,
                prompt_token_ids=token_ids,
                sampling_params=params,
                arrival_time=0.0,
                images=inputs or None,
            )
        )
        tokens: list[int] = []
        cached = 0
        while self.core.has_unfinished_requests():
            for out in self.core.step():
                tokens.extend(out.new_token_ids)
                cached = max(cached, out.num_cached_tokens)
        self.core.check_invariants()
        return tokens, cached


MAX_TOKENS = 12


@pytest.mark.parametrize("budget", [512, 24])
def test_greedy_tokens_match_transformers(
    tiny_idefics3_dir: str, hf_processor, hf_model, budget: int
) -> None:
    """One image, two images and none; a budget of 24 tokens a step splits each image's placeholders
    over several prefill chunks."""
    engine = _Engine(tiny_idefics3_dir, max_num_batched_tokens=budget, enable_prefix_caching=False)
    cases = [
        (PROMPT_ONE, [_image(3, 50, 70)]),
        (PROMPT_TWO, [_image(4, 64, 30), _image(5, 90, 90)]),
        (PROMPT_NONE, []),
    ]
    for prompt, images in cases:
        expected = _hf_greedy(hf_processor, hf_model, prompt, images, MAX_TOKENS)
        tokens, _ = engine.run(prompt, images, MAX_TOKENS)
        assert tokens == expected, (prompt, len(images))
    assert not engine.core.runner._image_features  # every image's features freed once prefilled


def test_prefix_cache_keys_on_the_image(tiny_idefics3_dir: str, hf_processor, hf_model) -> None:
    engine = _Engine(tiny_idefics3_dir, max_num_batched_tokens=512, block_size=16)
    first, second = _image(6, 50, 70), _image(7, 50, 70)
    token_ids, inputs = engine.prompt(PROMPT_ONE, [first])
    assert engine.prompt(PROMPT_ONE, [second])[0] == token_ids  # the same token ids for both images
    image_start = inputs[0].offset // 16 * 16  # the first block that holds a placeholder

    tokens, cached = engine.run(PROMPT_ONE, [first], MAX_TOKENS)
    assert cached == 0
    again, cached = engine.run(PROMPT_ONE, [first], MAX_TOKENS)
    assert again == tokens
    assert cached == (len(token_ids) - 1) // 16 * 16  # every full block, the image's included

    other, cached = engine.run(PROMPT_ONE, [second], MAX_TOKENS)
    assert cached == image_start  # only the text before the image
    assert other == _hf_greedy(hf_processor, hf_model, PROMPT_ONE, [second], MAX_TOKENS)
    assert other != tokens


def test_concurrent_image_requests_with_preemption_match_transformers(
    tiny_idefics3_dir: str, hf_processor, hf_model
) -> None:
    """Three image requests at once in a KV cache that holds barely one of them (preemption recomputes an
    image's features), prefilled in chunks beside the others' decode steps: each gets transformers'
    tokens."""
    cases = [
        (PROMPT_ONE, [_image(8, 50, 70)]),
        (PROMPT_TWO, [_image(9, 64, 30), _image(10, 30, 64)]),
        (PROMPT_ONE, [_image(11, 90, 20)]),
    ]
    per_block = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 KV heads, head_dim 16, float32
    engine = _Engine(
        tiny_idefics3_dir, max_num_batched_tokens=32, kv_cache_memory_bytes=15 * per_block, max_model_len=240
    )
    for k, (prompt, images) in enumerate(cases):
        token_ids, inputs = engine.prompt(prompt, images)
        engine.core.add_request(
            AddRequest(
                request_id=f"c{k}",
                prompt_token_ids=token_ids,
                sampling_params=SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                arrival_time=0.0,
                images=inputs,
            )
        )
    tokens: dict[str, list[int]] = {f"c{k}": [] for k in range(len(cases))}
    while engine.core.has_unfinished_requests():
        for out in engine.core.step():
            tokens[out.request_id].extend(out.new_token_ids)
        engine.core.check_invariants()
    assert engine.core.make_stats().num_preemptions > 0
    for k, (prompt, images) in enumerate(cases):
        assert tokens[f"c{k}"] == _hf_greedy(hf_processor, hf_model, prompt, images, MAX_TOKENS), k
    assert not engine.core.runner._image_features


def test_offline_llm_refuses_image_placeholders_without_images(
    tiny_idefics3_dir: str, hf_processor, hf_model
) -> None:
    from izh import LLM
    from izh.errors import InvalidRequest

    llm = LLM(tiny_idefics3_dir, dtype="float32", kv_cache_memory_bytes=16 << 20)
    with pytest.raises(InvalidRequest, match="image placeholder"):
        llm.generate("Look: <image>", SamplingParams(temperature=0.0, max_tokens=2))
    out = llm.generate(PROMPT_NONE, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    assert out[0].outputs[0].token_ids == _hf_greedy(hf_processor, hf_model, PROMPT_NONE, [], MAX_TOKENS)
