"""Benchmark output: the result document (JSON), Rich tables, the sweep plot and the comparison with an
earlier result."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from izh_cli.bench.metrics import LATENCY_METRICS, PERCENTILES, BenchMetrics, percentile_label

SCHEMA = "izh.bench/1"
LATENCY_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}
# (key in a run's metrics, label, higher is better)
COMPARED = (
    ("request_throughput", "Request throughput (req/s)", True),
    ("request_goodput", "Request goodput (req/s)", True),
    ("output_throughput", "Output token throughput (tok/s)", True),
    ("total_token_throughput", "Total token throughput (tok/s)", True),
    ("median_ttft_ms", "Median TTFT (ms)", False),
    ("p99_ttft_ms", "P99 TTFT (ms)", False),
    ("median_tpot_ms", "Median TPOT (ms)", False),
    ("p99_tpot_ms", "P99 TPOT (ms)", False),
    ("median_itl_ms", "Median ITL (ms)", False),
    ("p99_itl_ms", "P99 ITL (ms)", False),
    ("median_e2el_ms", "Median E2EL (ms)", False),
    ("p99_e2el_ms", "P99 E2EL (ms)", False),
    ("failed", "Failed requests", False),
)


# --- the result document ------------------------------------------------------------------------------


def git_sha(cwd: Path | None = None) -> str | None:
    """The checkout's commit (with ``-dirty`` when it has changes), or None outside a git checkout."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{sha}-dirty" if dirty else sha


def cpu_model_and_flags() -> tuple[str, list[str]]:
    """The CPU's model name and feature flags, from the first processor of /proc/cpuinfo (x86 `flags`,
    ARM `Features`); the platform's processor name and no flags where there is no such file."""
    model: str = ""
    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key in ("flags", "Features") and not flags:
                flags = value.split()
    except OSError:
        pass
    return model or platform.processor(), flags


def machine_info() -> dict[str, Any]:
    model, flags = cpu_model_and_flags()
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "cpu_flags": flags,
    }


def run_entry(
    concurrency: int,
    request_rate: float,
    metrics: BenchMetrics,
    errors: dict[str, int],
    records: list[dict[str, Any]],
) -> dict[str, Any]:
    """One level of the result: its load, metrics (vLLM's keys), errors by kind and raw per-request timings."""
    return {
        "concurrency": concurrency,
        "request_rate": None if request_rate == float("inf") else request_rate,
        "metrics": metrics.to_dict(),
        "errors": errors,
        "requests": records,
    }


def command_line() -> str:
    """How this benchmark was started, with shell quoting (``izh bench ...`` from the console script)."""
    argv = ["izh", *sys.argv[1:]] if Path(sys.argv[0]).name == "izh" else sys.argv
    return shlex.join(argv)


def result_document(
    *, server: dict[str, Any], config: dict[str, Any], runs: list[dict[str, Any]], interrupted: bool
) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": command_line(),
        "git_sha": git_sha(),
        "machine": machine_info(),
        "server": server,
        "config": config,
        "interrupted": interrupted,
        "runs": runs,
    }


def save_document(document: dict[str, Any], out: Path | None) -> Path:
    """Write the result under ``bench_results/`` (or ``out``: a file, or a folder to write into)."""
    if out is None or out.is_dir() or out.suffix != ".json":
        folder = out if out is not None else Path("bench_results")
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime())
        out = folder / f"bench-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    return out


def summary_document(document: dict[str, Any]) -> dict[str, Any]:
    """The document without raw per-request timings (what ``--json`` prints)."""
    runs = [{k: v for k, v in run.items() if k != "requests"} for run in document["runs"]]
    return {**document, "runs": runs}


