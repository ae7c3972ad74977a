"""Offline tokens/s with tensor parallelism (TP=2, gloo, both ranks on this host) against TP=1, and the
share of rank 0's step time spent in collectives.

    python benchmarks/tp_offline.py --batch 1 --batch 8 --tokens 64

The model is a random float32 Llama of SmolLM2-135M's size and shape (30 layers, hidden 576, MLP 1536,
vocabulary 49,152, tied embeddings) but 6 attention heads of 96 and 2 KV heads, so that it splits in two
(SmolLM2's 9 / 3 heads do not); it is written once under --folder with the test fixtures' tokenizer (its
512 tokens cover the prompts; the benchmark ignores EOS and never reads the text). TP=1 runs with all the
cores' threads, each TP=2 rank with half (izh's default). One JSON goes under bench_results/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from izh_cli.bench.report import cpu_model_and_flags

SPEC = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "head_dim": 96,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 2048,
    "rope_theta": 100000.0,
    "rope_scaling": None,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}


def build_model(folder: Path) -> str:
    """The random SmolLM2-sized checkpoint (built once)."""
    from safetensors.torch import save_file

    from tests.fixtures.checkpoints import _write_tokenizer_files, build_tokenizer

    if (folder / "model.safetensors").is_file():
        return str(folder)
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    hidden, inter = SPEC["hidden_size"], SPEC["intermediate_size"]
    q, kv = SPEC["num_attention_heads"] * SPEC["head_dim"], SPEC["num_key_value_heads"] * SPEC["head_dim"]

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    w = {
        "model.embed_tokens.weight": normal(SPEC["vocab_size"], hidden),
        "model.norm.weight": torch.ones(hidden),
    }
    for i in range(SPEC["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = torch.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        w[p + "self_attn.q_proj.weight"] = normal(q, hidden)
        w[p + "self_attn.k_proj.weight"] = normal(kv, hidden)
        w[p + "self_attn.v_proj.weight"] = normal(kv, hidden)
        w[p + "self_attn.o_proj.weight"] = normal(hidden, q)
        w[p + "mlp.gate_proj.weight"] = normal(inter, hidden)
        w[p + "mlp.up_proj.weight"] = normal(inter, hidden)
        w[p + "mlp.down_proj.weight"] = normal(hidden, inter)
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(SPEC, indent=2))
    _write_tokenizer_files(folder, build_tokenizer(), SPEC["max_position_embeddings"])
    return str(folder)


def run(path: str, tp: int, batches: list[int], tokens: int, threads: int | None) -> list[dict[str, float]]:
    from izh import LLM, SamplingParams

    llm = LLM(
        path, dtype="float32", kv_cache_memory_bytes=256 << 20, tensor_parallel_size=tp, num_threads=threads
    )
    runtime = llm.engine_core.runner.tp_runtime
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(["warm up the kernels"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    rows = []
    for batch in batches:
        prompts = [f"prompt number {i} about the weather in a city far away" for i in range(batch)]
        comm0 = runtime.tp.comm_s if runtime is not None else 0.0
        calls0 = runtime.tp.comm_calls if runtime is not None else 0
        bytes0 = runtime.tp.comm_bytes if runtime is not None else 0
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        comm = (runtime.tp.comm_s - comm0) if runtime is not None else 0.0
        rows.append(
            {
                "tp": tp,
                "threads_per_rank": torch.get_num_threads(),
                "batch": batch,
                "output_tokens": generated,
                "wall_s": round(wall, 3),
                "tokens_per_s": round(generated / wall, 2),
                "rank0_collective_s": round(comm, 3),
                "rank0_collective_share": round(comm / wall, 3),
                "collectives": (runtime.tp.comm_calls - calls0) if runtime is not None else 0,
                "collective_bytes": (runtime.tp.comm_bytes - bytes0) if runtime is not None else 0,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    llm.engine_core.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--folder", default="/tmp/izh-tp-bench-model")
    parser.add_argument("--batch", type=int, action="append")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--config",
        action="append",
        help="TP[:THREADS] to run (default: 1 and 2, each with izh's default threads)",
    )
    args = parser.parse_args()
    batches = args.batch or [1, 8]
    path = build_model(Path(args.folder))
    rows = []
    for config in args.config or ["1", "2"]:
        tp, _, threads = config.partition(":")
        rows += run(path, int(tp), batches, args.tokens, int(threads) if threads else None)
    cpu, flags = cpu_model_and_flags()
    sha = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    record = {
        "benchmark": "tp_offline",
        "git_sha": sha,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpu": cpu, "flags": flags, "cores": os.cpu_count(), "platform": platform.platform()},
        "torch": torch.__version__,
        "model": {
            k: SPEC[k] for k in ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size")
        },
        "results": rows,
    }
    out = Path(args.out or f"bench_results/tp_offline-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
