"""Speculative decoding (n-gram drafts or a draft model) against the same server without it, on a
code-editing or a code-writing workload.

    flock /tmp/izh-bench.lock python benchmarks/spec_decode.py --rounds 2
    flock /tmp/izh-bench.lock python benchmarks/spec_decode.py --model TARGET.gguf --skip-streams \
        --speculative-config '{"method": "draft_model", "model": "DRAFT.gguf", "num_speculative_tokens": 5}' \
        --llama-server ~/.cache/izh-peers/llama-server --llama-draft DRAFT.gguf

Two `izh serve` processes of the same model (the default SmolLM2 GGUF unless --model), one with
`--speculative-config '{"method": "ngram", ...}'`, measured alternately (`--rounds` times) so that a shared
machine's drift hits them alike:
- 1 stream: each prompt holds a Python function (~300 tokens: functions of izh's own source) and asks for
  it back with one identifier renamed; greedy, one request at a time, streamed. Output tok/s is the
  completion tokens over the request's whole time (prefill included), decode tok/s over the time from the
  first token to the last.
- `--streams` streams at once: the same kind of requests (each its own function and rename), all at once;
  output tok/s = all completion tokens over the wall time.
`--workload write` asks for new code instead (`WRITE_PROMPTS`: short coding tasks), where the answer does not
repeat the prompt (a draft model's case, not n-gram lookup's).
`--llama-server BIN` also measures llama.cpp's server on the 1-stream workload, started by hand as
`BIN -m MODEL -md LLAMA_DRAFT --spec-draft-n-max N -t 2` (speculative decoding with the same draft file;
plus `--spec-type draft-simple` where the binary has that flag, without which it loads the draft and never
uses it), alternated with the other two; the command is in the JSON.
Every completion's text is compared between the two servers (greedy: they must be the same).
`--offline` runs the same workload on two in-process engines (no HTTP; wall and process CPU time).
Writes one JSON under bench_results/.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import cast

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import free_port, wait_ok
from benchmarks.offline_throughput import write_record


def _functions() -> list[tuple[str, str, str]]:
    """(source, old name, new name): functions of izh's own source (the first four 290-320 tokens)."""
    from izh.engine import kv_cache, sampler, scheduler, spec_decode
    from izh.frontend import output_processor
    from izh.settings import parse_byte_size

    picks = [
        (parse_byte_size, "match", "found"),
        (spec_decode.verify_random, "accepted", "num_ok"),
        (scheduler.Scheduler._append_and_check_stop, "params", "sp"),
        (output_processor.OutputProcessor._check_stop, "window", "text"),
        (kv_cache.update_block_hashes, "hashes", "chain"),
        (sampler.bad_word_endings, "endings", "banned"),
        (kv_cache.KVCacheManager.free, "blocks", "held"),
        (sampler._fill_token_masks, "banned_rows", "rows_banned"),
    ]
    return [(inspect.getsource(f), old, new) for f, old, new in picks]


WRITE_PROMPTS = [
    "Write a Python function `merge_intervals(intervals)` that merges overlapping [start, end] intervals "
    "and returns them sorted, with a docstring and type hints.",
    "Write a Python class `LRUCache` with `get(key)` and `put(key, value)` in O(1), using an OrderedDict, "
    "with type hints and docstrings.",
    "Write a Python function `parse_duration(text)` that turns strings like '1h30m', '45s' or '2h' into "
    "seconds, raising ValueError on bad input, with a docstring and three doctest examples.",
    "Write a Python function `top_k_words(path, k)` that reads a text file and returns the k most frequent "
    "lowercase words with their counts, ignoring punctuation, with type hints.",
]


def _workload(kind: str) -> list[tuple[str, ...]]:
    """The requests' arguments for `_messages`: (source, old, new) to edit, or (task,) to write."""
    return list(_functions()) if kind == "edit" else [(task,) for task in WRITE_PROMPTS]


def _messages(*work: str) -> list[dict[str, str]]:
    if len(work) == 1:
        return [{"role": "user", "content": work[0] + " Reply with the code only."}]
    source, old, new = work
    return [
        {
            "role": "user",
            "content": f"```python\n{source}```\nRewrite this function with `{old}` renamed to `{new}`. "
            "Reply with the code only.",
        }
    ]


