"""izh serve's /v1/embeddings against sentence-transformers' offline encode() on the same model, texts
and machine, runs alternated.

    python benchmarks/embeddings_vs_st.py --rounds 3 --num-texts 1024 --concurrency 32

The model defaults to the registry's all-minilm-l6-v2 (pulled into the cache first; any
sentence-transformers folder works). `izh serve` runs on a loopback port and is sent every text once
per round as concurrent OpenAI /v1/embeddings requests (`--concurrency` in flight,
`--inputs-per-request` texts each, base64 as the openai SDK asks, through izh bench's own client);
sentence-transformers encodes the same texts in this process with `encode(batch_size=32)`. The two
never run at once: each round runs both, the order flipped every round, and the server sits idle while
sentence-transformers runs. Reported: texts/s and input tokens/s of each (median over rounds), their
ratio, and the smallest cosine similarity between izh's and sentence-transformers' vectors. A third
runner, izh offline (`izh.LLM.embed` in this process, the same engine without HTTP), separates the
engine's speed from the serving's. With `--llama-server BIN --llama-gguf FILE` (the same model
converted by llama.cpp's convert_hf_to_gguf.py, f32), llama.cpp's `llama-server --embeddings` is a
fourth runner, sent the same requests as izh serve. One JSON goes under bench_results/ (machine, CPU
model and flags, commands, every round).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import free_port, wait_ok  # noqa: E402
from izh_cli.bench.report import cpu_model_and_flags  # noqa: E402

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "her",
    "they",
    "this",
    "are",
    "be",
    "an",
    "which",
    "or",
    "have",
    "one",
    "had",
    "not",
    "but",
    "what",
    "all",
    "were",
    "when",
    "we",
    "there",
    "can",
    "been",
    "has",
    "more",
    "if",
    "will",
    "would",
    "who",
    "so",
    "no",
    "out",
    "up",
    "into",
    "time",
    "about",
    "than",
    "them",
    "some",
    "could",
    "only",
    "other",
    "its",
    "then",
    "two",
    "first",
    "new",
    "like",
    "these",
    "any",
    "may",
    "people",
    "over",
    "such",
    "after",
    "most",
    "very",
    "made",
    "where",
    "through",
    "back",
    "years",
    "much",
    "before",
    "good",
    "great",
    "well",
    "year",
    "between",
    "under",
    "model",
    "server",
    "request",
    "token",
    "embedding",
    "vector",
    "search",
    "query",
    "document",
    "sentence",
    "language",
    "memory",
    "engine",
    "batch",
    "cache",
    "prefix",
    "attention",
    "layer",
    "matrix",
    "kernel",
    "thread",
    "latency",
    "throughput",
    "benchmark",
    "machine",
]


def _texts(count: int, seed: int) -> list[str]:
    """Sentences of 6 to 60 words (about 8 to 70 tokens), deterministic."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 60))]
        texts.append(" ".join(words).capitalize() + ".")
    return texts


def _sha() -> str:
    run = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    return run.stdout.strip()


async def _izh_round(
    url: str,
    texts: list[str],
    concurrency: int,
    per_request: int,
    model: str = "model",
    encoding_format: str = "base64",
) -> dict[str, Any]:
    import httpx

    from izh_cli.bench import embeddings
    from izh_cli.bench.datasets import Sample
    from izh_cli.bench.runner import make_clients

    samples = [Sample(prompt=t, output_len=0, prompt_len=0) for t in texts]
    num_requests = -(-len(texts) // per_request)
    clients = make_clients(concurrency, headers={}, timeout=httpx.Timeout(600.0))
    try:
        records, duration_s, _ = await embeddings.run_level(
            clients, f"{url}/v1/embeddings", model, samples, concurrency=concurrency,
            num_requests=num_requests, batch_size=per_request, encoding_format=encoding_format,
        )  # fmt: skip
    finally:
        for client in clients:
            await client.aclose()
    failed = [r.error for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} izh requests failed, e.g. {failed[0]}")
    m = embeddings.metrics(records, duration_s)
    return {
        "seconds": duration_s,
        "texts_per_s": m["input_throughput"] * len(texts) / (num_requests * per_request),
        "tokens_per_s": m["input_token_throughput"],
        "tokens": m["total_input_tokens"],
    }


def _st_round(model: Any, texts: list[str], tokens: int) -> dict[str, Any]:
    start = time.perf_counter()
    model.encode(texts, batch_size=32)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "texts_per_s": len(texts) / seconds, "tokens_per_s": tokens / seconds}


def _offline_round(llm: Any, texts: list[str], tokens: int) -> dict[str, Any]:
    start = time.perf_counter()
    llm.embed(texts)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "texts_per_s": len(texts) / seconds, "tokens_per_s": tokens / seconds}


