"""`izh inspect`: a live terminal dashboard of a server, fed by /metrics, /health and izh's stats endpoint.

Works on izh, vLLM, SGLang and llama.cpp (see izh_cli.inspect_metrics for the adapters). The three
endpoints are asked at once, each with its own timeout: one that is slow or fails leaves a note (and its
path in ``Snapshot.timed_out``) and the others still show; a server that answers none of them shows as
down and is retried every interval. Heavy imports (httpx, Rich) inside the command.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Annotated

import typer

from izh_cli.http import DEFAULT_URL, ApiKeyOption, UrlOption

if TYPE_CHECKING:
    import httpx
    from rich.console import RenderableType

    from izh_cli.http import ServerUrls
    from izh_cli.inspect_metrics import Adapter, Scrape, Snapshot

STATS_PATH = "/v1/izh/stats"
HEALTH_PATH, METRICS_PATH = "/health", "/metrics"
MAP_WIDTH = 64
MAP_ROWS = 8
KV_WARN, KV_CRIT = 0.65, 0.85  # vllm-htop's colours: green, yellow, red
BLOCK_STYLES = {2: ("█", "magenta"), 1: ("▓", "cyan"), 0: ("·", "green")}
METRICS_HINT = "metrics are off: llama.cpp needs --metrics, SGLang --enable-metrics"


def inspect(
    url: UrlOption = DEFAULT_URL,
    api_key: ApiKeyOption = None,
    interval: Annotated[
        float, typer.Option("--interval", "-i", min=0.01, help="Seconds between scrapes.")
    ] = 2.0,
    once: Annotated[
        bool, typer.Option("--once", help="Scrape twice, one interval apart, print one snapshot and exit.")
    ] = False,
    json_output: Annotated[
        bool, typer.Option("--json", help="Print snapshots as JSON (one per line).")
    ] = False,
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout",
            min=0.01,
            help="Seconds each endpoint may take (they are asked at once); default: 2 x the interval, "
            "at least 2.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Watch a server: KV cache and block map, queue, throughput, TTFT/ITL percentiles, finish reasons.

    Reads /metrics (izh, vLLM, SGLang or llama.cpp names), /health and, on izh, /v1/izh/stats, all at
    once; an endpoint that times out is noted and the rest still shown.
    """
    import httpx

    from izh_cli._common import EXIT_USAGE, fail
    from izh_cli.http import auth_headers, resolve_urls

    try:
        urls = resolve_urls(url)
    except ValueError as exc:
        fail(str(exc), "pass --url http://HOST:PORT", EXIT_USAGE)
    read_s = timeout if timeout is not None else max(interval, 1.0) * 2
    limits = httpx.Timeout(read_s, connect=min(read_s, max(interval, 1.0), 5.0))
    with httpx.Client(headers=auth_headers(api_key), timeout=limits, verify=urls.verify_tls) as client:
        inspector = Inspector(client, urls)
        if once:
            _once(inspector, interval, json_output)
        else:
            _watch(inspector, interval, json_output)


