"""What an image costs a vision-language model in izh's engine: SmolVLM-256M-Instruct's shapes with random
weights (no download: transformers builds the checkpoint, the tiny test tokenizer goes with it).

    python benchmarks/vlm_image_cost.py --repeats 2

Measured in one process on `EngineCore` (the server's engine without HTTP), each a median over
`--repeats`:

- the vision encoder alone (`encode_images`) on 1 and on 2 tiles of 512 x 512: the time per tile;
- time to first token of a prompt with one image sent as one tile (detail "low": 64 placeholder tokens),
  of a text-only prompt of the same length, and of the same image prompt again (its blocks now in the
  prefix cache: no encoder, no prefill);
- the decode steps after each (mean inter-token time over `--decode-tokens`): an image in the context
  must cost decode nothing (decode steps take the text model's usual path).

One JSON goes under bench_results/ (machine, CPU model and flags, every repeat).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from izh_cli.bench.report import cpu_model_and_flags  # noqa: E402


def _sha() -> str:
    run = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    return run.stdout.strip() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch
    from PIL import Image

    from izh.config import EngineConfig
    from izh.engine.core import EngineCore
    from izh.engine_messages import AddRequest
    from izh.frontend.image_processor import load_image_processor
    from izh.model.idefics3 import Idefics3ForConditionalGeneration
    from izh.sampling_params import SamplingParams
    from izh.tokenizer import load_tokenizer
    from tests.fixtures.idefics3 import SMOLVLM_256M_SHAPE, build_tiny_idefics3

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        path = build_tiny_idefics3(Path(tmp) / "smolvlm-256m-random", seed=0, shape=SMOLVLM_256M_SHAPE)
        build_s = time.perf_counter() - start
        core = EngineCore(
            EngineConfig(model=path, max_model_len=2048, kv_cache_memory_bytes=256 << 20, seed=0)
        )
        processor = load_image_processor(path)
        assert processor is not None
        tokenizer = load_tokenizer(path)
        model = core.runner.model
        assert isinstance(model, Idefics3ForConditionalGeneration)

        pixels = np.random.RandomState(0).randint(0, 256, (480, 640, 3), dtype=np.uint8)
        images = [Image.fromarray(pixels)]
        prompt = "<|im_start|>User:<image>Describe this picture in detail.<end_of_utterance>\nAssistant:"
        image_ids, inputs = processor.build_prompt(
            prompt, [(images[0], "bench-image")], tokenizer.encode, low_detail=[True]
        )
        text_ids = tokenizer.encode("<|im_start|>User: " + "Describe the picture. " * 40)[: len(image_ids)]
        assert len(text_ids) == len(image_ids)
        counter = iter(range(10**6))

        def run(token_ids: list[int], with_image: bool) -> tuple[float, float, int]:
            """(time to first token s, mean inter-token s, cached tokens) of one greedy request."""
            request_id = f"r{next(counter)}"
            params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens + 1, ignore_eos=True)
            core.add_request(
                AddRequest(
                    request_id=request_id,
                    prompt_token_ids=token_ids,
                    sampling_params=params,
                    arrival_time=0.0,
                    images=inputs if with_image else None,
                )
            )
            t0 = time.perf_counter()
            first = None
            times = []
            cached = 0
            while core.has_unfinished_requests():
                for out in core.step():
                    if out.new_token_ids:
                        now = time.perf_counter()
                        first = now if first is None else first
                        times.append(now)
                    cached = max(cached, out.num_cached_tokens)
            assert first is not None
            return first - t0, (times[-1] - times[0]) / max(1, len(times) - 1), cached

        tile = torch.from_numpy(
            np.frombuffer(inputs[0].pixel_values, dtype="<f4").reshape(inputs[0].shape).copy()
        )
        run(text_ids[:32], False)  # warm-up: kernels built, caches touched
        rounds: list[dict[str, Any]] = []
        for _ in range(args.repeats):
            with torch.inference_mode():
                t0 = time.perf_counter()
                model.encode_images(tile)
                one = time.perf_counter() - t0
                t0 = time.perf_counter()
                model.encode_images(torch.cat([tile, tile]))
                two = time.perf_counter() - t0
            core.reset_prefix_cache()
            text_ttft, text_itl, _ = run(text_ids, False)
            core.reset_prefix_cache()
            image_ttft, image_itl, _ = run(image_ids, True)
            cached_ttft, cached_itl, cached = run(image_ids, True)
            rounds.append(
                {
                    "encoder_1_tile_s": one,
                    "encoder_2_tiles_s": two,
                    "text_ttft_s": text_ttft,
                    "text_itl_s": text_itl,
                    "image_ttft_s": image_ttft,
                    "image_itl_s": image_itl,
                    "image_cached_ttft_s": cached_ttft,
                    "image_cached_itl_s": cached_itl,
                    "image_cached_tokens": cached,
                }
            )
            print(json.dumps(rounds[-1]), flush=True)
        summary = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        cpu_model, cpu_flags = cpu_model_and_flags()
        result = {
            "benchmark": "vlm_image_cost",
            "git_sha": _sha(),
            "command": " ".join(sys.argv),
            "machine": {"platform": platform.platform(), "cpu": cpu_model, "cpu_flags": cpu_flags},
            "torch": torch.__version__,
            "device": core.device,
            "dtype": core.dtype,
            "model": "SmolVLM-256M-Instruct shapes, random weights",
            "prompt_tokens": len(image_ids),
            "image_tiles": inputs[0].shape[0],
            "build_s": build_s,
            "summary": summary,
            "rounds": rounds,
        }
    out = Path(args.out or f"bench_results/vlm_image_cost-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
