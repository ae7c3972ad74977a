"""The built-in web UI in a real browser: headless Chromium (Debian's /usr/bin/chromium, driven by
Playwright) against a real `izh serve` of the default model, behind an API key.

One server and one browser for the module. Each test saves a screenshot of what it checked under
$IZH_TEST_ARTIFACTS/webui (default: test-artifacts/webui/ at the repository root, git-ignored).
Skips, saying why, without Chromium or Playwright; `.ci/run` installs both.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from izh.config import EngineConfig
from izh_cli.inspect_metrics import Scrape, quantiles
from tests.e2e.api_server import ApiServer, api_server
from tests.e2e.real_server import API_KEY, RealServer, serve_default_model
from tests.engine.fake_core import make_fake_model

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
REPO = Path(__file__).resolve().parents[2]
WAIT_MS = 120_000
"""How long a browser wait may take: the model shares a small CPU with the rest of the suite."""
ABORTED = ("izh:request_success_total{", 'finished_reason="abort"')
"""The counter of requests that ended aborted (a client gone): its name and label."""
HISTOGRAMS = (
    "izh:time_to_first_token_seconds",
    "izh:inter_token_latency_seconds",
    "izh:e2e_request_latency_seconds",
)
SEED_KEY = f"if (!localStorage.getItem('izh.apiKey')) localStorage.setItem('izh.apiKey', '{API_KEY}');"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[dev]')")
    if not CHROMIUM.is_file():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium; .ci/run does)")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture(scope="module")
def server(smollm2_gguf: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    yield from serve_default_model(smollm2_gguf, tmp_path_factory)


@pytest.fixture(scope="module")
def artifacts() -> Path:
    folder = Path(os.environ.get("IZH_TEST_ARTIFACTS") or REPO / "test-artifacts") / "webui"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def keyed(browser: Any) -> Iterator[Any]:
    """One browser context (one local storage) that already holds the API key, shared by the tests
    that chat: conversations made by one test are there for the next."""
    context = browser.new_context(viewport={"width": 1280, "height": 800}, color_scheme="light")
    context.add_init_script(SEED_KEY)
    try:
        yield context
    finally:
        context.close()


@pytest.fixture
def page(keyed: Any, server: RealServer) -> Iterator[Any]:
    opened = keyed.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda exc: errors.append(str(exc)))
    opened.set_default_timeout(WAIT_MS)
    try:
        yield opened
    finally:
        opened.close()
    assert errors == [], errors


def open_chat(page: Any, server: RealServer) -> None:
    page.goto(f"{server.url}/")
    page.wait_for_function("() => document.querySelector('#model')?.value === 'smollm2'")


def counter(server: RealServer, metric: tuple[str, str]) -> float:
    """The sum of the /metrics samples whose line starts with metric[0] and holds the label metric[1]."""
    start, label = metric
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    lines = [line for line in text.splitlines() if line.startswith(start) and label in line]
    assert lines, metric
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def set_settings(page: Any, **values: str) -> None:
    if page.locator("#settings").is_hidden():
        page.click("#settings-toggle")
    for field, value in values.items():
        page.fill(f"#{field}", value)
        page.dispatch_event(f"#{field}", "change")


def send(page: Any, text: str) -> Any:
    """Type `text` and press Enter; the new assistant message's locator."""
    count = page.locator(".msg.assistant").count()
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    return page.locator(".msg.assistant").nth(count)