def start_llama_server(
    binary: str, model: str, draft: str, draft_max: int, log: Path, threads: int
) -> tuple[subprocess.Popen, str]:
    """llama.cpp's server with speculative decoding by the draft model `draft` (`threads` threads, as izh's)."""
    port = free_port()
    cmd = [binary, "-m", model, "-md", draft, "--spec-draft-n-max", str(draft_max), "-t", str(threads)]
    # Newer llama-servers load `-md` but draft nothing unless asked: their --spec-type defaults to none.
    if "--spec-type" in subprocess.run([binary, "--help"], capture_output=True, text=True).stdout:
        cmd += ["--spec-type", "draft-simple"]
    cmd += ["-tb", str(threads), "-td", str(threads), "-tbd", str(threads)]
    cmd += ["--port", str(port), "-c", "2048", "--alias", "m"]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_ok(f"{url}/health", proc)
    return proc, url


def start_server(
    model: str, speculative: str | None, cpu_kernels: str, log: Path, kv_bytes: str, threads: int | None
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "izh_cli.main", "serve", model, "--port", str(port)]
    cmd += ["--max-model-len", "2048", "--served-model-name", "m", "--kv-cache-memory-bytes", kv_bytes]
    if threads is not None:
        cmd += ["--num-threads", str(threads)]
    if speculative is not None:
        cmd += ["--speculative-config", speculative]
    env = {**os.environ, "IZH_CPU_KERNELS": cpu_kernels}
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_ok(f"{url}/health", proc)
    return proc, url


async def one_request(client: httpx.AsyncClient, url: str, messages: list, max_tokens: int) -> dict:
    body = {
        "model": "m",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = last = None
    text: list[str] = []
    tokens = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk.get("timings"):  # llama-server's last chunk
                tokens = chunk["timings"].get("predicted_n", tokens)
            for choice in chunk["choices"]:
                content = choice["delta"].get("content")
                if content:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    text.append(content)
    end = time.perf_counter()
    return {
        "text": "".join(text),
        "tokens": tokens,
        "seconds": end - start,
        "decode_seconds": (last - first) if first and last else 0.0,
    }


async def one_stream(url: str, work: list, max_tokens: int) -> dict:
    # A connection per request: llama-server closes a kept-alive connection after a streamed response, and a
    # request sent on it right after fails with "Server disconnected without sending a response".
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        results = [await one_request(client, url, _messages(*w), max_tokens) for w in work]
    tokens = sum(r["tokens"] for r in results)
    return {
        "output_tok_s": tokens / sum(r["seconds"] for r in results),
        "decode_tok_s": statistics.mean(
            (r["tokens"] - 1) / r["decode_seconds"] for r in results if r["decode_seconds"] > 0
        ),
        "tokens": [r["tokens"] for r in results],
        "texts": [r["text"] for r in results],
    }


async def many_streams(url: str, work: list, max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=1800, limits=httpx.Limits(max_connections=len(work))) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, url, _messages(*w), max_tokens) for w in work))
        wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    return {"output_tok_s": tokens / wall, "tokens": tokens, "texts": [r["text"] for r in results]}