class Inspector:
    """Scrapes one server; keeps the previous scrape for rates and windowed quantiles."""

    def __init__(self, client: httpx.Client, urls: ServerUrls) -> None:
        self.client = client
        self.urls = urls
        self.previous: Scrape | None = None
        self.adapter: Adapter | None = None
        self.has_stats: bool | None = None  # None: not asked yet
        self.up_since: float | None = None

    def poll(self) -> Snapshot:
        """One snapshot; never raises for a server that is down, slow or answers nonsense."""
        from izh_cli.http import exception_kind
        from izh_cli.inspect_metrics import Snapshot

        answers = self._fetch()
        if all(isinstance(a, Exception) for a in answers.values()):
            self.previous = None  # a restarted server starts its counters again
            self.up_since = None
            error = exception_kind(answers[HEALTH_PATH])  # type: ignore[arg-type]
            return Snapshot(url=self.urls.root, up=False, error=error)
        snap = self._snapshot(answers)
        now = time.monotonic()
        self.up_since = self.up_since if self.up_since is not None else now
        snap.seen_up_s = now - self.up_since
        return snap

    def _fetch(self) -> dict[str, httpx.Response | Exception]:
        """GET the endpoints concurrently (each under the client's own timeout): path -> answer or error."""
        import httpx

        paths = [HEALTH_PATH, METRICS_PATH] + ([STATS_PATH] if self.has_stats is not False else [])

        def get(path: str) -> httpx.Response | Exception:
            try:
                return self.client.get(f"{self.urls.root}{path}")
            except httpx.HTTPError as exc:
                return exc

        with ThreadPoolExecutor(max_workers=len(paths), thread_name_prefix="izh-inspect") as pool:
            return dict(zip(paths, pool.map(get, paths), strict=True))

    def _snapshot(self, answers: dict[str, httpx.Response | Exception]) -> Snapshot:
        import httpx

        from izh_cli.http import exception_kind

        health = answers[HEALTH_PATH]
        snap = self._metrics_snapshot(answers[METRICS_PATH])
        snap.health = (
            ("ok" if health.status_code == 200 else f"HTTP {health.status_code}")
            if not isinstance(health, Exception)
            else exception_kind(health)
        )
        if STATS_PATH in answers:
            self._add_stats(snap, answers[STATS_PATH])
        for path, answer in answers.items():
            if isinstance(answer, Exception):
                if isinstance(answer, httpx.TimeoutException):
                    snap.timed_out.append(path)
                snap.notes.append(f"GET {path} failed: {exception_kind(answer)}; showing the rest")
        return snap

    def _metrics_snapshot(self, response: httpx.Response | Exception) -> Snapshot:
        from izh_cli.inspect_metrics import (
            Scrape,
            Snapshot,
            build_snapshot,
            detect_adapter,
            uptime_from_metrics,
        )

        if isinstance(response, Exception):
            return Snapshot(url=self.urls.root, up=True)
        taken = time.monotonic()
        if response.status_code != 200:
            snap = Snapshot(url=self.urls.root, up=True)
            snap.notes.append(f"/metrics answered HTTP {response.status_code}: {METRICS_HINT}")
            return snap
        scrape = Scrape.from_text(response.text, taken)
        self.adapter = detect_adapter(scrape) or self.adapter
        if self.adapter is None:
            snap = Snapshot(url=self.urls.root, up=True)
            snap.notes.append("/metrics has no izh, vLLM, SGLang or llama.cpp metric names")
        else:
            snap = build_snapshot(self.urls.root, self.adapter, scrape, self.previous)
            snap.uptime_s = uptime_from_metrics(scrape, time.time())
        self.previous = scrape
        return snap

    def _add_stats(self, snap: Snapshot, response: httpx.Response | Exception) -> None:
        """izh's engine detail; asked once on other servers, then no more after a 404."""
        from izh_cli.inspect_metrics import apply_izh_stats

        if isinstance(response, Exception):
            return
        if response.status_code in (404, 405, 501):
            self.has_stats = False
            return
        try:
            stats = response.json() if response.status_code == 200 else None
        except ValueError:
            stats = None
        if isinstance(stats, dict):
            self.has_stats = True
            apply_izh_stats(snap, stats)
            if snap.server is None:
                snap.server = "izh"


def _once(inspector: Inspector, interval: float, json_output: bool) -> None:
    snap = inspector.poll()
    if snap.up:
        time.sleep(interval)  # a second scrape gives rates and the windowed percentiles
        snap = inspector.poll()
    if json_output:
        typer.echo(json.dumps(snap.to_dict()))
    else:
        from rich.console import Console

        Console().print(render(snap, interval))
    if not snap.up:
        raise typer.Exit(1)


