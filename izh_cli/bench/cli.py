"""`izh bench`: stream requests at a server and report TTFT, TPOT, ITL, E2E latency and throughput
(or, with `--endpoint embeddings`, requests/s and input tokens/s of /v1/embeddings, and with `--endpoint
rerank` of /v1/rerank: izh_cli.bench.embeddings). `--endpoint messages` streams Anthropic's /v1/messages.

Only Typer, the stdlib and izh_cli._common at import time (``izh bench --help`` is instant); httpx, Rich
and the benchmark modules are imported inside the command.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import math
import signal
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer

from izh_cli._common import EXIT_USAGE, fail
from izh_cli.http import DEFAULT_URL, ApiKeyOption, ModelOption, UrlOption

if TYPE_CHECKING:
    import httpx

    from izh_cli.bench.datasets import DatasetSpec, Sample, ServerTokenizer
    from izh_cli.bench.runner import RunConfig, RunOutcome
    from izh_cli.http import ServerUrls

EXIT_INTERRUPTED = 130
PROGRESS_INTERVAL_S = 0.25
_PANEL_LOAD = "Load"
_PANEL_DATA = "Dataset"
_PANEL_OUT = "Output"


class BenchError(Exception):
    """A failure the user can act on: one line and a hint."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint


@dataclass(frozen=True, slots=True)
class BenchOptions:
    url: str
    model: str | None
    api_key: str | None
    endpoint: Literal["chat", "completions", "messages", "embeddings", "rerank"]
    levels: tuple[int, ...]
    requests: int | None
    duration_s: float | None
    request_rate: float
    burstiness: float
    spec: DatasetSpec
    ignore_eos: bool
    temperature: float
    slo: dict[str, float]
    timeout_s: float
    batch_size: int = 1
    """Inputs per /v1/embeddings request (documents per /v1/rerank request)."""

    def requests_for(self, concurrency: int) -> int | None:
        """Requests per level: --requests, else none with --duration, else 4 × concurrency (at least 32)."""
        if self.requests is not None or self.duration_s is not None:
            return self.requests
        return max(32, 4 * concurrency)

    def pool_size(self) -> int:
        """How many distinct samples to build (they are cycled when a run sends more)."""
        counts = [self.requests_for(level) for level in self.levels]
        if all(count is not None for count in counts):
            return max(count for count in counts if count is not None)
        return min(max(64, 4 * max(self.levels)), 1024)


def parse_levels(text: str) -> tuple[int, ...]:
    """``8`` or ``1,8,32,256`` → concurrency levels; raises ValueError."""
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"--concurrency takes integers separated by commas, not {text!r}") from None
    if not levels or min(levels) < 1:
        raise ValueError("--concurrency needs values of at least 1")
    return levels


