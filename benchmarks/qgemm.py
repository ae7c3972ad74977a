"""Weight-only matmuls for small batches: izh's record kernels vs PyTorch's packed kernels and the dense
bfloat16 matmul, side by side in one run.

    python -m benchmarks.qgemm --rows 1,4,8,16,32,64

One "pass" is what one decode step reads: the four linears of each of 30 SmolLM2-135M layers (distinct
weights, so they stream from memory as in the engine, not from cache) plus the 49152 x 576 LM head. Each
kernel family runs the same weights (random, packed each way); passes alternate between the families and
the median of --repeats is reported (PyTorch's packed kernels only up to the 8 rows the engine gives them).
Writes one JSON under bench_results/.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from benchmarks.offline_throughput import write_record
from izh.kernels import cpu as cpu_ops
from izh.model.packed import (
    TORCH_PACKED_MAX_ROWS,
    quantize_int4,
    quantize_int8,
    quantize_q4_records,
    quantize_q8_records,
)

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down
HEAD_SHAPE = (49152, 576)


class _Dense:
    """The dense bfloat16 weight behind the same interface."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def matmul(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.nn.functional.linear(x, self.weight)
        return y if out is None else out[: y.shape[0]].copy_(y)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,8,16,32,64")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not cpu_ops.qgemm_available():
        raise SystemExit("izh's record kernels are not available here (need AVX512-BF16 and gcc)")

    torch.manual_seed(0)
    dense = [[torch.randn(o, i).bfloat16() * 0.02 for o, i in LAYER_SHAPES] for _ in range(args.layers)]
    head = torch.randn(*HEAD_SHAPE).bfloat16() * 0.02
    families: dict[str, tuple[Any, Any]] = {
        "torch": ([[quantize_int4(w) for w in ws] for ws in dense], quantize_int8(head)),
        "izh": ([[quantize_q4_records(w) for w in ws] for ws in dense], quantize_q8_records(head)),
        "dense": ([[_Dense(w) for w in ws] for ws in dense], _Dense(head)),
    }
    results = []
    for m in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(m, k).bfloat16() for k in (576, 1536)}
        logits = torch.empty(m, HEAD_SHAPE[0])
        names = [f for f in families if f != "torch" or m <= TORCH_PACKED_MAX_ROWS]
        times: dict[str, dict[str, list[float]]] = {f: {"layers": [], "head": []} for f in names}
        for rep in range(args.repeats + 2):
            for name in names:
                layers, lm_head = families[name]
                t0 = time.perf_counter()
                for ws in layers:
                    for (_, k), w in zip(LAYER_SHAPES, ws, strict=True):
                        w.matmul(xs[k])
                t1 = time.perf_counter()
                lm_head.matmul(xs[576], out=logits)
                t2 = time.perf_counter()
                if rep >= 2:  # warm-up passes
                    times[name]["layers"].append(t1 - t0)
                    times[name]["head"].append(t2 - t1)
        row: dict[str, object] = {"rows": m, "amx": cpu_ops.qgemm_uses_amx(4, m)}
        for name in names:
            row[name] = {part: 1e3 * statistics.median(v) for part, v in times[name].items()}
        baseline = "torch" if "torch" in names else "dense"
        row["baseline"] = baseline
        row["layers_speedup"] = row[baseline]["layers"] / row["izh"]["layers"]  # type: ignore[index]
        row["head_speedup"] = row[baseline]["head"] / row["izh"]["head"]  # type: ignore[index]
        print(row, flush=True)
        results.append(row)
    write_record(
        "qgemm",
        {"layers": args.layers, "repeats": args.repeats, "unit": "ms per pass (median)", "results": results},
        args.out,
    )


if __name__ == "__main__":
    main()
