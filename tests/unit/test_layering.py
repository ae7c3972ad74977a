"""The layering of izh's packages, enforced (docs/architecture.md, to be written, describes it).

From the bottom up: izh.kernels (ops, no model), izh.model (pure nn, no requests), izh.engine (runs the
model), izh.frontend and izh.api (requests, HTTP), and izh_cli above them all. Imports are read from each
file's AST, all of them: inside functions and `if TYPE_CHECKING:` blocks too, relative ones resolved.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IZH = ROOT / "izh"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _import_statements(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) for every import in the file: `import a.b` is ("a.b", []), `from m import x, y` is
    (m, ["x", "y"]) with a relative m resolved against the file's package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    found: list[tuple[str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((module, [alias.name for alias in node.names]))
    return found


def _imports(path: Path) -> set[str]:
    """Every module name the file imports; `from m import x` counts as m and as m.x (x may be a submodule)."""
    names: set[str] = set()
    for module, members in _import_statements(path):
        names.add(module)
        names.update(f"{module}.{member}" for member in members if member != "*")
    return names


def _izh_modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(IZH.rglob("*.py"))}


def _import_graph() -> dict[str, set[str]]:
    """izh module -> the izh modules it imports (`from m import x` is an edge to m.x when that is a module,
    else to m). A submodule's implicit import of its parent packages is no edge."""
    modules = _izh_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for module, members in _import_statements(path):
            if not members:
                if module in modules:
                    targets.add(module)
                continue
            for member in members:
                if f"{module}.{member}" in modules:
                    targets.add(f"{module}.{member}")
                elif module in modules:
                    targets.add(module)
        targets.discard(name)
        graph[name] = targets
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (a, b, ..., a), or None. Iterative depth-first search."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    for start in sorted(graph):
        if start in state:
            continue
        path = [start]
        stack = [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


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


def test_kernels_know_nothing_above_them() -> None:
    assert _violations("izh.kernels", ("izh.model", "izh.engine", "izh.frontend", "izh.api")) == []


def test_no_circular_imports() -> None:
    graph = _import_graph()
    assert "izh.model.llama" in graph["izh.model.registry"]  # the graph sees imports at all
    assert "izh.kernels.cpu" in graph["izh.model.layers"]  # `from izh.kernels import cpu` is the submodule
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_find_cycle_reports_one() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]


def _console_writes(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
            found.append(f"{where} calls print")
        elif (
            isinstance(node, ast.Attribute)
            and node.attr == "write"
            and isinstance(node.value, ast.Attribute)
            and node.value.attr in ("stdout", "stderr", "__stdout__", "__stderr__")
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "sys"
        ):
            found.append(f"{where} writes to sys.{node.value.attr}")
    for module, members in _import_statements(path):
        if module == "rich" or module.startswith("rich."):
            found.append(f"{path.relative_to(ROOT)} imports {module}")
        if module == "sys" and {"stdout", "stderr"} & set(members):
            found.append(f"{path.relative_to(ROOT)} imports sys.stdout/stderr")
    return found


def test_the_library_never_writes_to_the_console() -> None:
    """izh reports through logging and callbacks (LLM's progress); only izh_cli draws on the console."""
    assert [w for path in sorted(IZH.rglob("*.py")) for w in _console_writes(path)] == []


def test_pure_python_scheduling_state() -> None:
    for name in ("request", "kv_cache", "scheduler"):
        imports = _imports(ROOT / "izh" / "engine" / f"{name}.py")
        assert not {i for i in imports if i.split(".")[0] in ("torch", "numpy")}, name


def test_api_process_modules_do_not_import_torch() -> None:
    modules = [
        "izh.api.app",
        "izh.frontend.async_llm",
        "izh_cli.main",
        "izh.tokenizer",
        "izh.engine_messages",
    ]
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'transformers'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_only_settings_reads_the_environment() -> None:
    readers = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "izh").rglob("*.py"))
        if path.name != "settings.py" and any(word in path.read_text() for word in ("os.environ", "getenv("))
    ]
    assert readers == []


API_MODULE_MAX_LINES = 450


def test_api_modules_stay_short() -> None:
    """izh/api/ is one sub-package per endpoint (docs/architecture.md); a module past the bound is split
    along its seams rather than grown."""
    long = {
        str(path.relative_to(ROOT)): n
        for path in sorted((IZH / "api").rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > API_MODULE_MAX_LINES
    }
    assert long == {}


def test_api_has_no_flat_modules_but_the_app() -> None:
    """Each izh/api module lives in its endpoint's (or the shared) sub-package; only app.py, which
    assembles them, sits at the top."""
    top = sorted(path.name for path in (IZH / "api").glob("*.py"))
    assert top == ["__init__.py", "app.py"]
