"""The prepared device check of a GPU session: correctness first, then speed, in under 6 minutes on one H200.

    python benchmarks/gpu_check.py                      # on the GPU machine (or `just gpu-check`)
    python benchmarks/gpu_check.py --device cpu --dry-run   # the harness on a CPU: every phase, tiny sizes

Phases, in order, each with a time budget (a phase past it stops, is recorded as "timeout" and the next
one starts; the whole run is bounded by --time-limit):

1. env: machine, GPU, torch/triton versions; the device copy bandwidth (a large tensor copy, bytes read +
   bytes written over the time), the yardstick of the speed phases.
2. kernels: the Triton `paged_attention` and `write_kv_cache` against a float64 reference, float32 and
   bf16, fresh random inputs per case (benchmarks/paged_attention_cases.py: prefill, decode, mixed, GQA,
   head sizes 64 and 128, long contexts on the split-context path, padded decode rows with slot -1);
   outputs are NaN-poisoned first. On a CPU they run under Triton's interpreter (TRITON_INTERPRET=1, set
   here before triton is imported), where bf16 attention is skipped (the interpreter's bf16 tl.dot is
   wrong; bf16 loads and stores, hence write_kv_cache, are checked).
3. parity: greedy tokens of the model in float32 on the device equal the CPU float32 run (the SmolLM2 chat
   prompt of tests/fixtures/smollm2.py plus two random prompts). A CPU dry run compares CPU with CPU: a
   harness check only, and the output says so.
4. graphs: the offline engine with CUDA graphs (enforce_eager=False) against eager (enforce_eager=True),
   float32, greedy, on batches of exactly every captured decode batch size plus a few padded ones; the
   graph runner's replays are counted per padded size. On a CPU both engines are eager (harness only).
5. attention: decode attention at 256 sequences x 1,024 tokens of context (bf16, SmolLM2's 9/3 heads of 64
   and a Llama-8B-like 32/8 of 128): KV bytes read over the kernel time (CUDA events), as a fraction of
   the copy bandwidth.
6. offline: `izh.LLM` output tok/s at 1, 32 and 256 concurrent sequences (bf16); per decode step its wall
   time, the GPU time of the forward and logits (the engine's forward_s: the stream time between two CUDA
   events, launch gaps included), the share of the step spent outside it (Python, scheduler, sampler),
   and the step against its bytes-over-bandwidth floor ((weights + KV read) / copy bandwidth).
7. server: `izh serve` and `izh bench` as subprocesses on a loopback port, output tok/s at the same levels.

Targets (PASS/FAIL beside the numbers): one stream <= 2 ms per output token; 256 streams >= 40,000 output
tok/s offline and >= 80% of that through the server; decode attention at 256 x 1,024 >= 60% of copy
bandwidth. One JSON goes under bench_results/ (gpu_check-<time>.json; machine, GPU, torch/triton
versions, git sha, command), rewritten after every phase so that a killed run keeps what it measured;
progress lines carry timestamps; a table is printed last. The exit status is 1 when a correctness check
failed, else 0 (missed speed targets are reported, not failed).

The GPU machine has no network and the check downloads nothing: the model file must travel with the
working tree, copied from ~/.cache/izh/models/SmolLM2-135M-Instruct.Q4_1.gguf into the git-ignored .carry/
and carried. At 94 MiB it exceeds what one device call carries (64 MiB), so benchmarks/gpu_carry.sh splits
it into .carry/1 and .carry/2 (and puts the wheels of izh's dependencies that the GPU image lacks in .whl/),
and benchmarks/gpu_stage.sh, run on the device in two calls on the same warm machine, reassembles it as
/tmp/izh-carry/model.gguf. The exact device calls (carry lists, timeout_s 420) are in docs/operations.md,
"GPU check". --model PATH names another file; the default is /tmp/izh-carry/model.gguf, else
.carry/SmolLM2-135M-Instruct.Q4_1.gguf, else the registry's "smollm2" from the izh cache.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: `benchmarks.*`, `izh`, `tests.fixtures` from this checkout
    sys.path.insert(0, str(ROOT))

CARRIED_MODELS = (Path("/tmp/izh-carry/model.gguf"), ROOT / ".carry" / "SmolLM2-135M-Instruct.Q4_1.gguf")
"""Where --model defaults to, first found: benchmarks/gpu_stage.sh's assembled copy, a whole file in .carry/."""
TIME_LIMIT_S = 340.0
"""The whole check's budget: under 6 minutes with the start and the report."""

TARGET_MS_PER_TOKEN_1 = 2.0
TARGET_TOK_S_256 = 40_000.0
TARGET_SERVER_FRACTION = 0.8
TARGET_ATTENTION_FRACTION = 0.6


# --- progress and the record ------------------------------------------------------------------------


