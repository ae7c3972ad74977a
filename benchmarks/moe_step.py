"""A mixture-of-experts decode step against a dense model with the same *active* parameter bytes.

    flock /tmp/izh-bench.lock python benchmarks/moe_step.py --streams 1 --streams 8

Two random checkpoints in the Qwen3 layout, written once under --folder (bfloat16 safetensors, the test
fixtures' 512-token tokenizer; the benchmark ignores EOS and never reads the text):
- moe: Qwen3-MoE, `--experts` experts of `--moe-intermediate`, top `--top-k`, renormalized;
- dense: Qwen3 with an MLP of top_k * moe_intermediate, so a token reads the same weight bytes (the
  router's [experts, hidden] float32 aside, reported).
Same attention, layers, vocabulary. Both are served by the offline engine (izh's kernels, the weights
packed as int4 records), in one process, alternated round by round; the number is the median engine
step of the decode steps where every stream decodes (wall and process CPU time: the CPU time is the
steadier on a shared host). One JSON goes under bench_results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.offline_throughput import make_prompts, write_record

ATTENTION = {
    "vocab_size": 512,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 2048,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "use_sliding_window": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


def specs(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    common = {**ATTENTION, "hidden_size": args.hidden, "num_hidden_layers": args.layers}
    return {
        "moe": {
            **common,
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "intermediate_size": args.top_k * args.moe_intermediate,
            "moe_intermediate_size": args.moe_intermediate,
            "num_experts": args.experts,
            "num_experts_per_tok": args.top_k,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        },
        "dense": {
            **common,
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "intermediate_size": args.top_k * args.moe_intermediate,
        },
    }


def write_checkpoint(folder: Path, spec: dict[str, Any]) -> str:
    """A random bfloat16 checkpoint of `spec` (rewritten when the spec changed)."""
    from safetensors.torch import save_file

    from tests.fixtures.checkpoints import _write_tokenizer_files, build_tokenizer

    config_path = folder / "config.json"
    if config_path.is_file() and json.loads(config_path.read_text()) == spec:
        return str(folder)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    hidden, heads, kv_heads, head_dim = (
        spec["hidden_size"],
        spec["num_attention_heads"],
        spec["num_key_value_heads"],
        spec["head_dim"],
    )

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).bfloat16()

    w = {
        "model.embed_tokens.weight": normal(spec["vocab_size"], hidden),
        "model.norm.weight": torch.ones(hidden),
    }
    for i in range(spec["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        w[p + "self_attn.q_proj.weight"] = normal(heads * head_dim, hidden)
        w[p + "self_attn.k_proj.weight"] = normal(kv_heads * head_dim, hidden)
        w[p + "self_attn.v_proj.weight"] = normal(kv_heads * head_dim, hidden)
        w[p + "self_attn.o_proj.weight"] = normal(hidden, heads * head_dim)
        w[p + "self_attn.q_norm.weight"] = torch.ones(head_dim)
        w[p + "self_attn.k_norm.weight"] = torch.ones(head_dim)
        if spec["model_type"] == "qwen3_moe":
            inter = spec["moe_intermediate_size"]
            w[p + "mlp.gate.weight"] = normal(spec["num_experts"], hidden) * 50  # varied routing
            for e in range(spec["num_experts"]):
                q = f"{p}mlp.experts.{e}."
                w[q + "gate_proj.weight"] = normal(inter, hidden)
                w[q + "up_proj.weight"] = normal(inter, hidden)
                w[q + "down_proj.weight"] = normal(hidden, inter)
        else:
            inter = spec["intermediate_size"]
            w[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
            w[p + "mlp.up_proj.weight"] = normal(inter, hidden)
            w[p + "mlp.down_proj.weight"] = normal(hidden, inter)
    w = {k: v.bfloat16() for k, v in w.items()}
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    _write_tokenizer_files(folder, build_tokenizer(), spec["max_position_embeddings"])
    config_path.write_text(json.dumps(spec, indent=2))
    return str(folder)


def active_bytes(llm: Any) -> dict[str, int]:
    """Weight bytes one token reads per step: every packed linear outside the experts, top_k experts of
    each sparse layer, the routers (float32), the norms; the LM head and the embedding row aside."""
    from izh.model.moe import SparseMoeBlock

    model = llm.engine_core.runner.model
    total = router = 0
    expert_modules = set()
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            router += module.gate.weight.nbytes
            per_expert = [sum(_linear_bytes(m) for m in e.modules()) for e in module.experts]
            total += module.top_k * max(per_expert)
            expert_modules.update(id(m) for e in module.experts for m in e.modules())
    for module in model.model.layers.modules():
        if id(module) not in expert_modules:
            total += _linear_bytes(module)
    return {"active_weight_bytes": total + router, "router_bytes": router}


def _linear_bytes(module: torch.nn.Module) -> int:
    from izh.model.layers import Linear, RMSNorm

    if isinstance(module, Linear):
        return module.packed.nbytes if module.packed is not None else module.weight.nbytes
    if isinstance(module, RMSNorm):
        return module.weight.nbytes
    return 0


def decode_steps(llm: Any, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    """Generate step by step; the median step (wall and CPU) among those where every stream decodes."""
    from izh import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    core = llm.engine_core
    for i, prompt in enumerate(prompts):
        llm._add_request(f"moe-bench-{time.monotonic_ns()}-{i}", prompt, params)
    wall: list[float] = []
    cpu: list[float] = []
    while core.has_unfinished_requests():
        w, c = time.perf_counter(), time.process_time()
        outputs = core.step()
        if core.last_step_is_decode and len(outputs) == len(prompts):
            wall.append(time.perf_counter() - w)
            cpu.append(time.process_time() - c)
    llm._drain_finished()
    return {
        "decode_steps": len(wall),
        "decode_step_ms": 1e3 * statistics.median(wall),
        "decode_step_cpu_ms": 1e3 * statistics.median(cpu),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--folder", default="/tmp/izh-moe-bench")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--moe-intermediate", type=int, default=768)
    parser.add_argument("--streams", type=int, action="append")
    parser.add_argument("--dtype", default="float32", help="the engine's activations: float32 or bfloat16")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--write-only", action="store_true", help="write the checkpoints and stop")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    streams = args.streams or [1, 8]

    from izh import LLM

    paths = {name: write_checkpoint(Path(args.folder) / name, spec) for name, spec in specs(args).items()}
    if args.write_only:
        return
    engine: dict[str, Any] = {"dtype": args.dtype, "quantization": "int4", "kv_cache_memory_bytes": 256 << 20}
    if args.threads:
        engine["num_threads"] = args.threads
    engine |= {"enable_prefix_caching": False, "max_model_len": 1024}
    llms = {name: LLM(path, **engine) for name, path in paths.items()}
    sizes = {name: active_bytes(llm) for name, llm in llms.items()}
    print(json.dumps(sizes), flush=True)
    for llm in llms.values():  # warm-up: the kernels, the allocator
        decode_steps(llm, make_prompts(2, 8, 512, seed=1), 4)
    runs: dict[str, dict[int, list[dict[str, float]]]] = {name: {n: [] for n in streams} for name in llms}
    for round_index in range(args.rounds):
        order = list(llms) if round_index % 2 == 0 else list(reversed(llms))
        for n in streams:
            prompts = make_prompts(n, args.input_len, 512, seed=round_index)
            for name in order:
                result = decode_steps(llms[name], prompts, args.output_len)
                runs[name][n].append(result)
                print(
                    f"round {round_index} {name:5s} {n:2d} streams: step {result['decode_step_ms']:6.2f} ms "
                    f"({result['decode_step_cpu_ms']:6.2f} ms CPU)",
                    flush=True,
                )
    summary: dict[str, Any] = {}
    for n in streams:
        row: dict[str, float] = {}
        for name in llms:
            row[f"{name}_step_ms"] = statistics.median(r["decode_step_ms"] for r in runs[name][n])
            row[f"{name}_step_cpu_ms"] = statistics.median(r["decode_step_cpu_ms"] for r in runs[name][n])
        row["moe_over_dense"] = row["moe_step_ms"] / row["dense_step_ms"]
        row["moe_over_dense_cpu"] = row["moe_step_cpu_ms"] / row["dense_step_cpu_ms"]
        summary[f"{n}_streams"] = row
    print(json.dumps(summary, indent=2))
    write_record(
        "moe_step",
        {"args": vars(args), "specs": specs(args), "active_bytes": sizes, "summary": summary, "runs": runs},
        args.out,
    )


if __name__ == "__main__":
    main()