def test_pages_are_public_and_the_api_asks_for_the_key(
    browser: Any, server: RealServer, artifacts: Path
) -> None:
    assert httpx.get(f"{server.url}/", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/dashboard", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/webui/chat.js", timeout=10).status_code == 200
    assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{server.url}/v1/izh/stats", timeout=10).status_code == 401

    context = browser.new_context(viewport={"width": 1280, "height": 800})
    try:
        page = context.new_page()
        page.set_default_timeout(WAIT_MS)
        page.goto(f"{server.url}/")
        page.wait_for_selector("#api-key-dialog")
        page.fill("#api-key-input", "not-the-key")
        page.press("#api-key-input", "Enter")
        page.wait_for_function("() => document.querySelector('#api-key-error').textContent.includes('401')")
        assert "Invalid API key" in page.inner_text("#api-key-error")
        page.screenshot(path=artifacts / "key-prompt.png")
        page.fill("#api-key-input", API_KEY)
        page.press("#api-key-input", "Enter")
        page.wait_for_selector("#api-key-dialog", state="detached")
        page.wait_for_function("() => document.querySelector('#model')?.value === 'smollm2'")
        assert page.evaluate("localStorage.getItem('izh.apiKey')") == API_KEY
        # The key is asked for once: a reload goes straight to the chat.
        page.reload()
        page.wait_for_function("() => document.querySelector('#model')?.value === 'smollm2'")
        assert page.locator("#api-key-dialog").count() == 0
    finally:
        context.close()


def test_a_reply_streams_in_and_the_conversation_survives_a_reload(
    page: Any, server: RealServer, artifacts: Path
) -> None:
    open_chat(page, server)
    page.fill("#prompt", "first line")
    page.press("#prompt", "Shift+Enter")
    page.type("#prompt", "second line")
    assert page.input_value("#prompt") == "first line\nsecond line"
    set_settings(page, **{"max-tokens": "48", "temperature": "0", "seed": "7"})
    reply = send(page, "Write a short poem about the sea.")
    # Text shows while the request is still running (the Stop button is up): it streamed in.
    page.wait_for_function(
        "() => document.querySelectorAll('.msg.assistant .content.cursor').length === 1"
        " && document.querySelector('.msg.assistant .content.cursor').textContent.trim().length > 0"
        " && !document.querySelector('#stop').classList.contains('hidden')"
    )
    reply.locator(".meta .tokens").wait_for()
    text = reply.locator(".content").inner_text().strip()
    assert text
    assert re.fullmatch(r"\d+ prompt \+ \d+ completion tokens", reply.locator(".meta .tokens").inner_text())
    assert re.fullmatch(r"TTFT [\d,]+ ms", reply.locator(".meta .ttft").inner_text())
    assert re.fullmatch(r"[\d,.]+ tok/s", reply.locator(".meta .tps").inner_text())
    assert page.locator("#send").is_visible() and page.locator("#stop").is_hidden()
    page.screenshot(path=artifacts / "chat.png")

    page.reload()
    page.wait_for_selector(".msg.assistant")
    assert (
        page.locator(".conversations li.current .title").inner_text() == "Write a short poem about the sea."
    )
    assert page.locator(".msg.user .content").last.inner_text() == "Write a short poem about the sea."
    assert page.locator(".msg.assistant .content").last.inner_text().strip() == text
    assert page.locator(".msg.assistant .meta .tokens").last.is_visible()


def test_stop_aborts_the_request_on_the_server(page: Any, server: RealServer) -> None:
    open_chat(page, server)
    aborted = counter(server, ABORTED)
    page.click("#new-chat")
    # Greedy, this prompt runs past 200 tokens: the reply is still streaming when Esc stops it.
    set_settings(page, **{"max-tokens": "1500", "temperature": "0"})
    reply = send(page, "Write a long essay about the history of Rome.")
    page.wait_for_function(
        "() => (document.querySelector('.msg.assistant:last-child .content')?.textContent.trim().length ?? 0) > 0"
    )
    page.keyboard.press("Escape")
    reply.locator(".meta .stopped").wait_for()
    assert reply.locator(".meta .stopped").inner_text() == "stopped"
    assert page.locator("#send").is_visible()
    deadline = time.monotonic() + 60
    while counter(server, ABORTED) <= aborted and time.monotonic() < deadline:
        time.sleep(0.2)
    assert counter(server, ABORTED) == aborted + 1


