"""The layout shows the architecture: ``evoharness`` holds the agent, the operations, a small core both use and the
command line; no module imports another that (through any chain, function-level imports included) imports it back;
the agent never reaches into operations; every module says what it holds in its first docstring line, and one of
more than about 400 lines says why in its docstring."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from code_deps import imports  # noqa: E402

LONG = 420  # "about 400 lines"


def _modules() -> dict[str, Path]:
    out = {}
    for top in ("evoharness", "flows", "tasks"):
        for p in sorted((ROOT / top).rglob("*.py")):
            parts = p.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    g = {}
    for m, p in mods.items():
        named = imports(ast.parse(p.read_text()), m) if m.startswith("evoharness") else set()
        # flows and tasks import evoharness (and each other): follow both
        tree = ast.parse(p.read_text())
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] in ("flows", "tasks", "evoharness"):
                named |= {n.module} | {f"{n.module}.{a.name}" for a in n.names}
            elif isinstance(n, ast.Import):
                named |= {a.name for a in n.names if a.name.split(".")[0] in ("flows", "tasks", "evoharness")}
        deps = set()
        for d in named:
            while d and d not in mods:
                d = d.rpartition(".")[0]
            if d and d != m and not m.startswith(d + "."):  # a package's own __init__ runs first anyway
                deps.add(d)
        g[m] = deps
    return g


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in g:
        if v not in index:
            visit(v)
    return out


def test_the_package_shows_its_two_halves():
    top = sorted(p.name for p in (ROOT / "evoharness").iterdir() if p.name != "__pycache__")
    assert top == ["__init__.py", "agent", "cli", "core", "ops"]


def test_no_import_circle_function_level_imports_included():
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_agent_never_imports_operations_and_the_library_never_the_command_line():
    g = _graph()
    bad = [(m, d) for m, deps in g.items() for d in deps
           if (m.startswith("evoharness.agent") and d.startswith(("evoharness.ops", "evoharness.cli", "flows", "tasks")))
           or (m.startswith(("evoharness.ops", "evoharness.core")) and d.startswith(("evoharness.cli", "flows", "tasks")))
           or (m.startswith("evoharness.core") and d.startswith("evoharness.ops"))]
    assert bad == []
    # the core builds on the agent only where params.yaml's schema names the agent's own settings types
    assert {m for m, deps in g.items() if m.startswith("evoharness.core") and any(d.startswith("evoharness.agent") for d in deps)} == {"evoharness.core.config"}


def test_every_module_says_what_it_holds_and_a_long_one_why():
    missing, long = [], []
    for m, p in _modules().items():
        text = p.read_text()
        doc = ast.get_docstring(ast.parse(text))
        if not doc or not doc.strip().splitlines()[0].strip():
            missing.append(m)
        elif len(text.splitlines()) > LONG and "lines" not in doc:
            long.append(f"{m} ({len(text.splitlines())} lines)")
    assert missing == [] and long == [], (missing, long)