def _watch(inspector: Inspector, interval: float, json_output: bool) -> None:
    """Until Ctrl-C: a Rich Live dashboard, or one JSON line per scrape."""
    from rich.console import Console
    from rich.live import Live

    try:
        if json_output:
            while True:
                typer.echo(json.dumps(inspector.poll().to_dict()))
                time.sleep(interval)
        with Live(console=Console(), auto_refresh=False, screen=False) as live:
            while True:
                live.update(render(inspector.poll(), interval), refresh=True)
                time.sleep(interval)
    except KeyboardInterrupt:
        return


# --- rendering ----------------------------------------------------------------------------------------


def _num(value: float | None, digits: int = 0, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}{suffix}"


def _ms(seconds: float | None) -> str:
    return _num(None if seconds is None else 1000 * seconds, 1)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d{hours:02d}h"
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def usage_color(usage: float) -> str:
    return "green" if usage < KV_WARN else "yellow" if usage < KV_CRIT else "red"


def block_map(
    states: Sequence[int], width: int = MAP_WIDTH, max_rows: int = MAP_ROWS
) -> tuple[list[int], int]:
    """One cell per block, or per group of blocks when there are more than fit (the group's commonest state).

    Returns the cell states and the number of blocks per cell.
    """
    if not states:
        return [], 1
    per_cell = math.ceil(len(states) / (width * max_rows))
    cells = []
    for start in range(0, len(states), per_cell):
        counts = Counter(states[start : start + per_cell])
        cells.append(max(counts, key=lambda state: (counts[state], state)))
    return cells, per_cell


def _header(snap: Snapshot, interval: float) -> RenderableType:
    from rich.text import Text

    text = Text.assemble(("izh inspect ", "bold"), (snap.url, "underline"), "  ")
    if not snap.up:
        text.append(f"● DOWN ({snap.error}); retrying every {interval:g}s", style="bold red")
        return text
    healthy = snap.health == "ok"
    text.append(f"● up, health {snap.health}", style="bold green" if healthy else "bold yellow")
    if snap.draining:
        text.append("  draining", style="bold yellow")
    text.append(f"  server {snap.server or '?'}")
    if snap.model:
        text.append(f"  model {snap.model}")
    if snap.uptime_s is not None:
        text.append(f"  uptime {_duration(snap.uptime_s)}")
    else:
        text.append(f"  seen up {_duration(snap.seen_up_s)}")
    if snap.window_s:
        text.append(f"  window {snap.window_s:.1f}s", style="dim")
    if snap.stats_age_s is not None:
        text.append(f"  engine stats {snap.stats_age_s:.1f}s old", style="dim")
    if snap.timed_out:
        text.append(f"  timed out: {', '.join(snap.timed_out)}", style="bold yellow")
    return text


def _kv_panel(snap: Snapshot) -> RenderableType:
    from rich.console import Group
    from rich.panel import Panel
    from rich.text import Text

    parts: list[RenderableType] = []
    if snap.kv_cache_usage is not None:
        color = usage_color(snap.kv_cache_usage)
        parts.append(Text.assemble("usage ", (_pct(snap.kv_cache_usage), f"bold {color}")))
        filled = round(min(max(snap.kv_cache_usage, 0.0), 1.0) * MAP_WIDTH)
        parts.append(Text.assemble(("━" * filled, color), ("━" * (MAP_WIDTH - filled), "grey23")))
    if snap.kv_block_states:
        cells, per_cell = block_map(snap.kv_block_states)
        grid = Text()
        for i, state in enumerate(cells):
            char, style = BLOCK_STYLES.get(state, ("?", "red"))
            grid.append(char, style=style)
            if (i + 1) % MAP_WIDTH == 0 and i + 1 < len(cells):
                grid.append("\n")
        parts.append(grid)
        counts = snap.kv_blocks
        assert counts is not None
        legend = Text.assemble(
            ("█", "magenta"), f" used {counts.used}  ", ("▓", "cyan"), f" cached {counts.cached}  ",
            ("·", "green"), f" free {counts.free}  ", (f"of {counts.total}" + (f", {per_cell}/cell" if per_cell > 1 else ""), "dim"),
        )  # fmt: skip
        parts.append(legend)
    if not parts:
        parts.append(Text("no KV cache metrics", style="dim"))
    return Panel(Group(*parts), title="KV cache", title_align="left")


