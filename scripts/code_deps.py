"""The project modules a DVC stage's command runs (module- and function-level imports, at any depth) and, with
``--write``, those modules as the code deps of every stage in dvc.yaml and ablation/dvc.yaml (a package whose every
module the stage runs is listed as its folder). ``tests/test_lineage.py`` checks the deps against it.

    .venv/bin/python scripts/code_deps.py --write
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = "evoharness"
CLI = ROOT / PKG / "cli"
PIPELINES = ("dvc.yaml", "ablation/dvc.yaml")


def module_file(mod: str) -> Path | None:
    p = ROOT / Path(*mod.split("."))
    if (p / "__init__.py").exists():
        return p / "__init__.py"
    return p.with_suffix(".py") if p.with_suffix(".py").exists() else None


def imports(node: ast.AST, current: str) -> set[str]:
    """Every project module named by an import anywhere under ``node`` (``from a import b`` may name a
    module ``a.b`` or a name in ``a``: both are tried)."""
    out: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            base = current.rsplit(".", n.level)[0] + (f".{n.module}" if n.module else "") if n.level else (n.module or "")
            out |= {base} | {f"{base}.{a.name}" for a in n.names}
    return {m for m in out if m.split(".")[0] == PKG and module_file(m) is not None}


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
        todo += list(imports(ast.parse(module_file(m).read_text()), m))
    return seen


def command_closure(command: str) -> set[str]:
    """What ``python -m evoharness.cli <command>`` runs: every command group's module-level imports (the package
    imports them all to register their commands), the command's function and the cli helpers it calls, and
    everything those import."""
    trees = {f"{PKG}.cli.{p.stem}": ast.parse(p.read_text()) for p in sorted(CLI.glob("*.py"))}
    funcs: dict[str, tuple[str, ast.FunctionDef]] = {}
    cmd = None
    for mod, tree in trees.items():
        for n in tree.body:
            if not isinstance(n, ast.FunctionDef):
                continue
            funcs[n.name] = (mod, n)
            for d in n.decorator_list:
                if isinstance(d, ast.Call) and getattr(d.func, "attr", "") == "command":
                    if (d.args[0].value if d.args else n.name) == command:
                        cmd = (mod, n)
    if cmd is None:
        raise SystemExit(f"error: no command {command!r} in {CLI.relative_to(ROOT)}")
    mods: set[str] = set()
    for mod, tree in trees.items():
        mods |= imports(ast.Module(body=[n for n in tree.body if not isinstance(n, ast.FunctionDef)], type_ignores=[]), mod)
    mods |= imports(cmd[1], cmd[0])
    for call in ast.walk(cmd[1]):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in funcs:
            mods |= imports(funcs[call.func.id][1], funcs[call.func.id][0])
    mods = {m for m in mods if m != f"{PKG}.cli" and not m.startswith(f"{PKG}.cli.")}
    return closure(mods) | {f"{PKG}.cli"} | {m for m in trees if not m.endswith(".__init__")}


def stage_command(cmd: str) -> str:
    argv = cmd.split()
    return argv[argv.index(f"{PKG}.cli") + 1]


def code_deps(command: str) -> list[str]:
    """The stage's code deps as dvc.yaml lists them: files, or a package's folder when the stage runs all of it."""
    files = {module_file(m).relative_to(ROOT).as_posix() for m in command_closure(command)}
    out: set[str] = set()
    for f in files:
        parts = f.split("/")
        keep = f
        for i in range(2, len(parts)):  # the outermost package below evoharness/ whose every module is run
            folder = "/".join(parts[:i])
            if all(p.relative_to(ROOT).as_posix() in files for p in (ROOT / folder).rglob("*.py")):
                keep = folder
                break
        out.add(keep)
    return sorted(out)


def write(path: Path) -> bool:
    """Replace each stage's ``evoharness/`` deps in ``path`` with :func:`code_deps`; True if anything changed."""
    import yaml

    text = path.read_text()
    stages = yaml.safe_load(text)["stages"]
    lines = text.splitlines(keepends=True)
    out, stage, changed = [], None, False
    i = 0
    while i < len(lines):
        line = lines[i]
        m = re.match(r"^  (\w+):\s*$", line)
        if m and m.group(1) in stages:
            stage = m.group(1)
        d = re.match(r"^(\s*)- evoharness/", line)
        if d and stage:
            j = i
            while j < len(lines) and re.match(r"^\s*- evoharness/", lines[j]):
                j += 1
            new = [f"{d.group(1)}- {p}\n" for p in code_deps(stage_command(stages[stage]["cmd"]))]
            changed |= new != lines[i:j]
            out += new
            i = j
            continue
        out.append(line)
        i += 1
    if changed:
        path.write_text("".join(out))
    return changed


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit(__doc__.strip().splitlines()[-1].strip())
    for name in PIPELINES:
        print(f"{name}: {'rewritten' if write(ROOT / name) else 'up to date'}")