def load_document(path: Path) -> dict[str, Any]:
    """A saved result; raises ValueError when the file is not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        raise ValueError(f"{path} is not an izh bench result (no runs)")
    return data


# --- tables -------------------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:,.{digits}f}"


def run_table(run: dict[str, Any], title: str = "Serving Benchmark Result") -> Table:
    """One level in `vllm bench serve`'s layout and labels."""
    m = run["metrics"]
    table = Table(title=title, show_header=False, title_justify="left", box=None, padding=(0, 2))
    table.add_column("metric", style="bold")
    table.add_column("value", justify="right")
    rate = run.get("request_rate")
    rows: list[tuple[str, Any]] = [
        ("Successful requests", m["completed"]),
        ("Failed requests", m["failed"]),
        ("Maximum request concurrency", run["concurrency"]),
        ("Request rate configured (RPS)", "inf" if rate is None else _fmt(rate)),
        ("Benchmark duration (s)", m["duration"]),
        ("Total input tokens", m["total_input_tokens"]),
        ("Total generated tokens", m["total_output_tokens"]),
        ("Request throughput (req/s)", m["request_throughput"]),
    ]
    if m.get("request_goodput") is not None:
        rows.append(("Request goodput (req/s)", m["request_goodput"]))
    rows += [
        ("Output token throughput (tok/s)", m["output_throughput"]),
        ("Peak output token throughput (tok/s)", m["max_output_tokens_per_s"]),
        ("Peak concurrent requests", m["max_concurrent_requests"]),
        ("Total token throughput (tok/s)", m["total_token_throughput"]),
    ]
    for label, value in rows:
        table.add_row(label, value if isinstance(value, str) else _fmt(value))
    for name in LATENCY_METRICS:
        table.add_row(f"[dim]{LATENCY_TITLES[name]}[/]", "")
        upper = name.upper()
        table.add_row(f"  Mean {upper} (ms)", _fmt(m.get(f"mean_{name}_ms")))
        table.add_row(f"  Median {upper} (ms)", _fmt(m.get(f"median_{name}_ms")))
        for p in PERCENTILES:
            table.add_row(f"  P{p:g} {upper} (ms)", _fmt(m.get(f"{percentile_label(p)}_{name}_ms")))
    return table


def sweep_table(runs: list[dict[str, Any]]) -> Table:
    """One row per level: the numbers that move with concurrency."""
    table = Table(title="Sweep", title_justify="left")
    for header in (
        "conc",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "TPOT p99",
        "ITL p99",
        "E2EL p50",
        "ok",
        "err",
    ):
        table.add_column(header, justify="right")
    for run in runs:
        m = run["metrics"]
        table.add_row(
            str(run["concurrency"]),
            _fmt(m["request_throughput"]),
            _fmt(m["output_throughput"], 1),
            _fmt(m["median_ttft_ms"], 1),
            _fmt(m["p99_ttft_ms"], 1),
            _fmt(m["median_tpot_ms"], 1),
            _fmt(m["p99_tpot_ms"], 1),
            _fmt(m["p99_itl_ms"], 1),
            _fmt(m["median_e2el_ms"], 1),
            str(m["completed"]),
            f"[red]{m['failed']}[/]" if m["failed"] else "0",
        )
    return table


def errors_table(errors: dict[str, int], title: str = "Errors by kind") -> Table:
    table = Table(title=title, title_justify="left", title_style="bold red")
    table.add_column("count", justify="right", style="red")
    table.add_column("kind")
    for kind, count in errors.items():
        table.add_row(str(count), Text(kind))  # server messages may hold [brackets]: never markup
    return table


def print_report(console: Console, document: dict[str, Any]) -> None:
    runs = document["runs"]
    if document.get("interrupted"):
        console.print("[yellow]Interrupted: the results below cover what was measured so far.[/]")
    console.print(run_table(runs[0]) if len(runs) == 1 else sweep_table(runs))
    for run in runs:
        if run["errors"]:
            suffix = f" (concurrency {run['concurrency']})" if len(runs) > 1 else ""
            console.print(errors_table(run["errors"], f"Errors by kind{suffix}"))


