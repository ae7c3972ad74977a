"""Resident memory of izh's engine and of llama.cpp's llama-server on the same GGUF file.

    python benchmarks/gguf_rss_vs_llamacpp.py --model FILE.gguf --llama-server PATH/llama-server

izh: a child process loads `LLM(FILE, dtype=float32, kv_cache_memory_bytes=512 MiB, max_model_len=4096)`, generates 8 tokens, and reports its
RSS and the KV pool's bytes (the issue's target: RSS minus the KV pool <= the file's size + 400 MB).
llama-server: started on a free loopback port with one slot and a 4,096-token context (2 threads), one
8-token completion, then its RSS from /proc. Memory does not depend on the machine's load, so this needs
no quiet host; one JSON under bench_results/.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from izh_cli.bench.report import cpu_model_and_flags

_CHILD = r"""
import json, sys
from izh import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype=sys.argv[2], kv_cache_memory_bytes=512 << 20, max_model_len=4096)
llm.generate(["def reverse(xs):"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
with open("/proc/self/status") as f:
    rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024
print(json.dumps({"rss_bytes": rss, "kv_cache_bytes": sum(c.nbytes for c in llm.engine_core.runner.kv_caches)}))
"""


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _llama_server(binary: str, model: str) -> dict[str, int]:
    port = _free_port()
    args = [
        binary,
        "-m",
        model,
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "-t",
        "2",
        "-c",
        "4096",
        "-np",
        "1",
    ]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        body = json.dumps({"prompt": "def reverse(xs):", "n_predict": 8, "temperature": 0}).encode()
        request = urllib.request.Request(f"{url}/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as r:
            r.read()
        return {"rss_bytes": _rss(proc.pid)}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", required=True)
    parser.add_argument("--llama-server", default=None)
    parser.add_argument("--dtype", default="float32", help="izh's dtype (float32: the GGUF block kernels)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    run = subprocess.run(
        [sys.executable, "-c", _CHILD, args.model, args.dtype], capture_output=True, text=True, check=False
    )
    if run.returncode != 0:
        sys.exit(f"izh failed:\n{run.stderr[-3000:]}")
    izh = json.loads(run.stdout.strip().splitlines()[-1])
    file_bytes = os.path.getsize(args.model)
    izh["rss_minus_kv_bytes"] = izh["rss_bytes"] - izh["kv_cache_bytes"]
    izh["target_bytes"] = file_bytes + 400_000_000
    results = {"izh": izh}
    if args.llama_server:
        results["llama_server"] = _llama_server(args.llama_server, args.model)
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    cpu, flags = cpu_model_and_flags()
    document = {
        "command": " ".join(sys.argv),
        "git_sha": sha.stdout.strip(),
        "cpu": cpu,
        "cpu_flags": flags,
        "model": args.model,
        "file_bytes": file_bytes,
        "results": results,
    }
    out = Path(args.out or f"bench_results/gguf_rss-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n")
    print(json.dumps(document, indent=2))


if __name__ == "__main__":
    main()