def bench(
    url: UrlOption = DEFAULT_URL,
    model: ModelOption = None,
    api_key: ApiKeyOption = None,
    endpoint: Annotated[
        Literal["chat", "completions", "messages", "embeddings", "rerank"],
        typer.Option(
            "--endpoint",
            help="/v1/chat/completions, /v1/completions, /v1/messages (Anthropic's, streamed), or "
            "/v1/embeddings and /v1/rerank (requests/s and input tokens/s).",
        ),
    ] = "completions",
    batch_size: Annotated[
        int,
        typer.Option(
            "--batch-size",
            min=1,
            help="Inputs per request (--endpoint embeddings; documents per query with rerank).",
            rich_help_panel=_PANEL_LOAD,
        ),
    ] = 1,
    concurrency: Annotated[
        str,
        typer.Option(
            "--concurrency",
            "-c",
            help="Most requests in flight; a comma list (1,8,32,256) runs a sweep.",
            rich_help_panel=_PANEL_LOAD,
        ),
    ] = "1",
    requests: Annotated[
        int | None,
        typer.Option(
            "--requests",
            "-n",
            min=1,
            help="Requests per level (default: 4 × concurrency, at least 32).",
            show_default=False,
            rich_help_panel=_PANEL_LOAD,
        ),
    ] = None,
    duration: Annotated[
        float | None,
        typer.Option(
            "--duration",
            min=0.001,
            help="Seconds per level to keep sending (instead of --requests).",
            show_default=False,
            rich_help_panel=_PANEL_LOAD,
        ),
    ] = None,
    request_rate: Annotated[
        float,
        typer.Option(
            "--request-rate",
            min=0.0,
            help="Arrivals per second (Poisson); inf sends at once.",
            rich_help_panel=_PANEL_LOAD,
        ),
    ] = math.inf,
    burstiness: Annotated[
        float,
        typer.Option(
            "--burstiness",
            min=0.0,
            help="Gamma shape of the arrival gaps: 1 Poisson, <1 burstier, >1 steadier.",
            rich_help_panel=_PANEL_LOAD,
        ),
    ] = 1.0,
    dataset: Annotated[
        str,
        typer.Option(
            "--dataset",
            "-d",
            help="random, prefix, FILE.jsonl ({prompt|messages, output_tokens?}) or a ShareGPT .json.",
            rich_help_panel=_PANEL_DATA,
        ),
    ] = "random",
    input_len: Annotated[
        int, typer.Option("--input-len", help="Prompt tokens (random, prefix).", rich_help_panel=_PANEL_DATA)
    ] = 1024,
    output_len: Annotated[
        int | None,
        typer.Option(
            "--output-len",
            help="Tokens to generate (default: 128; ShareGPT: the reply's length).",
            show_default=False,
            rich_help_panel=_PANEL_DATA,
        ),
    ] = None,
    range_ratio: Annotated[
        float,
        typer.Option(
            "--range-ratio", help="Lengths uniform in len × [1-r, 1+r].", rich_help_panel=_PANEL_DATA
        ),
    ] = 0.0,
    prefix_len: Annotated[
        int,
        typer.Option(
            "--prefix-len",
            help="Shared prefix tokens before each prompt (random, prefix).",
            rich_help_panel=_PANEL_DATA,
        ),
    ] = 0,
    num_prefixes: Annotated[
        int,
        typer.Option(
            "--num-prefixes", help="Distinct shared prefixes (prefix dataset).", rich_help_panel=_PANEL_DATA
        ),
    ] = 4,
    ignore_eos: Annotated[
        bool,
        typer.Option(
            "--ignore-eos",
            help="Generate exactly the output length (vLLM's ignore_eos).",
            rich_help_panel=_PANEL_DATA,
        ),
    ] = False,
    seed: Annotated[
        int, typer.Option("--seed", help="Seed of the prompts and the arrivals.", rich_help_panel=_PANEL_DATA)
    ] = 0,
    temperature: Annotated[float, typer.Option("--temperature", help="Sampling temperature.")] = 0.0,
    slo: Annotated[
        str | None,
        typer.Option(
            "--slo",
            help="Goodput SLOs, e.g. ttft=500ms,tpot=50ms,e2e=2s.",
            show_default=False,
            rich_help_panel=_PANEL_OUT,
        ),
    ] = None,
    timeout: Annotated[
        float, typer.Option("--timeout", min=0.001, help="Seconds before one request is abandoned.")
    ] = 600.0,
    json_output: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print the result as JSON (without raw timings) instead of tables.",
            rich_help_panel=_PANEL_OUT,
        ),
    ] = False,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            help="Result file or folder (default: bench_results/).",
            show_default=False,
            rich_help_panel=_PANEL_OUT,
        ),
    ] = None,
    plot: Annotated[
        bool,
        typer.Option(
            "--plot",
            help="Also write a PNG (latency, throughput vs concurrency) next to the result.",
            rich_help_panel=_PANEL_OUT,
        ),
    ] = False,
    compare_with: Annotated[
        Path | None,
        typer.Option(
            "--compare",
            help="An earlier result JSON to print the deltas against.",
            show_default=False,
            rich_help_panel=_PANEL_OUT,
        ),
    ] = None,
) -> None:
    """Benchmark a running server: stream requests and report TTFT, TPOT, ITL, E2E latency and throughput.

    Same definitions and labels as `vllm bench serve`. Saves a JSON result (command, server, git sha,
    machine, raw timings) under bench_results/; Ctrl-C stops and reports what was measured.
    """
    from izh_cli.bench.datasets import DatasetSpec

    spec = DatasetSpec(dataset, input_len, output_len, range_ratio, prefix_len, num_prefixes, seed)
    options = _validated(
        url=url, model=model, api_key=api_key, endpoint=endpoint, concurrency=concurrency, requests=requests,
        duration=duration, request_rate=request_rate, burstiness=burstiness, spec=spec, ignore_eos=ignore_eos,
        temperature=temperature, slo=slo, timeout=timeout, batch_size=batch_size,
    )  # fmt: skip
    if endpoint in ("embeddings", "rerank"):
        if plot or compare_with is not None or slo is not None or duration is not None:
            fail(
                f"--plot, --compare, --slo and --duration apply to generation, not --endpoint {endpoint}",
                "see `izh bench --help`.",
                EXIT_USAGE,
            )
        try:
            document = asyncio.run(_bench_embeddings(options))
        except BenchError as exc:
            fail(exc.message, exc.hint)
        _output_embeddings(document, out=out, json_output=json_output)
        if document["interrupted"]:
            raise typer.Exit(EXIT_INTERRUPTED)
        return
    old = _load_compare(compare_with)
    if plot and importlib.util.find_spec("matplotlib") is None:
        fail("--plot needs matplotlib, which is not installed", "pip install matplotlib", EXIT_USAGE)
    try:
        document = asyncio.run(_bench(options))
    except BenchError as exc:
        fail(exc.message, exc.hint)
    _output(document, out=out, json_output=json_output, plot=plot, old=old, old_path=compare_with)
    if document["interrupted"]:
        raise typer.Exit(EXIT_INTERRUPTED)