class Log:
    """Timestamped, flushed progress lines (a partial run still tells how far it got)."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def __call__(self, message: str) -> None:
        stamp = time.strftime("%H:%M:%S", time.gmtime())
        print(f"[{stamp} +{self.elapsed():6.1f}s] {message}", flush=True)


log = Log()


class Record:
    """The result JSON, rewritten (atomically) after every phase."""

    def __init__(self, path: Path, header: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {**header, "phases": {}, "targets": []}
        self.write()

    def phase(self, name: str, result: dict[str, Any]) -> None:
        self.data["phases"][name] = result
        self.write()

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(_jsonable(self.data), indent=2) + "\n")
        tmp.replace(self.path)


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x


class PhaseTimeout(Exception):
    pass


@dataclass
class Budget:
    """A phase's deadline: loops check `left()` between cases; SIGALRM stops a phase that overruns."""

    seconds: float
    start: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)

    def expired(self) -> bool:
        return self.left() <= 0


@contextlib.contextmanager
def alarm(seconds: float) -> Iterator[None]:
    def fire(_signum: int, _frame: Any) -> None:
        raise PhaseTimeout(f"over its {seconds:.0f} s budget")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.1))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# --- the run's settings -------------------------------------------------------------------------------


@dataclass
class Sizes:
    """Everything --dry-run shrinks."""

    copy_bytes: int
    small_kernel_cases: bool
    parity_tokens: int
    parity_prompt_lens: tuple[int, ...]
    """Random prompts beside the SmolLM2 chat prompt."""
    graph_max_num_seqs: int
    graph_prompt_len: int
    graph_output_len: int
    attention_seqs: int
    attention_context: int
    attention_iters: int
    levels: tuple[int, ...]
    input_len: int
    output_len: int
    server_requests: dict[int, int]


FULL = Sizes(
    copy_bytes=2 << 30,
    small_kernel_cases=False,
    parity_tokens=32,
    parity_prompt_lens=(50, 300),
    graph_max_num_seqs=256,
    graph_prompt_len=24,
    graph_output_len=8,
    attention_seqs=256,
    attention_context=1024,
    attention_iters=20,
    levels=(1, 32, 256),
    input_len=128,
    output_len=256,
    server_requests={1: 4, 32: 64, 256: 512},
)
DRY = Sizes(
    copy_bytes=64 << 20,
    small_kernel_cases=True,
    parity_tokens=4,
    parity_prompt_lens=(20,),
    graph_max_num_seqs=4,
    graph_prompt_len=8,
    graph_output_len=2,
    attention_seqs=4,
    attention_context=64,
    attention_iters=1,
    levels=(1, 2),
    input_len=8,
    output_len=4,
    server_requests={1: 1, 2: 2},
)


@dataclass
class Context:
    args: argparse.Namespace
    sizes: Sizes
    device: str
    dry: bool
    model: str
    copy_bandwidth: float | None = None
    """Bytes/s of a device copy, read + written (phase env)."""
    record: Record | None = None
    phase: str = ""
    """The phase running now: `checkpoint` saves its partial results under that name."""

    def checkpoint(self, partial: dict[str, Any]) -> None:
        """Save what the running phase measured so far (a run killed mid-phase keeps it)."""
        if self.record is not None and self.phase:
            self.record.phase(self.phase, {"status": "running", **partial})


def make_context(device: str, model: str, *, dry: bool = False, argv: list[str] | None = None) -> Context:
    """A Context for calling the phases' check functions directly (the tests in tests/gpu do)."""
    args = parse_args(["--device", device, "--model", model, *(["--dry-run"] if dry else []), *(argv or [])])
    return Context(args=args, sizes=DRY if dry else FULL, device=device, dry=dry, model=model)


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _engine(ctx: Context, **kwargs: Any) -> Any:
    """An offline LLM on the model; a CPU engine runs its torch paths (no C kernels to build)."""
    from izh import LLM

    kwargs.setdefault("device", ctx.device)
    if kwargs["device"] == "cpu":
        kwargs.setdefault("cpu_kernels", "off")
        kwargs.setdefault("num_threads", ctx.args.cpu_threads)
    kwargs.setdefault("enable_prefix_caching", False)
    return LLM(ctx.model, **kwargs)


