"""The web UI's shipped files (izh/api/webui/static/): under the size budget the README states, all
packaged, self-contained (nothing from another origin, nothing for a build step) and fit for the
pages' Content-Security-Policy (no inline script, style or event handler)."""

from __future__ import annotations

import gzip
import re
import tomllib
from fnmatch import fnmatch
from pathlib import Path

from izh.api.webui.routes import PAGES, STATIC_FOLDER, load_assets

REPO = Path(__file__).resolve().parents[2]
BUDGET_BYTES = 300 * 1024
"""The README's budget: every file of the web UI together, gzipped, stays under 300 KB."""


def test_the_web_ui_stays_under_its_size_budget() -> None:
    assets = load_assets()
    compressed = sum(len(gzip.compress(asset.body, compresslevel=9)) for asset in assets.values())
    assert compressed < BUDGET_BYTES, f"{compressed} bytes gzipped, over the {BUDGET_BYTES} budget"
    assert "300 KB" in (REPO / "README.md").read_text(encoding="utf-8")


def test_every_file_is_package_data() -> None:
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = package_data["izh.api.webui"]
    folder = REPO / "izh" / "api" / "webui" / STATIC_FOLDER
    files = sorted(path.name for path in folder.iterdir() if path.is_file())
    assert files and sorted(load_assets()) == files
    for name in files:
        assert any(fnmatch(f"{STATIC_FOLDER}/{name}", pattern) for pattern in patterns), name


def test_every_reference_resolves_to_a_shipped_file() -> None:
    assets = load_assets()
    for name, asset in assets.items():
        text = asset.body.decode()
        if name.endswith(".html"):
            for ref in re.findall(r'(?:src|href)="webui/([^"]+)"', text):
                assert ref in assets, f"{name} refers to webui/{ref}"
        if name.endswith(".js"):
            for ref in re.findall(r'from "\./([^"]+)"', text):
                assert ref in assets, f"{name} imports ./{ref}"
    assert set(PAGES.values()) <= assets.keys()


def test_nothing_comes_from_another_origin_and_nothing_is_inline() -> None:
    for name, asset in load_assets().items():
        text = asset.body.decode()
        assert not re.search(r'(?:src|href)\s*=\s*"(?:https?:)?//', text), name
        assert not re.search(r'\bfrom\s+"(?:https?:)?//', text), name
        assert not re.search(r"url\(\s*['\"]?(?:https?:)?//", text), name
        assert not re.search(r"@import", text), name
        if name.endswith(".html"):
            assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", text), f"{name}: inline script"
            assert not re.search(r"\sstyle\s*=", text), f"{name}: inline style"
            assert not re.search(r"<style", text), f"{name}: inline style sheet"
            assert not re.search(r"\son[a-z]+\s*=", text), f"{name}: inline event handler"
