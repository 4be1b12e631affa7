"""DVC lineage covers code: every project module a stage's command imports (at any depth, module- or
function-level) is one of that stage's deps in dvc.yaml, so a change to any of them re-runs the stage."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from code_deps import PIPELINES, code_deps, command_closure, module_file, stage_command  # noqa: E402


def stage_commands(pipeline: str = "dvc.yaml") -> dict[str, str]:
    stages = yaml.safe_load((ROOT / pipeline).read_text())["stages"]
    return {name: stage_command(st["cmd"]) for name, st in stages.items()}


def test_every_stage_depends_on_every_module_its_command_imports():
    for pipeline in PIPELINES:
        stages = yaml.safe_load((ROOT / pipeline).read_text())["stages"]
        missing = {}
        for name, command in stage_commands(pipeline).items():
            deps = [str(d if isinstance(d, str) else next(iter(d))).rstrip("/") for d in stages[name].get("deps", [])]
            for mod in sorted(command_closure(command)):
                f = module_file(mod).relative_to(ROOT).as_posix()
                if not any(f == d or f.startswith(d + "/") for d in deps):
                    missing.setdefault(name, []).append(f)
        assert not missing, f"{pipeline} misses code deps (`python scripts/code_deps.py --write`): " + "; ".join(
            f"{s}: {', '.join(fs)}" for s, fs in missing.items())


def test_the_code_deps_are_exactly_what_each_command_runs():
    """No stale dep either: a module a stage no longer runs would re-run it for nothing (and a moved one
    would name a path that is gone)."""
    for pipeline in PIPELINES:
        stages = yaml.safe_load((ROOT / pipeline).read_text())["stages"]
        for name, command in stage_commands(pipeline).items():
            listed = sorted(str(d if isinstance(d, str) else next(iter(d))).rstrip("/") for d in stages[name].get("deps", [])
                            if str(d if isinstance(d, str) else next(iter(d))).startswith("evoharness/"))
            assert listed == code_deps(command), f"{pipeline}: {name}'s code deps are stale (`python scripts/code_deps.py --write`)"


def test_the_closure_follows_function_level_imports():
    mods = command_closure("grpo")
    assert {"evoharness.agent.training.grpo", "evoharness.agent.policies.batched", "evoharness.agent.policies.constrain", "evoharness.agent.harness.consolidate",
            "evoharness.agent.episode", "evoharness.agent.training.distributed"} <= mods
    assert "evoharness.agent.compare" not in mods and "evoharness.agent.collect" not in mods


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