def _load_panel(snap: Snapshot) -> RenderableType:
    from rich.panel import Panel
    from rich.table import Table

    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows = [
        ("in flight (API)", _num(snap.in_flight)),
        ("running", _num(snap.running)),
        ("waiting", _num(snap.waiting)),
        ("preemptions", f"{_num(snap.preemptions_total)} ({_num(snap.preemptions_per_s, 2)}/s)"),
        ("prompt tok/s", _num(snap.prompt_tokens_per_s, 1)),
        ("generation tok/s", _num(snap.generation_tokens_per_s, 1)),
        (
            "prefix cache hits",
            f"{_pct(snap.prefix_cache_hit_rate)} (all time {_pct(snap.prefix_cache_hit_rate_lifetime)})",
        ),
        ("tokens so far", f"{_num(snap.prompt_tokens_total)} in, {_num(snap.generation_tokens_total)} out"),
    ]
    if snap.spec_acceptance_rate_lifetime is not None:
        rows.append(
            (
                "draft acceptance",
                f"{_pct(snap.spec_acceptance_rate)} (all time {_pct(snap.spec_acceptance_rate_lifetime)})",
            )
        )
    for label, value in rows:
        table.add_row(label, value)
    return Panel(table, title="Requests", title_align="left")


def _latency_table(snap: Snapshot) -> RenderableType:
    from rich.table import Table

    table = Table(title="Latency (ms)", title_justify="left")
    for header in ("", "p50", "p95", "p99", "over"):
        table.add_column(header, justify="right" if header else "left")
    for key, label in (("ttft", "TTFT"), ("itl", "ITL"), ("e2e", "E2E")):
        window = snap.latency_window.get(key, {})
        values, over = (
            (window, "window")
            if any(v is not None for v in window.values())
            else (snap.latency_lifetime.get(key, {}), "all time")
        )
        if not values:
            continue
        cells = [_ms(values.get(p)) for p in ("p50", "p95", "p99")]
        table.add_row(label, *cells, over)
    return table


def _finish_table(snap: Snapshot) -> RenderableType:
    from rich.table import Table

    table = Table(title="Finished requests", title_justify="left")
    for header in ("reason", "total", "window"):
        table.add_column(header, justify="left" if header == "reason" else "right")
    for reason, total in sorted(snap.finish_reasons.items()):
        table.add_row(reason, _num(total), _num(snap.finish_reasons_window.get(reason)))
    return table


def _engines_table(snap: Snapshot) -> RenderableType:
    """One row per engine core (izh with --data-parallel-size > 1): KV use, running, waiting."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="Engine cores", title_justify="left")
    for header in ("core", "pid", "state", "KV", "running", "waiting"):
        table.add_column(header, justify="left" if header in ("core", "state") else "right")
    for row in snap.engines:
        state = ("alive", "green") if row.alive else (f"dead: {row.dead_reason or '?'}", "bold red")
        usage = row.kv_cache_usage
        table.add_row(
            str(row.engine),
            str(row.pid) if row.pid is not None else "-",
            f"[{state[1]}]{escape(state[0])}[/]",
            f"[{usage_color(usage)}]{_pct(usage)}[/]" if usage is not None and row.alive else "-",
            _num(row.running) if row.alive else "-",
            _num(row.waiting) if row.alive else "-",
        )
    return table


def render(snap: Snapshot, interval: float) -> RenderableType:
    """The whole dashboard for one snapshot."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[RenderableType] = [_header(snap, interval)]
    if snap.up:
        top = Table.grid(padding=(0, 1))
        top.add_row(_kv_panel(snap), _load_panel(snap))
        bottom = Table.grid(padding=(0, 2))
        bottom.add_row(_latency_table(snap), _finish_table(snap))
        parts += [top, bottom]
        if len(snap.engines) > 1:
            parts.append(_engines_table(snap))
    parts += [Text(note, style="yellow") for note in snap.notes]
    return Group(*parts)