# --- compare ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Delta:
    concurrency: int
    metric: str
    label: str
    old: float
    new: float
    higher_is_better: bool

    @property
    def delta(self) -> float:
        return self.new - self.old

    @property
    def delta_pct(self) -> float | None:
        return None if self.old == 0 else 100.0 * self.delta / abs(self.old)

    @property
    def better(self) -> bool | None:
        if self.delta == 0:
            return None
        return (self.delta > 0) == self.higher_is_better

    def to_dict(self) -> dict[str, Any]:
        return {
            "concurrency": self.concurrency,
            "metric": self.metric,
            "old": self.old,
            "new": self.new,
            "delta": self.delta,
            "delta_pct": self.delta_pct,
            "better": self.better,
        }


def _run_key(run: dict[str, Any]) -> tuple[int, float | None]:
    return int(run["concurrency"]), run.get("request_rate")


def compare(old: dict[str, Any], new: dict[str, Any]) -> list[Delta]:
    """Deltas of the headline metrics for every level present in both results (same concurrency and rate).

    When each result has exactly one level, those two are compared whatever their load.
    """
    old_runs = {_run_key(run): run for run in old["runs"]}
    pairs = [(old_runs[_run_key(run)], run) for run in new["runs"] if _run_key(run) in old_runs]
    if not pairs and len(old["runs"]) == 1 and len(new["runs"]) == 1:
        pairs = [(old["runs"][0], new["runs"][0])]
    deltas: list[Delta] = []
    for old_run, new_run in pairs:
        for key, label, higher in COMPARED:
            before, after = old_run["metrics"].get(key), new_run["metrics"].get(key)
            if isinstance(before, int | float) and isinstance(after, int | float):
                deltas.append(
                    Delta(int(new_run["concurrency"]), key, label, float(before), float(after), higher)
                )
    return deltas


def compare_table(deltas: list[Delta], old_name: str) -> Table:
    table = Table(title=f"Compared with {old_name}", title_justify="left")
    for header, justify in (
        ("conc", "right"),
        ("metric", "left"),
        ("old", "right"),
        ("new", "right"),
        ("delta", "right"),
    ):
        table.add_column(header, justify=justify)  # type: ignore[arg-type]
    for d in deltas:
        style = {True: "green", False: "red", None: "dim"}[d.better]
        pct = "" if d.delta_pct is None else f" ({d.delta_pct:+.1f}%)"
        table.add_row(
            str(d.concurrency), d.label, _fmt(d.old), _fmt(d.new), f"[{style}]{d.delta:+,.2f}{pct}[/]"
        )
    return table


# --- plot ---------------------------------------------------------------------------------------------


def plot_sweep(document: dict[str, Any], path: Path) -> Path:
    """A PNG of latency percentiles and throughput against concurrency (needs matplotlib).

    Raises ImportError when matplotlib is missing.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted(document["runs"], key=lambda run: run["concurrency"])
    x = [run["concurrency"] for run in runs]
    fig, (latency_ax, throughput_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat, style in (("median", "-o"), ("p99", "--x")):
            y = [run["metrics"].get(f"{stat}_{name}_ms", 0.0) for run in runs]
            latency_ax.plot(x, y, style, label=f"{name.upper()} {stat}")
    latency_ax.set(xlabel="concurrency", ylabel="ms", title="Latency", xscale="log", yscale="log")
    latency_ax.legend(fontsize="small", ncol=2)
    throughput_ax.plot(x, [run["metrics"]["output_throughput"] for run in runs], "-o", label="output tok/s")
    throughput_ax.plot(
        x, [run["metrics"]["total_token_throughput"] for run in runs], "-o", label="total tok/s"
    )
    throughput_ax.set(xlabel="concurrency", ylabel="tokens/s", title="Throughput", xscale="log")
    requests_ax = throughput_ax.twinx()
    requests_ax.plot(
        x, [run["metrics"]["request_throughput"] for run in runs], ":s", color="gray", label="req/s"
    )
    requests_ax.set_ylabel("requests/s")
    throughput_ax.legend(loc="upper left", fontsize="small")
    server = document.get("server", {})
    fig.suptitle(f"izh bench: {server.get('model', '')} @ {server.get('url', '')}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
