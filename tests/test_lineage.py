"""DVC lineage covers code: every project module a stage's command imports (at any depth, module- or
function-level) is one of that stage's deps in dvc.yaml, so a change to any of them re-runs the stage."""

from __future__ import annotations

import ast
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
PKG = "evoharness"


def _file(mod: str) -> Path | None:
    p = ROOT / Path(*mod.split("."))
    if (p / "__init__.py").exists():
        return p / "__init__.py"
    return p.with_suffix(".py") if p.with_suffix(".py").exists() else None


def _imports(node: ast.AST, current: str) -> set[str]:
    """Every project module named by an import anywhere under ``node`` (``from a import b`` may name a
    module ``a.b`` or a name in ``a``: both are tried)."""
    out: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            base = current.rsplit(".", n.level)[0] + (f".{n.module}" if n.module else "") if n.level else (n.module or "")
            out |= {base} | {f"{base}.{a.name}" for a in n.names}
    return {m for m in out if m.split(".")[0] == PKG and _file(m) is not None}


def closure(start: set[str]) -> set[str]:
    """The modules ``start`` imports, transitively, with the packages whose ``__init__`` runs on the way."""
    seen: set[str] = set()
    todo = list(start)
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parts = m.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        todo += list(_imports(ast.parse(_file(m).read_text()), m))
    return seen


def command_closure(command: str) -> set[str]:
    """What ``python -m evoharness.cli <command>`` runs: cli.py's module-level imports, the command's
    function and the cli helpers it calls, and everything those import."""
    tree = ast.parse((ROOT / PKG / "cli.py").read_text())
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    cmd = None
    for n in funcs.values():
        for d in n.decorator_list:
            if isinstance(d, ast.Call) and getattr(d.func, "attr", "") == "command":
                name = d.args[0].value if d.args else n.name
                if name == command:
                    cmd = n
    assert cmd is not None, f"no command {command!r} in evoharness/cli.py"
    top = ast.Module(body=[n for n in tree.body if not isinstance(n, ast.FunctionDef)], type_ignores=[])
    mods = _imports(top, f"{PKG}.cli") | _imports(cmd, f"{PKG}.cli")
    for call in ast.walk(cmd):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in funcs:
            mods |= _imports(funcs[call.func.id], f"{PKG}.cli")
    mods.discard(f"{PKG}.cli")
    mods = {m for m in mods if not m.startswith(f"{PKG}.cli.")}
    return closure(mods) | {f"{PKG}.cli"}


def stage_commands() -> dict[str, str]:
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    out = {}
    for name, st in stages.items():
        argv = st["cmd"].split()
        out[name] = argv[argv.index(f"{PKG}.cli") + 1]
    return out


def test_every_stage_depends_on_every_module_its_command_imports():
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    missing = {}
    for name, command in stage_commands().items():
        deps = [str(d if isinstance(d, str) else next(iter(d))).rstrip("/") for d in stages[name].get("deps", [])]
        for mod in sorted(command_closure(command)):
            f = _file(mod).relative_to(ROOT).as_posix()
            if not any(f == d or f.startswith(d + "/") for d in deps):
                missing.setdefault(name, []).append(f)
    assert not missing, "dvc.yaml misses code deps: " + "; ".join(f"{s}: {', '.join(fs)}" for s, fs in missing.items())


def test_the_closure_follows_function_level_imports():
    mods = command_closure("grpo")
    assert {"evoharness.training.grpo", "evoharness.policies.batched", "evoharness.policies.constrain", "evoharness.harness.consolidate",
            "evoharness.episode", "evoharness.training.distributed"} <= mods
    assert "evoharness.compare" not in mods and "evoharness.collect" not in mods


def test_every_data_path_a_stage_command_names_is_a_dep_or_an_output():
    """A file the command reads but DVC does not know of is neither hashed nor pulled for a job on
    another machine (the evaluate stage once read the demos' bank undeclared)."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    bad = []
    for name, st in stages.items():
        declared = []
        for kind in ("deps", "outs", "metrics", "plots"):
            declared += [str(d if isinstance(d, str) else next(iter(d))).rstrip("/") for d in st.get(kind) or []]
        declared += ["data/checkpoints", "data/timing", "data/validation", "data/quarantine"]  # never versioned (README)
        for tok in st["cmd"].split():
            t = tok.rstrip("/")
            # a folder of declared inputs (evaluate's --models data/models) counts as declared
            if t.startswith("data/") and not any(t == d or t.startswith(d + "/") or d.startswith(t + "/") for d in declared):
                bad.append(f"{name}: {tok}")
    assert not bad, bad