def _izh_vectors(url: str, texts: list[str]) -> np.ndarray:
    import httpx

    reply = httpx.post(f"{url}/v1/embeddings", json={"input": texts, "encoding_format": "float"}, timeout=600)
    reply.raise_for_status()
    return np.asarray([d["embedding"] for d in reply.json()["data"]])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="all-minilm-l6-v2", help="a registry name or a sentence-transformers folder"
    )
    parser.add_argument("--num-texts", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32, help="izh requests in flight")
    parser.add_argument("--inputs-per-request", type=int, default=1, help="texts per izh request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--izh-arg", action="append", default=[], help="extra `izh serve` argument")
    parser.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary (optional)")
    parser.add_argument("--llama-gguf", default=None, help="the model as a GGUF, for --llama-server")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if bool(args.llama_server) != bool(args.llama_gguf):
        parser.error("--llama-server and --llama-gguf go together")

    from izh.hub import default_cache_dir, resolve_model

    folder = str(resolve_model(args.model, default_cache_dir()))
    texts = _texts(args.num_texts, args.seed)
    izh = shutil.which("izh") or str(Path(sys.executable).with_name("izh"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    izh_cmd = [izh, "serve", folder, "--served-model-name", "model", "--port", str(port), "--log-level", "warning", *args.izh_arg]  # fmt: skip
    st_command = f"SentenceTransformer({folder!r}, device='cpu').encode(texts, batch_size=32)"

    import torch
    from sentence_transformers import SentenceTransformer

    from izh import LLM

    st = SentenceTransformer(folder, device="cpu")
    offline = LLM(folder, device="cpu")
    offline.embed(texts[:64])
    tokens = sum(
        len(st.tokenizer(t, truncation=True, max_length=st.max_seq_length)["input_ids"]) for t in texts
    )
    log = open(f"/tmp/embeddings_vs_st-{port}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(izh_cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    runners = ["izh", "sentence-transformers", "izh-offline"]
    llama_cmd: list[str] | None = None
    llama: subprocess.Popen[bytes] | None = None
    llama_url = ""
    if args.llama_server:
        llama_port = free_port()
        llama_url = f"http://127.0.0.1:{llama_port}"
        threads = str(os.cpu_count() or 1)
        llama_cmd = [
            args.llama_server, "-m", args.llama_gguf, "--host", "127.0.0.1", "--port", str(llama_port),
            "--embeddings", "--pooling", "mean", "-np", str(args.concurrency), "-c",
            str(512 * args.concurrency), "-b", "8192", "-ub", "8192", "-t", threads, "-tb", threads,
            "--no-webui",
        ]  # fmt: skip
        llama_log = open(f"/tmp/embeddings_vs_st-llama-{llama_port}.log", "wb")  # noqa: SIM115
        llama = subprocess.Popen(
            llama_cmd, stdout=llama_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        runners.append("llama.cpp")
    rounds: list[dict[str, Any]] = []
    try:
        wait_ok(f"{url}/ready", proc)
        if llama is not None:
            wait_ok(f"{llama_url}/health", llama)
        # Warm both up (first-call allocations, kernel choices) and check they agree.
        want = st.encode(texts[:64], batch_size=32)
        got = _izh_vectors(url, texts[:64])
        cosines = (got * want).sum(axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
        min_cosine = float(cosines.min())
        for r in range(args.rounds):
            for name in runners if r % 2 == 0 else runners[::-1]:
                if name == "izh":
                    result = asyncio.run(_izh_round(url, texts, args.concurrency, args.inputs_per_request))
                elif name == "llama.cpp":
                    result = asyncio.run(
                        _izh_round(
                            llama_url,
                            texts,
                            args.concurrency,
                            args.inputs_per_request,
                            encoding_format="float",
                        )
                    )
                elif name == "izh-offline":
                    result = _offline_round(offline, texts, tokens)
                else:
                    result = _st_round(st, texts, tokens)
                rounds.append({"round": r, "runner": name, **result})
                print(json.dumps(rounds[-1]), flush=True)
    finally:
        for server in (proc, llama):
            if server is None:
                continue
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()

    summary: dict[str, Any] = {}
    for name in runners:
        mine = [x for x in rounds if x["runner"] == name]
        summary[name] = {
            "texts_per_s": statistics.median(x["texts_per_s"] for x in mine),
            "tokens_per_s": statistics.median(x["tokens_per_s"] for x in mine),
        }
    summary["ratio_izh_to_st"] = (
        summary["izh"]["texts_per_s"] / summary["sentence-transformers"]["texts_per_s"]
    )
    summary["min_cosine_izh_vs_st"] = min_cosine
    model, flags = cpu_model_and_flags()
    result = {
        "benchmark": "embeddings_vs_st",
        "git_sha": _sha(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
        "machine": {
            "platform": platform.platform(),
            "cores": os.cpu_count(),
            "cpu": {"model": model, "flags": " ".join(flags)},
            "torch_threads": torch.get_num_threads(),
        },
        "model": folder,
        "izh_command": izh_cmd,
        "llama_command": llama_cmd,
        "st_command": st_command,
        "texts": {"count": len(texts), "seed": args.seed, "tokens": tokens},
        "izh_load": {"concurrency": args.concurrency, "inputs_per_request": args.inputs_per_request},
        "summary": summary,
        "rounds": rounds,
    }
    out = Path(args.out or f"bench_results/embeddings_vs_st-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}\n")
    print(f"{'runner':24} {'texts/s':>10} {'tokens/s':>10}")
    for name in runners:
        print(f"{name:24} {summary[name]['texts_per_s']:10.1f} {summary[name]['tokens_per_s']:10.1f}")
    print(f"izh / sentence-transformers: {summary['ratio_izh_to_st']:.2f}; min cosine {min_cosine:.6f}")


if __name__ == "__main__":
    main()
