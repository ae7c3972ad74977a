"""The cost of LoRA: 32 streams all on the base model vs spread over 4 adapters, in the offline engine.

    python benchmarks/lora_cost.py --streams 32 --adapters 4 --rank 8 --input-len 64 --output-len 64

Three configurations of the same model (the default SmolLM2 GGUF, default settings), run alternated
`--rounds` times so that a shared machine's drift hits them alike:
- `off`: LoRA off (no slots, no hooks): the baseline;
- `on_base`: LoRA on with the adapters loaded, every stream on the base model (what enabling LoRA
  costs requests that use none);
- `on_adapters`: the streams spread round-robin over the adapters (rank `--rank` on q/k/v/o/gate/up/down,
  random weights written as a PEFT folder here).
The overhead is `on_adapters` against `off`, by output tokens per second (wall and process CPU time)
and by decode step time.
Writes one JSON under bench_results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.offline_throughput import make_prompts, write_record

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(folder: Path, model_config, rank: int, seed: int) -> str:
    """A PEFT LoRA folder with random A and B (small B: a realistic, mild change of the model)."""
    from safetensors.torch import save_file

    from izh.model.lora import projection_shapes

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model_config.num_hidden_layers):
        for module, (in_features, out_features) in projection_shapes(model_config).items():
            group = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (
                torch.randn(rank, in_features, generator=g) / in_features**0.5
            )
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, rank, generator=g) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(folder)


def run(llm, prompts: list[list[int]], output_len: int, names: list[str | None]) -> dict[str, float]:
    """Generate for every prompt on its adapter (None: the base model), step by step: wall and process
    CPU time in all, and the median decode step (32 single-token decodes) in both clocks. CPU time is the
    steadier one on a machine shared with other jobs."""
    from izh import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    core = llm.engine_core
    for i, prompt in enumerate(prompts):
        llm._add_request(f"bench-{time.monotonic_ns()}-{i}", prompt, params, lora_name=names[i])
    wall0, cpu0 = time.perf_counter(), time.process_time()
    decode_wall: list[float] = []
    decode_cpu: list[float] = []
    num_out = 0
    while core.has_unfinished_requests():
        w, c = time.perf_counter(), time.process_time()
        outputs = core.step()
        if core.last_step_is_decode and len(outputs) == len(prompts):
            decode_wall.append(time.perf_counter() - w)
            decode_cpu.append(time.process_time() - c)
        num_out += sum(len(o.new_token_ids) for o in outputs)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    llm._drain_finished()
    return {
        "output_tokens": num_out,
        "elapsed_s": wall,
        "cpu_s": cpu,
        "output_tok_s": num_out / wall,
        "output_tok_per_cpu_s": num_out / cpu,
        "decode_steps": len(decode_wall),
        "decode_step_ms": 1e3 * statistics.median(decode_wall) if decode_wall else 0.0,
        "decode_step_cpu_ms": 1e3 * statistics.median(decode_cpu) if decode_cpu else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--max-lora-rank", type=int, default=16, help="the slots' rank (the engine default)")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from izh import LLM

    common = {"kv_cache_memory_bytes": 512 << 20, "max_model_len": 1024, "enable_prefix_caching": False}
    if args.threads:
        common["num_threads"] = args.threads
    off = LLM(args.model, **common)
    tmp = Path(tempfile.mkdtemp(prefix="izh-lora-bench-"))
    config = off.engine_core.runner.model_config
    adapters = {
        f"adapter{i}": write_random_adapter(tmp / f"adapter{i}", config, args.rank, seed=i)
        for i in range(args.adapters)
    }
    on = LLM(
        args.model, lora_modules=adapters, max_loras=args.adapters, max_lora_rank=args.max_lora_rank, **common
    )
    prompts = make_prompts(args.streams, args.input_len, off.engine_core.vocab_size, seed=0)
    names = list(adapters)
    spread: list[str | None] = [names[i % len(names)] for i in range(args.streams)]
    base: list[str | None] = [None] * args.streams
    runs: dict[str, list[dict[str, float]]] = {"off": [], "on_base": [], "on_adapters": []}
    run(on, prompts[:2], 4, [names[0], None])  # warm-up: the slots, the kernels
    run(off, prompts[:2], 4, [None, None])
    for round_index in range(args.rounds):
        for label, llm, lora_names in (
            ("off", off, base),
            ("on_base", on, base),
            ("on_adapters", on, spread),
        ):
            result = run(llm, prompts, args.output_len, lora_names)
            runs[label].append(result)
            print(
                f"round {round_index} {label:12s} {result['output_tok_s']:7.1f} tok/s  "
                f"{result['output_tok_per_cpu_s']:7.1f} tok/cpu-s  decode step {result['decode_step_ms']:6.1f} ms "
                f"({result['decode_step_cpu_ms']:6.1f} ms CPU)",
                flush=True,
            )
    summary = {
        label: {
            "output_tok_s": statistics.median(r["output_tok_s"] for r in results),
            "decode_step_ms": statistics.median(r["decode_step_ms"] for r in results),
            "output_tok_per_cpu_s": statistics.median(r["output_tok_per_cpu_s"] for r in results),
            "decode_step_cpu_ms": statistics.median(r["decode_step_cpu_ms"] for r in results),
        }
        for label, results in runs.items()
    }
    for label in ("on_base", "on_adapters"):
        summary[label]["overhead_tok_s_pct"] = 100 * (
            summary["off"]["output_tok_s"] / summary[label]["output_tok_s"] - 1
        )
        summary[label]["overhead_tok_per_cpu_s_pct"] = 100 * (
            summary["off"]["output_tok_per_cpu_s"] / summary[label]["output_tok_per_cpu_s"] - 1
        )
        summary[label]["overhead_decode_step_pct"] = 100 * (
            summary[label]["decode_step_ms"] / summary["off"]["decode_step_ms"] - 1
        )
        summary[label]["overhead_decode_step_cpu_pct"] = 100 * (
            summary[label]["decode_step_cpu_ms"] / summary["off"]["decode_step_cpu_ms"] - 1
        )
    runner = on.engine_core.runner
    print(json.dumps(summary, indent=2))
    write_record(
        "lora_cost",
        {
            "args": vars(args),
            "dtype": str(runner.dtype),
            "quantization": runner.quantization,
            "fused_stack": runner.model.fused_stack is not None,
            "summary": summary,
            "runs": runs,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
