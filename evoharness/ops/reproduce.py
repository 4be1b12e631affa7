"""Reproduce any retrain on any machine from its git record (``records``) and its hashes.

``reproduce`` restores a record in a scratch worktree, checks that this environment is the one the
record's ``constraints.txt`` pins (or builds that environment, or refuses in one line), pulls every
recorded output from the remote, and re-runs each stage on the recorded inputs, comparing what it
makes with what was recorded, output by output: a stage that does not reproduce is named as itself,
not through the stages after it.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from evoharness.core.environment import SETUP_OPTION, environment_file, installed, lock_of
from evoharness.core.errors import EvoError
from evoharness.ops.records import RECORD_PREFIX, SHA, find_record, record_ref
from evoharness.ops.lockfile import parse_lock
from evoharness.ops.vcs import child_env, dvc, git, repo_root

# Metrics a stage may report differently on a rerun when its output is not bitwise identical
# (README, "Reproduce"): success rates and the like agree within this absolute tolerance.
METRIC_TOLERANCE = 0.05


def _pins(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line and not line.startswith("-"):
            name, ver = line.split("==", 1)
            out[name.strip().lower().replace("_", "-")] = ver.strip()
    return out


def environment_mismatch(commit: str, root: Path, python: str = sys.executable, lock: str | None = None) -> str | None:
    """The first package whose installed version (in ``python``'s environment) differs from what the
    commit's constraints file for that kind of environment (``lock``: by default the one ``python``'s
    environment is, ``environment_file``) pins, as one line; None when they all match."""
    have = installed(python)
    lock = lock or lock_of(have)
    r = subprocess.run(["git", "show", f"{commit}:{lock}"], cwd=root, capture_output=True, text=True)
    if r.returncode:
        return f"commit {commit[:12]} has no {lock}, so its environment is not known"
    pins = _pins(r.stdout)
    for name, want in sorted(pins.items()):
        got = have.get(name)
        if got is None or got.split("+")[0] != want.split("+")[0]:
            return f"commit {commit[:12]} pins {name}=={want} ({lock}), the environment of {python} has {name}=={got or 'nothing'}"
    return None


def _build_env(work: Path, echo, lock: str = "constraints.txt") -> str:
    """The record's own environment of the kind ``lock`` pins, built by its own scripts/setup.sh in the
    scratch worktree."""
    option = SETUP_OPTION.get(lock, [])
    echo(f"building the record's environment ({lock}) with its scripts/setup.sh {' '.join(option)} in {work} (minutes)")
    r = subprocess.run(["bash", "scripts/setup.sh", *option], cwd=work, capture_output=True, text=True, env=child_env())
    if r.returncode:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        raise EvoError(f"cannot build the record's environment (scripts/setup.sh in {work} failed: {tail[0][:300]})")
    return str(work / (".venv-vllm" if option == ["--vllm-cpu"] else ".venv") / "bin" / "python")


def stage_environment(work: Path, stage: str) -> str | None:
    """The constraints file of the environment a recorded stage ran in (its metrics' ``launch.environment``:
    training stages record it); None when the record does not say."""
    import yaml

    try:
        doc = yaml.safe_load((work / "dvc.yaml").read_text())["stages"][stage]
        metrics = [next(iter(m)) if isinstance(m, dict) else m for m in doc.get("metrics") or []]
    except (OSError, KeyError, TypeError):
        return None
    for m in metrics:
        try:
            env = (json.loads((work / m).read_text()).get("launch") or {}).get("environment")
        except (OSError, ValueError, AttributeError):
            continue
        if env:
            return env
    return None


def _numbers(path: Path) -> dict[str, float]:
    from evoharness.ops.tracking import flatten

    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in flatten(data).items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def reproduce(ref: str, root: Path, echo=print, keep: bool = False, setup: bool = True,
              stages: list[str] | None = None) -> list[dict]:
    """Reproduce a record here (see the module's docstring). One row per recorded output: stage, path,
    recorded and reproduced md5, and whether they match (or, for a metrics file that is not identical,
    the largest difference among its numbers). ``stages`` re-runs only those (each still on its
    recorded inputs); every recorded output is pulled either way."""
    import yaml

    root = repo_root(root)
    t0 = time.time()
    from evoharness.core.environment import machine

    commit, how = find_record(ref, root)
    if how.startswith("the record of MLflow run"):  # the record must be the one the run itself named
        from evoharness.ops.records import run_tags

        run_id = ref.strip().removeprefix(RECORD_PREFIX)
        named = (run_tags(run_id, root) or {}).get("git_record_commit")
        if named and named != commit:
            raise EvoError(f"the record {record_ref(run_id)} names commit {commit[:12]}, but MLflow run {run_id} recorded {named[:12]}; "
                           "the tag was moved: nothing is reproduced")
    echo(f"reproducing {commit[:12]}: {how}; on {machine()}")
    python = sys.executable
    if not SHA.fullmatch(commit):  # resolved above to a commit id; anything else never reaches git as an argument
        raise EvoError(f"reproduce: {commit[:60]!r} is not a commit id; nothing is reproduced")
    work = Path(tempfile.mkdtemp(prefix="evoharness-repro-")) / "repo"
    git(["worktree", "add", "--detach", str(work), commit], root)
    try:
        why = environment_mismatch(commit, root, python)
        if why:
            if not setup:
                raise EvoError(f"{why}; reproduce without --no-setup builds that environment, or run it from a checkout set up at {commit[:12]}")
            python = _build_env(work, echo, environment_file(python))
            still = environment_mismatch(commit, root, python)
            if still:
                raise EvoError(f"the environment built for {commit[:12]} still differs: {still}")
        src = root / ".dvc" / "config.local"  # this machine's own credentials for the remote
        if src.exists():
            shutil.copy(src, work / ".dvc" / "config.local")
        lock = work / "dvc.lock"
        if not lock.exists():
            raise EvoError(f"commit {commit[:12]} has no dvc.lock to reproduce")
        recorded_text = lock.read_text()
        recorded = parse_lock(recorded_text)
        order = [s for s in (yaml.safe_load((work / "dvc.yaml").read_text()) or {}).get("stages", {}) if s in recorded]
        chosen = order
        if stages:
            unknown = [x for x in stages if x not in order]
            if unknown:
                raise EvoError(f"commit {commit[:12]} recorded no stage {', '.join(unknown)}; its stages: {', '.join(order)}")
            chosen = [x for x in order if x in stages]
        here = environment_file(python)
        for stage in chosen:  # a stage runs again in the kind of environment it ran in (the GPU box's pins vLLM and its torch)
            ran = stage_environment(work, stage)
            if ran and ran != here:
                raise EvoError(f"stage {stage} of {commit[:12]} ran in the environment {ran} pins; this one is {here}'s: reproduce it "
                               f"there (`bash scripts/setup.sh {' '.join(SETUP_OPTION.get(ran, []))}`), or leave it out with --stage")
        try:
            dvc(["pull", *order], work, python)
        except EvoError as e:
            raise EvoError(f"cannot pull the data {commit[:12]} recorded: {e}") from None
        echo(f"pulled every recorded output of {len(order)} stages")
        rows = []
        for stage in chosen:
            t = time.time()
            lock.write_text(recorded_text)  # the recorded inputs, whatever earlier stages reproduced
            dvc(["checkout", "--force", *order], work, python)
            dvc(["repro", "--single-item", "--force", stage], work, python)
            got = {o["path"]: o.get("md5") for o in (parse_lock(lock.read_text()).get(stage, {}).get("outs") or [])}
            for o in recorded[stage].get("outs") or []:
                row = {"stage": stage, "path": o["path"], "expected": o.get("md5"), "got": got.get(o["path"]), "seconds": round(time.time() - t, 1)}
                row["match"] = row["expected"] == row["got"]
                if not row["match"] and o["path"].endswith(".json") and (work / o["path"]).is_file():
                    old = _numbers_at(work, commit, o["path"])
                    new = _numbers(work / o["path"])
                    keys = old.keys() & new.keys()
                    diffs = [abs(old[k] - new[k]) for k in keys if math.isfinite(old[k]) and math.isfinite(new[k])]
                    row["metric_diff"] = round(max(diffs), 4) if diffs else None
                rows.append(row)
        lock.write_text(recorded_text)
        w = max(len(r["path"]) for r in rows) if rows else 10
        echo(f"{'stage':<13} {'output':<{w}} {'recorded':<36} {'reproduced':<36} match")
        for r in rows:
            verdict = "yes" if r["match"] else (f"no (metrics within {r['metric_diff']})" if r.get("metric_diff") is not None else "NO")
            echo(f"{r['stage']:<13} {r['path']:<{w}} {str(r['expected']):<36} {str(r['got']):<36} {verdict}")
        echo(f"reproduced {sum(r['match'] for r in rows)} of {len(rows)} outputs identically in {time.time() - t0:.0f} s")
        if any(not r["match"] and r.get("metric_diff") is None for r in rows):
            echo("CPU training is bit-exact only on the processor kind that recorded it: compare this machine with the `machine` "
                 "tag of the recording run's stages in MLflow")
        return rows
    finally:
        if not keep:
            git(["worktree", "remove", "--force", str(work)], root, check=False)
            shutil.rmtree(work.parent, ignore_errors=True)


def _numbers_at(work: Path, commit: str, path: str) -> dict[str, float]:
    """A recorded metrics file's numbers (from the record's commit: metrics are not in DVC's cache)."""
    r = subprocess.run(["git", "show", f"{commit}:{path}"], cwd=work, capture_output=True, text=True)
    if r.returncode:
        return {}
    tmp = Path(tempfile.mkdtemp()) / "m.json"
    tmp.write_text(r.stdout)
    try:
        return _numbers(tmp)
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)
