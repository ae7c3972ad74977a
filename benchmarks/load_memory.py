"""Peak and settled memory of the offline engine for several settings, each in a fresh process.

    python benchmarks/load_memory.py --model smollm2 --case default --case "quantization=none"

For each case a child process loads `LLM(model, **case)`, generates a few tokens, and reports its peak
RSS (ru_maxrss: load, packing and one generate together) and its RSS afterwards, with the same 512 MB KV
cache in every case. One JSON goes under bench_results/ (machine, CPU, command) and a table is printed.
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

from izh_cli.bench.report import cpu_model_and_flags

_CHILD = r"""
import json, resource, sys
from izh import LLM, SamplingParams
kwargs = json.loads(sys.argv[2])
llm = LLM(model=sys.argv[1], kv_cache_memory_bytes=512 << 20, **kwargs)
llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
runner = llm.engine_core.runner
with open("/proc/self/status") as f:
    rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024
print(json.dumps({
    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "rss_after_bytes": rss,
    "kv_cache_bytes": sum(c.nbytes for c in runner.kv_caches),
    "dtype": str(runner.dtype).removeprefix("torch."),
    "quantization": runner.quantization,
}))
"""


def _parse_case(text: str) -> dict[str, object]:
    if text == "default":
        return {}
    case: dict[str, object] = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        case[key.strip()] = value.strip()
    return case


def _cpu() -> str:
    return cpu_model_and_flags()[0]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--case", action="append", default=[], help='"default" or "key=value,key=value"')
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cases = args.case or ["default", "quantization=none"]
    results = []
    for text in cases:
        run = subprocess.run(
            [sys.executable, "-c", _CHILD, args.model, json.dumps(_parse_case(text))],
            capture_output=True,
            text=True,
            check=False,
        )
        if run.returncode != 0:
            raise SystemExit(f"case {text!r} failed:\n{run.stderr[-3000:]}")
        results.append({"case": text, **json.loads(run.stdout.strip().splitlines()[-1])})
        print(json.dumps(results[-1]), flush=True)
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    document = {
        "benchmark": "load_memory",
        "git_sha": sha.stdout.strip(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
        "machine": {"platform": platform.platform(), "cores": os.cpu_count(), "cpu": _cpu()},
        "results": results,
    }
    out = Path(args.out or f"bench_results/load_memory-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2) + "\n")
    print(f"\nwrote {out}\n\n{'case':28} {'dtype':9} {'packing':8} {'peak RSS':>10} {'RSS after':>10}")
    for r in results:
        print(
            f"{r['case']:28} {r['dtype']:9} {r['quantization']:8} {r['peak_rss_bytes'] / 2**20:8.0f} MB "
            f"{r['rss_after_bytes'] / 2**20:8.0f} MB"
        )


if __name__ == "__main__":
    main()
