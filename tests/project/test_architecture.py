"""The package boundary, read from the source with ``ast`` (docs/architecture.md).

- no import cycle between modules of proxy/ and supervisor/;
- no function-local import of our own modules (the usual way to dodge a cycle);
- the composition root (the CLI, proxy/cli/) is the only place where proxy/ imports supervisor/;
- supervisor/ never imports the proxy's app or request path.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"proxy": "idemproxy.proxy", "supervisor": "idemproxy.supervisor"}
COMPOSITION_ROOT = "idemproxy.proxy.cli"  # the package: its modules compose
# what the supervisor may not reach into: the proxy's HTTP app and request path
PROXY_HTTP = ("idemproxy.proxy.app", "idemproxy.proxy.appkeys", "idemproxy.proxy.request_path",
              "idemproxy.proxy.forward", "idemproxy.proxy.calls", "idemproxy.proxy.replay",
              "idemproxy.proxy.server", "idemproxy.proxy.runs.api", "idemproxy.proxy.runs.admin")


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _target(module: str, node: ast.ImportFrom) -> list[str]:
    """The project modules an ``from ... import ...`` loads (the names may be modules too)."""
    if node.level:
        base = module.split(".") if _is_package(module) else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        name = ".".join(base + ([node.module] if node.module else []))
    else:
        name = node.module or ""
    wanted = [name] + [f"{name}.{alias.name}" for alias in node.names]
    return [w for w in wanted if w in MODULES]


def _with_parents(names: list[str]) -> set[str]:
    out = set()
    for name in names:
        parts = name.split(".")
        out |= {".".join(parts[:i]) for i in range(2, len(parts) + 1)} & MODULES.keys()
    return out


def _imports() -> tuple[dict[str, set[str]], list[str]]:
    """Each module's project imports at module level, and every function-local one."""
    graph: dict[str, set[str]] = {}
    local: list[str] = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                targets = _target(module, node)
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name in MODULES]
            else:
                continue
            if targets:
                edges |= _with_parents(targets)
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, ast.ImportFrom) and _target(module, node) or \
                            isinstance(node, ast.Import) and any(a.name in MODULES for a in node.names):
                        local.append(f"{module}:{node.lineno}")
        graph[module] = edges - _with_parents([module])  # a module's own packages load before it
    return graph, local


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


GRAPH, LOCAL = _imports()


def test_the_checker_sees_imports():
    # guards the checks below against passing because the parser found nothing
    assert "idemproxy.proxy.config" in GRAPH["idemproxy.proxy.app"]
    assert "idemproxy.supervisor" in GRAPH[f"{COMPOSITION_ROOT}.serving"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def test_no_function_local_project_imports():
    assert LOCAL == []


def test_only_the_composition_root_imports_the_supervisor():
    reaching = sorted(m for m, edges in GRAPH.items() if m.startswith(PACKAGES["proxy"]) and not _in(m, COMPOSITION_ROOT)
                      and any(e.startswith(PACKAGES["supervisor"]) for e in edges))
    assert reaching == []


def test_the_supervisor_stays_out_of_the_proxys_http_internals():
    reaching = sorted(f"{m} -> {e}" for m, edges in GRAPH.items() if m.startswith(PACKAGES["supervisor"])
                      for e in edges if e in PROXY_HTTP)
    assert reaching == []


def test_every_package_is_installed():
    # setuptools installs the packages pyproject lists (the folders are mapped, not found):
    # a package missing there works from a checkout and is absent from the wheel
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {name for name in MODULES if _is_package(name)}
    assert packages - listed == set()