def _validated(*, concurrency: str, slo: str | None, spec: DatasetSpec, **values: Any) -> BenchOptions:
    """BenchOptions from the flags; a bad combination exits with status 2."""
    from izh_cli.bench.metrics import parse_slo
    from izh_cli.http import resolve_urls

    try:
        resolve_urls(values["url"])
        levels = parse_levels(concurrency)
        slo_ms = parse_slo(slo)
        spec.validate()
        if values["requests"] is not None and values["duration"] is not None:
            raise ValueError("--requests and --duration exclude each other")
        if values["request_rate"] <= 0 or values["burstiness"] <= 0:
            raise ValueError("--request-rate and --burstiness must be positive")
        if values["batch_size"] != 1 and values["endpoint"] not in ("embeddings", "rerank"):
            raise ValueError("--batch-size applies to --endpoint embeddings and rerank only")
        if values["ignore_eos"] and values["endpoint"] == "messages":
            raise ValueError("--ignore-eos is not part of Anthropic's Messages API (--endpoint messages)")
    except ValueError as exc:
        fail(str(exc), "see `izh bench --help`.", EXIT_USAGE)
    duration = values.pop("duration")
    timeout = values.pop("timeout")
    return BenchOptions(
        levels=levels, slo=slo_ms, spec=spec, duration_s=duration, timeout_s=timeout, **values
    )