def _random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    low = min(100, vocab // 4)  # not the special tokens at the start of most vocabularies
    return torch.randint(low, vocab, (num, length), generator=gen).tolist()


def _greedy(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from izh import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outputs]


def _release() -> None:
    """Give a dropped engine's memory back (the caller has deleted its last reference)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --- phase 1: environment and copy bandwidth --------------------------------------------------------


def machine_info(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "num_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "device": device,
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["gpu_sms"] = props.multi_processor_count
    else:
        info["gpu"] = None
    return info


def measure_copy_bandwidth(device: str, nbytes: int, iters: int = 10) -> dict[str, float]:
    """A device-to-device copy of `nbytes`: (bytes read + bytes written) / time, best of `iters`."""
    import torch

    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    best = min(times)
    return {"bytes": float(nbytes), "best_s": best, "bandwidth_gb_s": 2 * nbytes / best / 1e9}


def phase_env(ctx: Context, budget: Budget) -> dict[str, Any]:
    bw = measure_copy_bandwidth(ctx.device, ctx.sizes.copy_bytes)
    ctx.copy_bandwidth = bw["bandwidth_gb_s"] * 1e9
    log(f"copy bandwidth {bw['bandwidth_gb_s']:.0f} GB/s (read + write, {ctx.sizes.copy_bytes >> 20} MiB)")
    return {"copy": bw}


# --- phase 2: the Triton kernels ----------------------------------------------------------------------


def check_kernels(
    device: str,
    small: bool,
    budget: Budget | None = None,
    names: list[str] | None = None,
    on_result: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """Every attention case in float32 and bf16, and write_kv_cache in both: a list of result dicts (each
    with `passed`). Under the interpreter (device cpu) bf16 attention is listed as skipped."""
    import torch

    from benchmarks.paged_attention_cases import attention_cases, run_case, run_write_case

    interpreter = device == "cpu"
    results: list[dict[str, Any]] = []
    seed = 0
    for dtype in (torch.float32, torch.bfloat16):
        for case in attention_cases(small):
            if names and case.name not in names:
                continue
            seed += 1
            if budget is not None and budget.expired():
                results.append({"name": case.name, "dtype": str(dtype)[6:], "skipped": "phase budget spent"})
                continue
            if interpreter and dtype == torch.bfloat16:
                results.append(
                    {"name": case.name, "dtype": "bfloat16", "skipped": "interpreter: bf16 tl.dot is wrong"}
                )
                continue
            r = run_case(case, dtype, device, seed)
            results.append(r.as_dict())
            if on_result is not None:
                on_result(results)
            log(
                f"  {'ok  ' if r.passed else 'FAIL'} {r.name:15} {r.dtype:8} rel err {r.rel_error:.2e} "
                f"(torch reference {r.reference_rel_error:.2e}, tolerance {r.tolerance:.0e}) "
                f"{r.seconds:.1f}s {r.detail}"
            )
        w = run_write_case(dtype, device, seed + 100, small)
        results.append(w.as_dict())
        log(f"  {'ok  ' if w.passed else 'FAIL'} write_kv_cache  {w.dtype:8} exact {w.passed} {w.detail}")
    return results


def phase_kernels(ctx: Context, budget: Budget) -> dict[str, Any]:
    names = ctx.args.cases.split(",") if ctx.args.cases else None
    results = check_kernels(
        ctx.device, ctx.sizes.small_kernel_cases, budget, names, lambda r: ctx.checkpoint({"cases": r})
    )
    ran = [r for r in results if "passed" in r]
    return {
        "interpreter": ctx.device == "cpu",
        "passed": bool(ran) and all(r["passed"] for r in ran),
        "num_run": len(ran),
        "num_skipped": len(results) - len(ran),
        "cases": results,
    }


# --- phase 3: greedy parity, device float32 vs CPU float32 -------------------------------------------


def parity_prompts(vocab_size: int, lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    """The SmolLM2 chat prompt the parity tests use (when its ids fit the vocabulary) and random prompts of
    these lengths (the full check's longest spans many KV blocks)."""
    from tests.fixtures.smollm2 import SMOLLM2_CHAT_IDS

    prompts = [list(SMOLLM2_CHAT_IDS)] if max(SMOLLM2_CHAT_IDS) < vocab_size else []
    for i, n in enumerate(lengths):
        prompts += _random_prompts(1, n, vocab_size, seed + i)
    return prompts


def compare_tokens(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """Per prompt: equal, and the first position where the two differ."""
    rows = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        first = next((k for k, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), None)
        if first is None and len(x) != len(y):
            first = min(len(x), len(y))
        rows.append({"prompt": i, "equal": first is None, "first_difference": first, "length": len(x)})
    return {"passed": all(r["equal"] for r in rows), "prompts": rows}


def check_parity(ctx: Context, device_engine: dict[str, Any] | None = None) -> dict[str, Any]:
    """Greedy tokens, float32, of the device engine against a CPU engine."""
    device_llm = _engine(ctx, dtype="float32", quantization="none", **(device_engine or {}))
    prompts = parity_prompts(device_llm.engine_core.vocab_size, ctx.sizes.parity_prompt_lens)
    got = _greedy(device_llm, prompts, ctx.sizes.parity_tokens)
    del device_llm
    _release()
    log(f"  {ctx.device} float32: {len(prompts)} prompts x {ctx.sizes.parity_tokens} tokens")
    cpu_llm = _engine(ctx, dtype="float32", device="cpu", quantization="none")
    want = _greedy(cpu_llm, prompts, ctx.sizes.parity_tokens)
    del cpu_llm
    _release()
    result = compare_tokens(got, want)
    result["compared"] = f"{ctx.device} float32 vs cpu float32"
    if ctx.device == "cpu":
        result["note"] = "dry run: CPU vs CPU, a harness check only (no GPU involved)"
    result["tokens_device"] = got
    result["tokens_cpu"] = want
    return result


def phase_parity(ctx: Context, budget: Budget) -> dict[str, Any]:
    result = check_parity(ctx)
    for row in result["prompts"]:
        log(
            f"  prompt {row['prompt']}: {'equal' if row['equal'] else 'DIFFER at ' + str(row['first_difference'])}"
        )
    if "note" in result:
        log(f"  {result['note']}")
    return result


# --- phase 4: CUDA graphs vs eager -------------------------------------------------------------------


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Every captured decode batch size, and a few padded ones (one inside each of the first buckets and
    one just under the largest)."""
    from izh.engine.cuda_graphs import decode_batch_sizes

    sizes = decode_batch_sizes(max_num_seqs)
    padded = {n - 1 for n in sizes if n > 2 and n - 1 not in sizes}
    extra = sorted(padded)[:3] + ([max_num_seqs - 1] if max_num_seqs - 1 in padded else [])
    return sorted(set(sizes) | set(extra))


def _count_replays(llm: Any) -> dict[int, int]:
    """Wrap the engine's DecodeGraphRunner.run to count replays per padded batch size (instrumentation)."""
    runner = llm.engine_core.runner.graph_runner
    counts: dict[int, int] = {}
    if runner is None:
        return counts
    original = runner.run

    def run(input_ids: Any, positions: Any, meta: Any) -> Any:
        size = next(n for n in runner.batch_sizes if n >= meta.num_seqs)
        counts[size] = counts.get(size, 0) + 1
        return original(input_ids, positions, meta)

    runner.run = run
    return counts


def check_graphs(ctx: Context, budget: Budget | None = None, dtype: str = "float32") -> dict[str, Any]:
    """Greedy tokens with CUDA graphs against eager, per batch size; every captured size must replay."""
    max_num_seqs = ctx.sizes.graph_max_num_seqs
    sizes = graph_batch_sizes(max_num_seqs)
    prompt_len, out_len = ctx.sizes.graph_prompt_len, ctx.sizes.graph_output_len
    common = {
        "dtype": dtype,
        "max_num_seqs": max_num_seqs,
        "max_model_len": 256,
        "max_num_batched_tokens": max(2048, max_num_seqs * (prompt_len + 8)),
    }
    tokens: dict[bool, dict[int, list[list[int]]]] = {}
    replays: dict[int, int] = {}
    captured: list[int] = []
    for eager in (True, False):
        llm = _engine(ctx, enforce_eager=eager, **common)
        runner = llm.engine_core.runner.graph_runner
        if not eager:
            captured = list(runner.batch_sizes) if runner is not None else []
            replays = _count_replays(llm)
        vocab = llm.engine_core.vocab_size
        tokens[eager] = {}
        # Eager runs first and may take half of what is left, so that the graph engine gets its turn.
        stop_at = 5.0 if budget is None or not eager else budget.left() / 2
        for n in sizes:
            if budget is not None and budget.left() < stop_at:
                break
            prompts = [
                _random_prompts(1, prompt_len - (i % 5), vocab, seed=1000 * n + i)[0] for i in range(n)
            ]
            tokens[eager][n] = _greedy(llm, prompts, out_len)
        log(f"  {'eager' if eager else 'graphs'}: {len(tokens[eager])} batch sizes run")
        del llm, runner
        _release()
    rows = []
    for n in sizes:
        if n not in tokens[True] or n not in tokens[False]:
            rows.append({"batch": n, "skipped": "phase budget spent"})
            continue
        cmp = compare_tokens(tokens[False][n], tokens[True][n])
        bad = [r for r in cmp["prompts"] if not r["equal"]]
        rows.append(
            {
                "batch": n,
                "equal": cmp["passed"],
                "sequences_differing": len(bad),
                "first_difference": min((r["first_difference"] for r in bad), default=None),
            }
        )
    ran = [r for r in rows if "equal" in r]
    not_replayed = [n for n in captured if not replays.get(n)]
    result: dict[str, Any] = {
        "dtype": dtype,
        "captured_sizes": captured,
        "replays_per_size": replays,
        "captured_but_not_replayed": not_replayed,
        "batches": rows,
        "passed": bool(ran) and all(r["equal"] for r in ran) and (ctx.device == "cpu" or not not_replayed),
    }
    if ctx.device == "cpu":
        result["note"] = "dry run: no CUDA graphs on a CPU, both engines run eagerly (a harness check only)"
    return result


def phase_graphs(ctx: Context, budget: Budget) -> dict[str, Any]:
    result = check_graphs(ctx, budget)
    bad = [r for r in result["batches"] if r.get("equal") is False]
    log(
        f"  {len(result['batches'])} batch sizes, {len(bad)} differing; captured {len(result['captured_sizes'])}, "
        f"not replayed {result['captured_but_not_replayed']}"
    )
    if "note" in result:
        log(f"  {result['note']}")
    return result


# --- phase 5: decode attention bandwidth -------------------------------------------------------------


def decode_batch(
    seq_lens: list[int], heads: int, kv_heads: int, head_dim: int, dtype: Any, device: str
) -> tuple[Any, ...]:
    """(q, kv_cache, query_start_loc, seq_lens, block_tables) of a decode step, drawn on the device itself
    (a 1 GiB cache built through the CPU would eat the phase's budget); blocks shuffled as in serving."""
    import torch

    block_size = 16
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks, width = sum(blocks), max(blocks)
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, device=device).to(dtype)
    order = torch.randperm(num_blocks, device=device).to(torch.int32)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = order[start : start + n]
        start += n
    q = torch.randn(len(seq_lens), heads, head_dim, device=device).to(dtype)
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, kv_cache, qsl, lens, tables


def phase_attention(ctx: Context, budget: Budget) -> dict[str, Any]:
    import torch

    from izh.kernels.paged_attention import paged_attention

    n, context, iters = ctx.sizes.attention_seqs, ctx.sizes.attention_context, ctx.sizes.attention_iters
    dtype = torch.bfloat16 if ctx.device == "cuda" else torch.float32
    shapes = {"smollm2 9/3x64": (9, 3, 64), "llama-8b 32/8x128": (32, 8, 128)}
    rows = {}
    for name, (heads, kv_heads, head_dim) in shapes.items():
        # Contexts spread around the target so that sequences end in different blocks; their mean is `context`.
        lens = [context - 8 + (i % 17) for i in range(n)]
        q, kv_cache, qsl, seq_lens, tables = decode_batch(lens, heads, kv_heads, head_dim, dtype, ctx.device)
        scale = head_dim**-0.5
        out = torch.empty_like(q)

        attend = functools.partial(
            paged_attention, q, kv_cache, qsl, seq_lens, tables, scale, 1, max(lens), out
        )

        for _ in range(1 if ctx.dry else 3):
            attend()
        _sync(ctx.device)
        times = []
        for _ in range(iters):
            if ctx.device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                attend()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                attend()
                times.append(time.perf_counter() - t0)
        kernel_s = statistics.median(times)
        kv_bytes = 2 * sum(lens) * kv_heads * head_dim * kv_cache.element_size()
        achieved = kv_bytes / kernel_s
        fraction = achieved / ctx.copy_bandwidth if ctx.copy_bandwidth else None
        rows[name] = {
            "num_seqs": n,
            "mean_context": sum(lens) / n,
            "dtype": str(dtype)[6:],
            "kernel_us": kernel_s * 1e6,
            "kv_bytes": kv_bytes,
            "achieved_gb_s": achieved / 1e9,
            "fraction_of_copy": fraction,
        }
        frac = f"{fraction:.0%}" if fraction is not None else "n/a"
        log(f"  {name}: {kernel_s * 1e6:.0f} us, {achieved / 1e9:.0f} GB/s = {frac} of copy")
    result: dict[str, Any] = {"shapes": rows}
    if ctx.device == "cpu":
        result["note"] = "dry run: the Triton interpreter; times are meaningless"
    return result


# --- phase 6: offline engine speed -------------------------------------------------------------------


def model_bytes(model: Any) -> int:
    """Bytes of the weights a decode step reads: every distinct parameter once (a tied lm_head is the
    embedding, read whole for the logits; buffers such as the rotary table are only indexed)."""
    seen, total = set(), 0
    for t in model.parameters():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def bench_level(llm: Any, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """All prompts at once through the engine core, greedy, fixed length; per decode step wall and GPU time."""
    from izh import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    core = llm.engine_core
    for i, p in enumerate(prompts):
        llm._add_request(f"gpu-check-{time.monotonic_ns()}-{i}", p, params)
    step_s: list[float] = []
    forward_s: list[float] = []
    num_out = 0
    start = time.perf_counter()
    while core.has_unfinished_requests():
        t0 = time.perf_counter()
        outputs = core.step()
        dt = time.perf_counter() - t0
        num_out += sum(len(o.new_token_ids) for o in outputs)
        if core.last_step_is_decode:
            step_s.append(dt)
            forward_s.append(core.last_forward_s)
    elapsed = time.perf_counter() - start
    llm._drain_finished()
    step = statistics.mean(step_s) if step_s else float("nan")
    fwd = statistics.mean(forward_s) if forward_s else float("nan")
    return {
        "concurrency": len(prompts),
        "elapsed_s": elapsed,
        "output_tokens": num_out,
        "output_tok_s": num_out / elapsed,
        "decode_steps": len(step_s),
        "decode_step_ms": 1e3 * step,
        "decode_step_p50_ms": 1e3 * statistics.median(step_s) if step_s else float("nan"),
        "decode_forward_ms": 1e3 * fwd,
        "outside_forward_share": 1 - fwd / step if step_s else float("nan"),
    }


def phase_offline(ctx: Context, budget: Budget) -> dict[str, Any]:
    s = ctx.sizes
    llm = _engine(
        ctx,
        max_num_seqs=max(s.levels),
        max_model_len=s.input_len + s.output_len + 16,
        max_num_batched_tokens=max(2048, s.input_len),
    )
    runner = llm.engine_core.runner
    vocab = llm.engine_core.vocab_size
    weights = model_bytes(runner.model)
    kv_per_token = runner.kv_bytes_per_block() / runner.block_size
    bench_level(llm, _random_prompts(2, 16, vocab, 0), 4)  # warm-up: Triton compiles, graphs' first replays
    levels = []
    for n in s.levels:
        if budget.left() < 5:
            levels.append({"concurrency": n, "skipped": "phase budget spent"})
            continue
        row = bench_level(llm, _random_prompts(n, s.input_len, vocab, seed=n), s.output_len)
        # The mean decode step reads the weights and n contexts of about input + output / 2 tokens.
        kv = n * (s.input_len + s.output_len / 2) * kv_per_token
        if ctx.copy_bandwidth:
            floor_ms = 1e3 * (weights + kv) / ctx.copy_bandwidth
            row["floor_ms"] = floor_ms
            row["step_over_floor"] = row["decode_step_ms"] / floor_ms
        row["ms_per_output_token_per_stream"] = row["decode_step_ms"]
        levels.append(row)
        ctx.checkpoint({"weights_bytes": weights, "levels": levels})
        log(
            f"  {n:4} seqs: {row['output_tok_s']:9.0f} tok/s, step {row['decode_step_ms']:.2f} ms "
            f"(forward {row['decode_forward_ms']:.2f} ms, outside {row['outside_forward_share']:.0%}), "
            f"floor {row.get('floor_ms', float('nan')):.3f} ms"
        )
    result = {
        "dtype": str(runner.dtype)[6:],
        "weights_bytes": weights,
        "kv_bytes_per_token": kv_per_token,
        "cuda_graphs": runner.graph_runner is not None,
        "input_len": s.input_len,
        "output_len": s.output_len,
        "levels": levels,
    }
    del llm, runner
    _release()
    return result


# --- phase 7: through the server --------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_ready(url: str, proc: subprocess.Popen[bytes], budget: Budget) -> None:
    while budget.left() > 0:
        if proc.poll() is not None:
            raise RuntimeError(f"izh serve exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise PhaseTimeout(f"{url} did not answer within the phase budget")


def phase_server(ctx: Context, budget: Budget) -> dict[str, Any]:
    s = ctx.sizes
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    serve = [
        sys.executable, "-m", "izh_cli.main", "serve", ctx.model, "--served-model-name", "smollm2",
        "--port", str(port), "--device", ctx.device, "--max-num-seqs", str(max(s.levels)),
        "--max-model-len", str(s.input_len + s.output_len + 64), "--log-level", "warning",
    ]  # fmt: skip
    if ctx.device == "cpu":
        serve += ["--cpu-kernels", "off", "--num-threads", str(ctx.args.cpu_threads)]
    log_path = Path(ctx.args.log_dir) / "gpu_check-serve.log"
    levels: list[dict[str, Any]] = []
    with open(log_path, "wb") as server_log:
        proc = subprocess.Popen(
            serve, stdout=server_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
        try:
            t0 = time.monotonic()
            _wait_ready(f"http://127.0.0.1:{port}/ready", proc, budget)
            log(f"  izh serve ready in {time.monotonic() - t0:.1f} s (port {port})")
            for n in s.levels:
                if budget.left() < 10:
                    levels.append({"concurrency": n, "skipped": "phase budget spent"})
                    continue
                out_json = log_path.with_suffix(f".bench-{n}.json")
                cmd = [
                    sys.executable, "-m", "izh_cli.main", "bench", "--url", f"http://127.0.0.1:{port}/v1",
                    "--model", "smollm2", "--endpoint", "completions", "--concurrency", str(n),
                    "--requests", str(s.server_requests[n]), "--input-len", str(s.input_len),
                    "--output-len", str(s.output_len), "--ignore-eos", "--seed", str(n), "--json",
                    "--out", str(out_json),
                ]  # fmt: skip
                run = subprocess.run(
                    cmd,
                    capture_output=True,
                    text=True,
                    timeout=max(budget.left() - 5, 5),
                    env=env,
                    check=False,
                )
                if run.returncode != 0:
                    levels.append({"concurrency": n, "error": run.stderr[-1500:]})
                    log(f"  {n} streams: izh bench failed ({run.returncode})")
                    continue
                m = json.loads(run.stdout)["runs"][0]["metrics"]
                row = {
                    "concurrency": n,
                    "requests": s.server_requests[n],
                    "output_tok_s": float(m["output_throughput"]),
                    "completed": m["completed"],
                    "failed": m["failed"],
                    "ttft_p50_ms": m.get("median_ttft_ms"),
                    "itl_p50_ms": m.get("median_itl_ms"),
                    "itl_p99_ms": m.get("p99_itl_ms"),
                }
                levels.append(row)
                ctx.checkpoint({"command": serve, "levels": levels})
                log(f"  {n:4} streams: {row['output_tok_s']:9.0f} tok/s, ITL p50 {row['itl_p50_ms']} ms")
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
    return {"command": serve, "server_log": str(log_path), "levels": levels}


# --- targets and the table ---------------------------------------------------------------------------


def _level(phase: dict[str, Any] | None, n: int) -> dict[str, Any] | None:
    if not phase or "levels" not in phase:
        return None
    return next((lv for lv in phase["levels"] if lv.get("concurrency") == n and "output_tok_s" in lv), None)


def evaluate_targets(phases: dict[str, Any], dry: bool) -> list[dict[str, Any]]:
    """(name, measured, target, PASS/FAIL/n/a) for every target; a dry run marks them n/a (CPU numbers)."""
    targets: list[dict[str, Any]] = []

    def add(name: str, value: float | None, target: str, ok: bool | None) -> None:
        verdict = "n/a" if value is None or ok is None else ("PASS" if ok else "FAIL")
        if dry and value is not None:
            verdict = f"n/a (dry run: {'would pass' if ok else 'would fail'})"
        targets.append({"target": name, "measured": value, "goal": target, "verdict": verdict})

    for name in ("kernels", "parity", "graphs"):
        phase = phases.get(name)
        passed = phase.get("passed") if phase else None
        verdict = "n/a" if passed is None else ("PASS" if passed else "FAIL")
        if passed and phase and phase.get("status") != "ok":
            verdict += " (of what ran: the phase did not finish)"
        targets.append(
            {
                "target": f"correctness: {name}",
                "measured": None if phase is None else phase.get("status", "?"),
                "goal": "all equal / within tolerance",
                "verdict": verdict,
            }
        )
    offline = phases.get("offline")
    one = _level(offline, 1)
    add(
        "1 stream, ms per output token",
        one and one["decode_step_ms"],
        f"<= {TARGET_MS_PER_TOKEN_1}",
        one and one["decode_step_ms"] <= TARGET_MS_PER_TOKEN_1,
    )
    top = (
        max(offline["levels"], key=lambda lv: lv.get("concurrency", 0))["concurrency"]
        if offline and offline.get("levels")
        else 256
    )
    many = _level(offline, top)
    add(
        f"{top} streams offline, tok/s",
        many and many["output_tok_s"],
        f">= {TARGET_TOK_S_256:,.0f}",
        many and many["output_tok_s"] >= TARGET_TOK_S_256,
    )
    served = _level(phases.get("server"), top)
    goal = TARGET_SERVER_FRACTION * TARGET_TOK_S_256
    add(
        f"{top} streams via server, tok/s",
        served and served["output_tok_s"],
        f">= {goal:,.0f} (80% of {TARGET_TOK_S_256:,.0f})",
        served and served["output_tok_s"] >= goal,
    )
    attention = (phases.get("attention") or {}).get("shapes", {}).get("smollm2 9/3x64")
    frac = attention and attention.get("fraction_of_copy")
    add("decode attention 256 x 1,024, fraction of copy bw", frac, f">= {TARGET_ATTENTION_FRACTION:.0%}", None if frac is None else frac >= TARGET_ATTENTION_FRACTION)  # fmt: skip
    return targets


def print_table(record: dict[str, Any]) -> None:
    phases = record["phases"]
    print("\nphase        status    seconds", flush=True)
    for name, phase in phases.items():
        print(f"{name:12} {phase.get('status', '?'):9} {phase.get('seconds', 0):7.1f}")
    offline, server = phases.get("offline") or {}, phases.get("server") or {}
    if offline.get("levels"):
        print("\nseqs  offline tok/s  step ms  forward ms  outside  floor ms  step/floor  server tok/s")
        for lv in offline["levels"]:
            if "output_tok_s" not in lv:
                continue
            sv = _level(server, lv["concurrency"])
            print(
                f"{lv['concurrency']:4}  {lv['output_tok_s']:13.0f}  {lv['decode_step_ms']:7.2f}  "
                f"{lv['decode_forward_ms']:10.2f}  {lv['outside_forward_share']:7.0%}  "
                f"{lv.get('floor_ms', float('nan')):8.3f}  {lv.get('step_over_floor', float('nan')):10.1f}  "
                f"{sv['output_tok_s'] if sv else float('nan'):12.0f}"
            )
    print(f"\n{'target':51} {'measured':15} {'goal':27} verdict")
    for t in record["targets"]:
        m = t["measured"]
        shown = f"{m:.3g}" if isinstance(m, float) else str(m)
        print(f"{t['target']:51} {shown:15} {t['goal']:27} {t['verdict']}")
    print(flush=True)


# --- main -------------------------------------------------------------------------------------------

PHASES: dict[str, tuple[Callable[[Context, Budget], dict[str, Any]], float, float]] = {
    # name: (function, budget on the GPU in s, budget of a dry run in s)
    "env": (phase_env, 20, 20),
    "kernels": (phase_kernels, 70, 120),
    "parity": (phase_parity, 45, 90),
    "graphs": (phase_graphs, 60, 90),
    "attention": (phase_attention, 20, 60),
    "offline": (phase_offline, 45, 90),
    "server": (phase_server, 80, 120),
}


def default_model() -> str:
    return next((str(p) for p in CARRIED_MODELS if p.is_file()), "smollm2")


def git_sha() -> str:
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "izh"], cwd=ROOT, capture_output=True, text=True
        )
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") or "unknown"
    except OSError:
        return "unknown"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes (a CPU harness check in ~1-2 minutes)")
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: the carried SmolLM2)")
    ap.add_argument("--phases", default=",".join(PHASES), help=f"comma list of {', '.join(PHASES)}")
    ap.add_argument("--cases", default=None, help="only these attention cases (comma list of names)")
    ap.add_argument("--time-limit", type=float, default=TIME_LIMIT_S, help="seconds for the whole check")
    ap.add_argument("--cpu-threads", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--out", default=None, help="result JSON (default bench_results/gpu_check-<time>.json)")
    ap.add_argument(
        "--git-sha",
        default=None,
        help="the checkout's sha (default: git rev-parse; the device's copy has no .git)",
    )
    ap.add_argument("--log-dir", default="/tmp", help="where the server's log and izh bench's JSONs go")
    args = ap.parse_args(argv)
    unknown = set(args.phases.split(",")) - set(PHASES)
    if unknown:
        ap.error(f"unknown phases {sorted(unknown)}; known: {', '.join(PHASES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        # Before triton is first imported (izh imports it lazily): the kernels run under the interpreter.
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu --dry-run for the harness check", file=sys.stderr)
        return 2
    if args.device == "cpu":
        torch.set_num_threads(args.cpu_threads)
    dry = args.dry_run
    ctx = Context(
        args=args,
        sizes=DRY if dry else FULL,
        device=args.device,
        dry=dry,
        model=args.model or default_model(),
    )
    out = (
        Path(args.out)
        if args.out
        else ROOT / "bench_results" / f"gpu_check-{time.strftime('%Y%m%d-%H%M%S')}.json"
    )
    args.out = str(out)
    record = Record(
        out,
        {
            "benchmark": "gpu_check",
            "git_sha": args.git_sha or git_sha(),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "time": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "dry_run": dry,
            "model": ctx.model,
            "machine": machine_info(args.device),
        },
    )
    log(f"gpu_check on {args.device}{' (dry run)' if dry else ''}: model {ctx.model}, writing {out}")
    failed = False
    for name in args.phases.split(","):
        fn, gpu_budget, dry_budget = PHASES[name]
        left = args.time_limit - log.elapsed()
        budget_s = min(dry_budget if dry else gpu_budget, left)
        if budget_s < 3:
            record.phase(name, {"status": "skipped", "reason": "the check's time limit is spent"})
            log(f"phase {name}: skipped (time limit)")
            continue
        log(f"phase {name}: start (budget {budget_s:.0f} s)")
        ctx.record, ctx.phase = record, name
        budget = Budget(budget_s)
        t0 = time.monotonic()
        try:
            with alarm(budget_s + 10):  # loops stop at the budget; the alarm catches one that hangs past it
                result = fn(ctx, budget)
            result["status"] = "ok" if not budget.expired() else "partial"
        except PhaseTimeout as exc:
            result = {"status": "timeout", "error": str(exc)}
        except Exception as exc:  # one broken phase must not cost the others their numbers
            result = {
                "status": "error",
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
            log(traceback.format_exc())
        result["seconds"] = time.monotonic() - t0
        if result.get("passed") is False or (
            name in ("kernels", "parity", "graphs") and result["status"] == "error"
        ):
            failed = True
        record.phase(name, result)
        log(f"phase {name}: {result['status']} in {result['seconds']:.1f} s")
        if ctx.device == "cuda":
            torch.cuda.empty_cache()
    record.data["targets"] = evaluate_targets(record.data["phases"], dry)
    record.data["elapsed_s"] = log.elapsed()
    record.write()
    log(f"done; wrote {out}")
    print_table(record.data)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
