"""The module boundaries of DESIGN.md, enforced."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _violations(package: str, forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in sorted((ROOT / package.replace(".", "/")).rglob("*.py")):
        for name in _imports(path):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


def test_izh_never_imports_the_cli() -> None:
    assert _violations("izh", ("izh_cli",)) == []


def test_engine_and_model_know_nothing_of_http() -> None:
    forbidden = ("fastapi", "uvicorn", "prometheus_client", "izh.frontend", "izh.api")
    assert _violations("izh.engine", forbidden) == []
    assert _violations("izh.model", (*forbidden, "izh.engine")) == []


def test_pure_python_scheduling_state() -> None:
    for name in ("request", "kv_cache", "scheduler"):
        imports = _imports(ROOT / "izh" / "engine" / f"{name}.py")
        assert not {i for i in imports if i.split(".")[0] in ("torch", "numpy")}, name


def test_api_process_modules_do_not_import_torch() -> None:
    modules = ["izh.api.app", "izh.frontend.async_llm", "izh_cli.main", "izh.tokenizer", "izh.protocol"]
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'transformers'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