def _load_compare(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    from izh_cli.bench.report import load_document

    try:
        return load_document(path)
    except ValueError as exc:
        fail(str(exc), "--compare takes a JSON result written by `izh bench`.", EXIT_USAGE)


# --- the benchmark ------------------------------------------------------------------------------------


async def _bench(options: BenchOptions) -> dict[str, Any]:
    """Discover the server, build the prompts, run every level; the result document."""
    import httpx

    from izh_cli.bench.runner import make_clients
    from izh_cli.http import auth_headers, resolve_urls

    urls = resolve_urls(options.url)
    timeout = httpx.Timeout(options.timeout_s, connect=min(options.timeout_s, 10.0))
    clients = make_clients(max(options.levels), headers=auth_headers(options.api_key), timeout=timeout)
    async with contextlib.AsyncExitStack() as stack:
        for client in clients:
            await stack.enter_async_context(client)
        server = await _server_info(clients[0], urls)
        model = options.model or _first_model(server)
        server["model"] = model
        base = _run_config(options, model, urls)
        tokenizer, samples = await _prepare(clients[0], urls, model, options)
        probe = await _probe(clients[0], base)
        runs, interrupted = await _run_levels(clients, base, options, samples, tokenizer)
    from izh_cli.bench.report import result_document

    config = _config_dict(options, tokenizer is not None)
    document = result_document(server=server, config=config, runs=runs, interrupted=interrupted)
    document["probe"] = probe
    return document


async def _bench_embeddings(options: BenchOptions) -> dict[str, Any]:
    """The embeddings benchmark: the same discovery and dataset as generation, then each level."""
    import httpx

    from izh_cli.bench import embeddings
    from izh_cli.bench.report import result_document
    from izh_cli.bench.runner import make_clients
    from izh_cli.http import auth_headers, resolve_urls

    urls = resolve_urls(options.url)
    rerank = options.endpoint == "rerank"
    url = f"{urls.api}/rerank" if rerank else f"{urls.api}/embeddings"
    timeout = httpx.Timeout(options.timeout_s, connect=min(options.timeout_s, 10.0))
    clients = make_clients(max(options.levels), headers=auth_headers(options.api_key), timeout=timeout)
    runs: list[dict[str, Any]] = []
    interrupted = False
    async with contextlib.AsyncExitStack() as stack:
        for client in clients:
            await stack.enter_async_context(client)
        server = await _server_info(clients[0], urls)
        model = options.model or _first_model(server)
        server["model"] = model
        tokenizer, samples = await _prepare(clients[0], urls, model, options)
        probe, _, _ = await embeddings.run_level(
            clients[:1], url, model, samples[:1], concurrency=1, num_requests=1, batch_size=1, rerank=rerank
        )
        if probe[0].error is not None:
            raise BenchError(
                f"a test request to {url} failed: {probe[0].error}",
                "check --model and --api-key; the server must serve "
                + ("rerank (an embedding model)." if rerank else "embeddings (llama-server: --embeddings)."),
            )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        handler_installed = _install_sigint(loop, stop)
        try:
            for level in options.levels:
                num_requests = options.requests_for(level)
                assert num_requests is not None  # --duration is refused for embeddings
                from izh_cli._common import stderr_console

                with stderr_console().status(f"concurrency {level}: {num_requests} requests..."):
                    records, duration_s, interrupted = await embeddings.run_level(
                        clients, url, model, samples, concurrency=level, num_requests=num_requests,
                        batch_size=options.batch_size, stop=stop, rerank=rerank,
                    )  # fmt: skip
                runs.append(embeddings.run_entry(level, options.batch_size, records, duration_s, interrupted))
                if interrupted:
                    break
        finally:
            if handler_installed:
                loop.remove_signal_handler(signal.SIGINT)
    config = _config_dict(options, tokenizer is not None)
    config["batch_size"] = options.batch_size
    return result_document(server=server, config=config, runs=runs, interrupted=interrupted)


def _output_embeddings(document: dict[str, Any], *, out: Path | None, json_output: bool) -> None:
    import json

    from rich.console import Console

    from izh_cli._common import stderr_console
    from izh_cli.bench import embeddings
    from izh_cli.bench.report import errors_table, save_document, summary_document

    path = save_document(document, out)
    if json_output:
        summary = summary_document(document)
        summary["result_path"] = str(path)
        typer.echo(json.dumps(summary, indent=1))
        return
    console = Console()
    console.print(embeddings.table(document["runs"]))
    for run in document["runs"]:
        if run["errors"]:
            console.print(errors_table(run["errors"], f"Errors at concurrency {run['concurrency']}"))
    stderr_console().print(f"[dim]Result: {path}[/]")


async def _server_info(client: httpx.AsyncClient, urls: Any) -> dict[str, Any]:
    import httpx

    from izh_cli.http import ServerError, exception_kind

    try:
        info = await fetch_server_info(client, urls)
    except httpx.HTTPError as exc:
        raise BenchError(
            f"cannot reach {urls.root}: {exception_kind(exc)}",
            "is the server running? Start one with `izh serve`, or pass --url.",
        ) from exc
    except (ServerError, ValueError) as exc:
        raise BenchError(f"{urls.api}/models: {exc}", "check --url and --api-key (or IZH_API_KEY).") from exc
    return info


def version_from(payload: Any) -> str | None:
    if isinstance(payload, dict) and payload.get("version") is not None:
        return str(payload["version"])
    return None


async def fetch_server_info(client: httpx.AsyncClient, urls: ServerUrls) -> dict[str, Any]:
    """The result's server block: /v1/models (raises on failure: nothing can run without it) and /version
    (optional)."""
    import httpx

    from izh_cli.http import ServerError, error_message, http_error_kind, model_ids

    response = await client.get(f"{urls.api}/models")
    if response.status_code != 200:
        raise ServerError(
            http_error_kind(response.status_code, error_message(response.content, response.reason_phrase))
        )
    models_payload = response.json()
    version: str | None = None
    try:
        version_response = await client.get(f"{urls.root}/version")
        if version_response.status_code == 200:
            version = version_from(version_response.json())
    except (httpx.HTTPError, ValueError):
        version = None
    return {
        "url": urls.root,
        "models": model_ids(models_payload),
        "version": version,
    }


def _first_model(server: dict[str, Any]) -> str:
    if not server["models"]:
        raise BenchError("the server lists no models at /v1/models", "pass --model.")
    return str(server["models"][0])


def _run_config(options: BenchOptions, model: str, urls: Any) -> RunConfig:
    from izh_cli.bench.runner import RunConfig

    endpoint: Literal["chat", "completions", "messages"] = (
        "messages"
        if options.endpoint == "messages"
        else "chat"
        if options.endpoint == "chat"
        else "completions"
    )
    url = {"chat": urls.chat, "completions": urls.completions, "messages": f"{urls.api}/messages"}[endpoint]
    return RunConfig(
        url=url,
        endpoint=endpoint,
        model=model,
        concurrency=options.levels[0],
        duration_s=options.duration_s,
        request_rate=options.request_rate,
        burstiness=options.burstiness,
        ignore_eos=options.ignore_eos,
        temperature=options.temperature,
        seed=options.spec.seed,
    )


async def _prepare(
    client: httpx.AsyncClient, urls: Any, model: str, options: BenchOptions
) -> tuple[ServerTokenizer | None, list[Sample]]:
    """The server's tokenizer (when it has one) and the prompts, fitted to their token lengths."""
    import httpx

    from izh_cli._common import stderr_console
    from izh_cli.bench.datasets import ServerTokenizer, build_samples

    tokenizer = await ServerTokenizer.probe(client, urls, model)
    if tokenizer is None:
        stderr_console().print(
            "[dim]No /tokenize on the server: prompt lengths are estimates; usage gives the real ones.[/]"
        )
    with stderr_console().status(f"Building {options.pool_size()} prompts ({options.spec.name})..."):
        try:
            return tokenizer, await build_samples(options.spec, options.pool_size(), tokenizer)
        except (ValueError, OSError) as exc:
            raise BenchError(str(exc), "see `izh bench --help` for the dataset formats.") from exc
        except httpx.HTTPError as exc:
            raise BenchError(
                f"tokenizing the prompts failed: {exc}", "retry, or check the server's /tokenize."
            ) from exc


async def _probe(client: httpx.AsyncClient, base: RunConfig) -> dict[str, Any]:
    """One short request first, so that a wrong model or endpoint fails once, clearly, not N times.

    A reply without text (a model that ends at once) is fine here: the server took the request. Returns
    its token counts, kept in the result so that the server's counters (which include it) reconcile.
    """
    from izh_cli.bench.datasets import Sample
    from izh_cli.bench.runner import NO_TOKENS, Runner

    config = replace(
        base, concurrency=1, num_requests=1, duration_s=None, request_rate=math.inf, ignore_eos=False
    )
    outcome = await Runner(client, config, [Sample("Hello, who are you?", 4, 6)]).run()
    record = outcome.records[0]
    if record.error not in (None, NO_TOKENS):
        raise BenchError(
            f"a test request to {base.url} failed: {record.error}", "check --model, --endpoint and --api-key."
        )
    return {"requests": 1, "prompt_tokens": record.prompt_tokens, "output_tokens": record.output_tokens}


async def _run_levels(
    clients: list[httpx.AsyncClient],
    base: RunConfig,
    options: BenchOptions,
    samples: list[Sample],
    tokenizer: ServerTokenizer | None,
) -> tuple[list[dict[str, Any]], bool]:
    """Each concurrency level in turn; Ctrl-C stops the current one and skips the rest."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    handler_installed = _install_sigint(loop, stop)
    runs: list[dict[str, Any]] = []
    try:
        for level in options.levels:
            config = replace(base, concurrency=level, num_requests=options.requests_for(level))
            outcome = await _run_with_progress(clients, config, samples, stop)
            source = await count_missing_tokens(outcome, tokenizer)
            runs.append(_run_entry(outcome, options, source))
            if outcome.interrupted:
                return runs, True
    finally:
        if handler_installed:
            loop.remove_signal_handler(signal.SIGINT)
    return runs, False


def _install_sigint(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> bool:
    try:
        loop.add_signal_handler(signal.SIGINT, stop.set)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no signals here
        return False
    return True


async def _run_with_progress(
    clients: list[httpx.AsyncClient], config: RunConfig, samples: list[Sample], stop: asyncio.Event
) -> RunOutcome:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from izh_cli._common import stderr_console
    from izh_cli.bench.runner import Runner

    runner = Runner(clients, config, samples)
    progress = Progress(
        TextColumn(f"[bold]concurrency {config.concurrency}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("[red]{task.fields[errors]} errors"),
        TextColumn("{task.fields[rate]} tok/s"),
        TimeElapsedColumn(),
        console=stderr_console(),
        refresh_per_second=4,
    )
    task_id = progress.add_task("bench", total=config.num_requests, errors=0, rate="-")
    window: deque[tuple[float, int]] = deque(maxlen=12)  # ~3 s of samples at 4 per second

    async def update() -> None:
        while True:
            counters = runner.counters
            window.append((time.perf_counter(), counters.chunks))
            (t0, c0), (t1, c1) = window[0], window[-1]
            rate = f"{(c1 - c0) / (t1 - t0):,.0f}" if t1 > t0 else "-"
            progress.update(task_id, completed=counters.done, errors=counters.errors, rate=rate)
            await asyncio.sleep(PROGRESS_INTERVAL_S)

    with progress:
        updater = asyncio.create_task(update())
        try:
            outcome = await runner.run(stop)
        finally:
            updater.cancel()
        progress.update(task_id, completed=runner.counters.done, errors=runner.counters.errors)
    return outcome


async def count_missing_tokens(outcome: RunOutcome, tokenizer: ServerTokenizer | None) -> str:
    """Fill output token counts the server's usage did not give: /tokenize, else one token per chunk.

    Returns where the counts came from: ``usage``, ``tokenize`` or ``chunks``.
    """
    import httpx

    missing = [r for r in outcome.records if r.ok and r.output_tokens is None]
    if not missing:
        return "usage"
    source = "tokenize" if tokenizer is not None else "chunks"
    for record in missing:
        text = outcome.texts.get(record.index, "")
        if tokenizer is not None:
            try:
                record.output_tokens = await tokenizer.count(text)
                continue
            except httpx.HTTPError:
                source = "chunks"
        record.output_tokens = record.num_chunks
    return source


def _run_entry(outcome: RunOutcome, options: BenchOptions, token_source: str) -> dict[str, Any]:
    from izh_cli.bench.metrics import compute_metrics, error_summary
    from izh_cli.bench.report import run_entry

    metrics = compute_metrics(outcome.records, outcome.duration_s, options.slo)
    records = [record.to_dict() for record in outcome.records]
    entry = run_entry(
        outcome.config.concurrency, options.request_rate, metrics, error_summary(outcome.records), records
    )
    entry["output_tokens_from"] = token_source
    entry["interrupted"] = outcome.interrupted
    entry["retried_stale_connections"] = outcome.retried
    return entry


def _config_dict(options: BenchOptions, has_tokenizer: bool) -> dict[str, Any]:
    spec = options.spec
    return {
        "endpoint": options.endpoint,
        "concurrency": list(options.levels),
        "requests": options.requests,
        "duration_s": options.duration_s,
        "request_rate": None if math.isinf(options.request_rate) else options.request_rate,
        "burstiness": options.burstiness,
        "dataset": spec.name,
        "input_len": spec.input_len,
        "output_len": spec.output_len,
        "range_ratio": spec.range_ratio,
        "prefix_len": spec.prefix_len,
        "num_prefixes": spec.num_prefixes,
        "ignore_eos": options.ignore_eos,
        "temperature": options.temperature,
        "seed": spec.seed,
        "slo_ms": options.slo,
        "prompt_lengths": "server /tokenize" if has_tokenizer else "estimated (no /tokenize)",
    }


# --- output -------------------------------------------------------------------------------------------


def _output(
    document: dict[str, Any],
    *,
    out: Path | None,
    json_output: bool,
    plot: bool,
    old: dict[str, Any] | None,
    old_path: Path | None,
) -> None:
    import json

    from rich.console import Console

    from izh_cli._common import stderr_console
    from izh_cli.bench.report import (
        compare,
        compare_table,
        plot_sweep,
        print_report,
        save_document,
        summary_document,
    )

    path = save_document(document, out)
    plot_path = plot_sweep(document, path.with_suffix(".png")) if plot else None
    deltas = compare(old, document) if old is not None else []
    if json_output:
        summary = summary_document(document)
        summary["result_path"] = str(path)
        summary["plot_path"] = str(plot_path) if plot_path else None
        if old is not None:
            summary["compare"] = {"old": str(old_path), "deltas": [d.to_dict() for d in deltas]}
        typer.echo(json.dumps(summary, indent=1))
        return
    console = Console()
    print_report(console, document)
    if old is not None:
        if deltas:
            console.print(compare_table(deltas, str(old_path)))
        else:
            console.print(f"[yellow]{old_path} has no level with the same concurrency and request rate.[/]")
    notes = stderr_console()
    notes.print(f"[dim]Result: {path}[/]")
    if plot_path:
        notes.print(f"[dim]Plot: {plot_path}[/]")