def test_a_server_error_shows_as_a_message(page: Any, server: RealServer) -> None:
    open_chat(page, server)
    page.click("#new-chat")  # the page sends just "Hi", as the request below does
    set_settings(page, **{"max-tokens": "100000", "temperature": "", "seed": ""})
    body = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 100000}
    direct = httpx.post(
        f"{server.base_url}/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    )
    assert direct.status_code == 400
    reply = send(page, "Hi")
    reply.locator(".error").wait_for()
    shown = reply.locator(".error").inner_text()
    assert shown.startswith("Error 400")
    assert direct.json()["error"]["message"] in shown
    set_settings(page, **{"max-tokens": ""})


def test_markdown_reasoning_and_tool_calls_render_safely(
    page: Any, server: RealServer, artifacts: Path
) -> None:
    """A stored conversation whose assistant message holds HTML, reasoning and a tool call: the HTML
    shows as text (no element, no script run), reasoning as a collapsed block, the call by name."""
    hostile = (
        '# Title\n\n<img src=x onerror="window.pwned=1"> **bold** and `<b>code</b>`\n\n'
        "- one\n- [link](javascript:alert(1)) and [ok](https://example.com)\n\n"
        '```python\ndef f(x):\n    return "<script>" + str(x)  # note\n```\n\n| a | b |\n|---|---|\n| 1 | 2 |\n'
    )
    conversation = {
        "id": "seeded",
        "title": "Seeded <b>title</b>",
        "created": 1,
        "updated": 1,
        "messages": [
            {"role": "user", "content": "<i>hi</i>"},
            {
                "role": "assistant",
                "content": hostile,
                "reasoning": "Let me think <b>hard</b>.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
                "model": "smollm2",
                "stats": {},
            },
        ],
    }
    open_chat(page, server)
    page.evaluate(
        "c => { const all = JSON.parse(localStorage.getItem('izh.conversations') || '[]');"
        " localStorage.setItem('izh.conversations', JSON.stringify([c, ...all]));"
        " localStorage.setItem('izh.currentConversation', c.id); }",
        conversation,
    )
    page.reload()
    message = page.locator(".msg.assistant").last
    message.wait_for()
    content = message.locator(".content")
    assert content.locator("img, script, b").count() == 0
    assert page.evaluate("window.pwned") is None
    assert '<img src=x onerror="window.pwned=1">' in content.inner_text()
    assert content.locator("h1").inner_text() == "Title"
    assert content.locator("strong").inner_text() == "bold"
    assert content.locator("code").first.inner_text() == "<b>code</b>"
    assert [a.get_attribute("href") for a in content.locator("a").all()] == ["https://example.com"]
    assert content.locator(".tok-kw").first.inner_text() == "def"
    assert content.locator(".tok-str").inner_text() == '"<script>"'
    assert content.locator(".tok-com").inner_text() == "# note"
    assert content.locator("td").all_inner_texts() == ["1", "2"]
    reasoning = message.locator("details.reasoning")
    assert reasoning.get_attribute("open") is None
    assert "<b>hard</b>" in reasoning.locator(".reasoning-text").text_content()
    assert message.locator(".tool-call .name").inner_text() == "get_weather"
    assert json.loads(message.locator(".tool-call pre").inner_text()) == {"city": "Paris"}
    assert page.locator(".msg.user .content").last.inner_text() == "<i>hi</i>"
    assert page.locator(".conversations li.current .title").inner_text() == "Seeded <b>title</b>"
    page.screenshot(path=artifacts / "chat-markdown.png", full_page=True)

    # Rename, export, delete: the conversation list's own actions.
    item = page.locator(".conversations li.current")
    item.hover()
    item.locator(".rename").click()
    page.fill(".rename-input", "Renamed")
    page.press(".rename-input", "Enter")
    assert page.locator(".conversations li.current .title").inner_text() == "Renamed"
    page.locator(".conversations li.current").hover()
    with page.expect_download() as download:
        page.locator(".conversations li.current .export").click()
    exported = json.loads(Path(download.value.path()).read_text())
    assert (
        exported["title"] == "Renamed"
        and exported["messages"][1]["tool_calls"][0]["function"]["name"] == "get_weather"
    )
    before = page.locator(".conversations li").count()
    page.locator(".conversations li.current").hover()
    page.locator(".conversations li.current .delete").click()
    page.locator(".conversations li.current .delete").click()  # the second click confirms
    assert page.locator(".conversations li").count() == before - 1
    assert "seeded" not in page.evaluate("localStorage.getItem('izh.conversations')")


def test_phone_width_and_dark_theme(browser: Any, server: RealServer, artifacts: Path) -> None:
    context = browser.new_context(viewport={"width": 390, "height": 844}, color_scheme="dark", is_mobile=True)
    context.add_init_script(SEED_KEY)
    try:
        page = context.new_page()
        page.set_default_timeout(WAIT_MS)
        page.goto(f"{server.url}/")
        page.wait_for_function("() => document.querySelector('#model')?.value === 'smollm2'")
        page.evaluate(
            "localStorage.setItem('izh.conversations', JSON.stringify([{id: 'p', title: 'Phone', created: 1,"
            " updated: 1, messages: [{role: 'user', content: 'Show me code'}, {role: 'assistant', model: 'smollm2',"
            " stats: {ttft_ms: 120, tokens_per_s: 31.5, prompt_tokens: 12, completion_tokens: 40},"
            " content: 'Here:\\n\\n```js\\nconst answer = 42; // the answer\\nconsole.log(answer);\\n```'}]}]))"
        )
        page.reload()
        page.wait_for_selector(".msg.assistant")
        assert page.evaluate("document.documentElement.scrollWidth") <= 390
        assert page.locator("#sidebar").bounding_box()["x"] < 0  # off screen until the menu opens
        assert page.locator("#prompt").is_visible() and page.locator("#send").is_visible()
        background = page.evaluate("getComputedStyle(document.body).backgroundColor")
        assert background == "rgb(18, 20, 23)"  # the dark theme, from prefers-color-scheme
        page.screenshot(path=artifacts / "chat-phone-dark.png")
        page.click("#menu")
        page.wait_for_function("() => document.getElementById('sidebar').getBoundingClientRect().x >= 0")
        page.screenshot(path=artifacts / "chat-phone-menu.png")
        page.mouse.click(370, 400)  # beside the list: it closes
        page.wait_for_function("() => document.getElementById('sidebar').getBoundingClientRect().x < 0")
    finally:
        context.close()


REQUESTS, OUTPUT_LEN = 12, 96
"""izh bench's load for the dashboard test."""


def test_the_dashboard_moves_under_load(
    page: Any, server: RealServer, artifacts: Path, tmp_path: Path
) -> None:
    page.goto(f"{server.url}/dashboard")
    page.wait_for_selector("#gen-total[data-value]")
    page.wait_for_function("() => document.querySelectorAll('#latency-body tr').length === 3")
    generated = float(page.get_attribute("#gen-total", "data-value"))
    finished = _finished(page)
    cmd = [sys.executable, "-m", "izh_cli.main", "bench", "--url", server.url, "--api-key", API_KEY]
    # Long enough (4 waves of 3 streams x 96 tokens, a few seconds) that the page's once-a-second
    # polls see requests running, not only their totals afterwards.
    cmd += [
        "-n",
        str(REQUESTS),
        "-c",
        "3",
        "--input-len",
        "32",
        "--output-len",
        str(OUTPUT_LEN),
        "--ignore-eos",
        "--out",
        str(tmp_path),
    ]
    # The bench alone can finish between two of the page's polls on a fast host, so one long stream stays
    # open until the page has seen a request running, then is dropped (a client disconnect).
    held = threading.Event()
    seen = threading.Event()
    holder = threading.Thread(target=_hold_stream, args=(server, held, seen), daemon=True)
    holder.start()
    bench = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert held.wait(120), "the held stream produced no token"
        page.wait_for_function("() => Number(document.getElementById('gen-rate').dataset.value) > 0")
        page.wait_for_function("() => Number(document.getElementById('running').dataset.value) > 0")
        seen.set()
        _, stderr = bench.communicate(timeout=600)
    finally:
        seen.set()
        holder.join(60)
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 0, stderr
    # bench's requests plus its one probe: at least REQUESTS x OUTPUT_LEN more generated tokens, REQUESTS
    # more finished.
    page.wait_for_function(
        "() => Number(document.getElementById('gen-total').dataset.value)"
        f" >= {generated + REQUESTS * OUTPUT_LEN}"
    )
    page.wait_for_function(
        "() => [...document.querySelectorAll('[data-reason]')].reduce((s, e) => s + Number(e.dataset.value), 0)"
        f" >= {finished + REQUESTS}"
    )
    assert page.inner_text("[data-latency='ttft-p50-window']") != "—"
    assert float(page.get_attribute("#kv-usage", "data-value")) >= 0
    assert page.locator("#notice").is_hidden()
    assert "up" in page.inner_text("#status-text")
    assert page.inner_text("#model-name") == server.model
    page.screenshot(path=artifacts / "dashboard.png", full_page=True)

    # The page's Prometheus parsing and percentiles are izh inspect's, on the same scrape.
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    scrape = Scrape.from_text(text, 0.0)
    expected = {name: quantiles(scrape.buckets(name)) for name in HISTOGRAMS}
    computed = page.evaluate(
        """async ([text, names]) => {
            const prom = await import("./webui/prom.js");
            const scrape = new prom.Scrape(text, 0);
            return Object.fromEntries(names.map((name) => [name, Object.fromEntries([0.5, 0.95, 0.99].map(
                (q) => [`p${Math.round(q * 100)}`, prom.histogramQuantile(q, scrape.buckets(name))]))]));
        }""",
        [text, list(HISTOGRAMS)],
    )
    for name in HISTOGRAMS:
        assert None not in expected[name].values(), name
        assert computed[name] == pytest.approx(expected[name]), name


def _hold_stream(server: RealServer, held: threading.Event, seen: threading.Event) -> None:
    """Streams a long completion, sets `held` at its first token and reads until `seen` is set."""
    body = {
        "model": server.model,
        "prompt": "Count slowly:",
        "max_tokens": 1800,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                held.set()
            if seen.is_set():
                return


def _finished(page: Any) -> float:
    values = page.eval_on_selector_all("[data-reason]", "nodes => nodes.map(n => Number(n.dataset.value))")
    return float(sum(values))


@pytest.fixture(scope="module")
def echo_server(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    """A server over the FakeEngineCore, which echoes its prompt a token per step, with a template that
    renders only the last message and the `think` reasoning parser: the "model" answers exactly what
    the page sent, so the reasoning and content it streams are known."""
    model_dir = make_fake_model(
        tiny_llama_dir,
        tmp_path_factory.mktemp("echo_model"),
        step_delay_s=0.02,
        max_model_len=256,
        vocab_size=1000,
    )
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = "{{ messages[-1]['content'] }}"
    (model_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    config = EngineConfig(model=str(model_dir), served_model_name="echo")
    start = {"core_factory": "tests.engine.fake_core:FakeEngineCore"}
    with api_server(config, start_kwargs=start, reasoning_parser="think") as started:
        yield started


def test_streamed_reasoning_shows_as_a_collapsible_block(browser: Any, echo_server: ApiServer) -> None:
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    try:
        page = context.new_page()
        page.set_default_timeout(WAIT_MS)
        page.goto(f"{echo_server.url}/")  # no API key on this server: no prompt
        page.wait_for_function("() => document.querySelector('#model')?.value === 'echo'")
        reply = send(page, "<think>First, add.\nThen check.</think>\n\nThe answer is **4**.")
        reply.locator(".meta .tokens").wait_for()
        reasoning = reply.locator("details.reasoning")
        assert reasoning.locator(".reasoning-text").text_content() == "First, add.\nThen check."
        assert reasoning.get_attribute("open") is None  # collapsed once the answer came
        assert reply.locator(".content").inner_text().strip() == "The answer is 4."
        assert reply.locator(".content strong").inner_text() == "4"
        assert page.locator("#api-key-dialog").count() == 0
        reasoning.locator("summary").click()
        assert reasoning.locator(".reasoning-text").is_visible()
    finally:
        context.close()