def acceptance(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    found: dict[str, float] = {}
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        name = f"izh:spec_decode_{key}_total"
        found[key] = sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{"))
    return found


def offline(args: argparse.Namespace) -> None:
    """The same workload in-process (`--offline`): both engines loaded in one process, no HTTP, each run
    timed in wall and process CPU time (CPU time moves less than wall time on a host shared with other
    work). 1 stream: the first --single functions one at a time; then --streams requests at once."""
    from izh import LLM, SamplingParams
    from izh.config import SpeculativeConfig

    spec_config = SpeculativeConfig(**json.loads(args.speculative_config))
    from izh.settings import parse_byte_size

    common = {
        "max_model_len": 2048,
        "cpu_kernels": args.cpu_kernels,
        "kv_cache_memory_bytes": parse_byte_size(args.kv_cache_memory_bytes),
        "num_threads": args.threads,
    }
    engines = {"base": LLM(args.model, **common), "spec": LLM(args.model, speculative=spec_config, **common)}
    functions = _workload(args.workload)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    runs: dict[str, dict[str, list]] = {name: {"single": [], "streams": []} for name in engines}

    def timed(llm: LLM, conversations: list, max_tokens: int) -> tuple[list[list[int]], float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        outs = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=max_tokens))
        return [o.outputs[0].token_ids for o in outs], time.perf_counter() - wall, time.process_time() - cpu

    for round_index in range(args.rounds):
        order = ["base", "spec"] if round_index % 2 == 0 else ["spec", "base"]
        for name in order:
            tokens, wall, cpu = [], 0.0, 0.0
            for work in functions[: args.single]:
                out, w, c = timed(engines[name], [_messages(*work)], params.max_tokens or 0)
                tokens.append(out[0])
                wall, cpu = wall + w, cpu + c
            n = sum(map(len, tokens))
            runs[name]["single"].append({"tok_s": n / wall, "tok_per_cpu_s": n / cpu, "tokens": tokens})
            print(f"round {round_index} {name} 1 stream: {n / wall:.2f} tok/s ({n / cpu:.2f} per CPU s), {n} tokens",
                  flush=True)  # fmt: skip
        if args.skip_streams:
            continue
        for name in order:
            work = [_messages(*functions[i % len(functions)]) for i in range(args.streams)]
            out, wall, cpu = timed(engines[name], work, args.streams_max_tokens)
            n = sum(map(len, out))
            runs[name]["streams"].append({"tok_s": n / wall, "tok_per_cpu_s": n / cpu, "tokens": out})
            print(f"round {round_index} {name} {args.streams} streams: {n / wall:.2f} tok/s ({n / cpu:.2f} per CPU s)",
                  flush=True)  # fmt: skip
    stats = engines["spec"].engine_core.make_stats()

    def med(kind: str, name: str, key: str) -> float | None:
        values = [r[key] for r in runs[name][kind]]
        return statistics.median(values) if values else None

    fields: dict[str, object] = {
        "mode": "offline",
        "model": args.model,
        "speculative_config": json.loads(args.speculative_config),
        "cpu_kernels": args.cpu_kernels,
        "threads": args.threads,
        "dtype": str(engines["base"].engine_core.dtype),
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "streams_max_tokens": args.streams_max_tokens,
    }
    for kind in ("single", "streams"):
        if not runs["base"][kind]:
            continue
        entry: dict[str, object] = {
            "identical_tokens": all(
                b["tokens"] == s["tokens"]
                for b, s in zip(runs["base"][kind], runs["spec"][kind], strict=True)
            ),
            "runs": {n: [{k: v for k, v in r.items() if k != "tokens"} for r in runs[n][kind]] for n in runs},
            "completion_tokens": [len(t) for t in runs["base"][kind][0]["tokens"]],
        }
        for key in ("tok_s", "tok_per_cpu_s"):
            base_value, spec_value = med(kind, "base", key), med(kind, "spec", key)
            entry[f"base_{key}_median"], entry[f"spec_{key}_median"] = base_value, spec_value
            entry[f"speedup_{key}"] = spec_value / base_value if base_value and spec_value else None
        fields[kind] = entry
    fields["spec_counters"] = {
        "num_drafts": stats.spec_decode_num_drafts,
        "num_draft_tokens": stats.spec_decode_num_draft_tokens,
        "num_accepted_tokens": stats.spec_decode_num_accepted_tokens,
        "num_accepted_tokens_per_pos": stats.spec_decode_num_accepted_tokens_per_pos,
    }
    fields["acceptance_rate"] = stats.spec_decode_num_accepted_tokens / max(
        stats.spec_decode_num_draft_tokens, 1
    )
    fields["load_average_at_end"] = os.getloadavg()
    write_record("spec_decode", fields, args.out)
    print(json.dumps(fields, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=str(Path("~/.cache/izh/models/SmolLM2-135M-Instruct.Q4_1.gguf").expanduser())
    )
    parser.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 5}')
    parser.add_argument("--cpu-kernels", default=os.environ.get("IZH_CPU_KERNELS", "auto"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--single", type=int, default=4, help="requests per round at 1 stream")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--streams-max-tokens", type=int, default=128)
    parser.add_argument("--skip-streams", action="store_true")
    parser.add_argument("--skip-single", action="store_true")
    parser.add_argument(
        "--kv-cache-memory-bytes",
        default="2GiB",
        help="each izh server's KV budget (a draft model's included)",
    )
    parser.add_argument("--workload", choices=["edit", "write"], default="edit")
    parser.add_argument("--llama-server", default=None, help="also measure this llama-server binary")
    parser.add_argument("--llama-draft", default=None, help="llama-server's -md draft model file")
    parser.add_argument("--llama-draft-max", type=int, default=5, help="llama-server's --spec-draft-n-max")
    parser.add_argument("--offline", action="store_true", help="in-process engines, no HTTP servers")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="izh's CPU threads (and llama-server's -t); default: izh's own",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.offline:
        offline(args)
        return

    functions = _workload(args.workload)
    single_work = functions[: args.single]
    many_work = [functions[i % len(functions)] for i in range(args.streams)]
    logs = Path(tempfile.mkdtemp(prefix="izh-spec-bench-"))
    servers = {
        "base": start_server(
            args.model, None, args.cpu_kernels, logs / "base.log", args.kv_cache_memory_bytes, args.threads
        ),
        "spec": start_server(
            args.model,
            args.speculative_config,
            args.cpu_kernels,
            logs / "spec.log",
            args.kv_cache_memory_bytes,
            args.threads,
        ),
    }
    if args.llama_server:
        servers["llama"] = start_llama_server(
            args.llama_server,
            args.model,
            args.llama_draft,
            args.llama_draft_max,
            logs / "llama.log",
            args.threads or 2,
        )
    runs: dict[str, dict[str, list]] = {name: {"single": [], "streams": []} for name in servers}
    try:
        for round_index in range(args.rounds):
            order = ["base", "spec"] if round_index % 2 == 0 else ["spec", "base"]
            for name in [*order, "llama"] if "llama" in servers else order:
                if args.skip_single:
                    break
                result = asyncio.run(one_stream(servers[name][1], single_work, args.max_tokens))
                runs[name]["single"].append(result)
                print(f"round {round_index} {name} 1 stream: {result['output_tok_s']:.1f} out tok/s, "
                      f"{result['decode_tok_s']:.1f} decode tok/s", flush=True)  # fmt: skip
            if args.skip_streams:
                continue
            for name in order:
                result = asyncio.run(many_streams(servers[name][1], many_work, args.streams_max_tokens))
                runs[name]["streams"].append(result)
                print(f"round {round_index} {name} {args.streams} streams: {result['output_tok_s']:.1f} tok/s",
                      flush=True)  # fmt: skip
        spec_counters = acceptance(servers["spec"][1])
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)

    def summary(kind: str, key: str) -> dict[str, float]:
        values = {name: [r[key] for r in runs[name][kind]] for name in runs}
        out = {f"{name}_{key}_median": statistics.median(v) for name, v in values.items() if v}
        if values["base"]:
            out["speedup"] = out[f"spec_{key}_median"] / out[f"base_{key}_median"]
        if values.get("llama"):
            out["spec_over_llama"] = out[f"spec_{key}_median"] / out[f"llama_{key}_median"]
        return out

    identical_single = all(
        b["texts"] == s["texts"] for b, s in zip(runs["base"]["single"], runs["spec"]["single"], strict=True)
    )
    identical_streams = all(
        b["texts"] == s["texts"]
        for b, s in zip(runs["base"]["streams"], runs["spec"]["streams"], strict=True)
    )
    fields = {
        "model": args.model,
        "speculative_config": json.loads(args.speculative_config),
        "cpu_kernels": args.cpu_kernels,
        "threads": args.threads,
        "workload": args.workload,
        "max_tokens": args.max_tokens,
        "llama_server": (
            {
                "binary": args.llama_server,
                "draft": args.llama_draft,
                "spec_draft_n_max": args.llama_draft_max,
                "command": [str(arg) for arg in cast("list[str]", servers["llama"][0].args)],
            }
            if args.llama_server
            else None
        ),
        "rounds": args.rounds,
        "single": {}
        if args.skip_single
        else {
            **summary("single", "output_tok_s"),
            "decode": summary("single", "decode_tok_s"),
            "identical_text": identical_single,
            "completion_tokens": runs["base"]["single"][0]["tokens"],
            "runs": {
                n: [{k: v for k, v in r.items() if k != "texts"} for r in runs[n]["single"]] for n in runs
            },
        },
        "streams": {
            "n": args.streams,
            **(summary("streams", "output_tok_s") if runs["base"]["streams"] else {}),
            "identical_text": identical_streams,
            "runs": {n: [r["output_tok_s"] for r in runs[n]["streams"]] for n in runs},
        },
        "spec_counters": spec_counters,
        "acceptance_rate": spec_counters["num_accepted_tokens"] / max(spec_counters["num_draft_tokens"], 1),
        "load_average_at_end": os.getloadavg(),
    }
    write_record("spec_decode", fields, args.out)
    print(json.dumps({k: v for k, v in fields.items() if k not in ("single", "streams")}, indent=1))
    print(json.dumps({k: v for k, v in fields["single"].items() if k != "runs"}, indent=1))
    print(json.dumps({k: v for k, v in fields["streams"].items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
