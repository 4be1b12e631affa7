"""Which stage, params and inputs made an artifact (by path or DVC md5), from dvc.lock and, for a retrain, its git
record. Reproducing a past run lives in ``reproduce``."""

from __future__ import annotations

import json
import os
from pathlib import Path

from evoharness.core.errors import EvoError
from evoharness.ops.lockfile import lock_outs, parse_lock
from evoharness.ops.vcs import git, repo_root

# The identity a retrain's git record is committed as when none is configured here (a fresh server, a
# container, a CI runner): passed to each command in its environment, never written to any git config.


# ---- dvc.lock -----------------------------------------------------------------------------------


def lineage(target: str, root: Path, echo=print) -> dict:
    """Which stage, params and inputs produced an artifact (a path or an md5 hash), recursively."""
    root = repo_root(root)
    lock_path = root / "dvc.lock"
    if not lock_path.exists():
        raise EvoError(f"{lock_path} does not exist: run the pipeline first")
    stages = parse_lock(lock_path.read_text(), lock_path)
    commit = None
    t = target.rstrip("/")
    cand, cwd = Path(t), Path.cwd().resolve()
    if cand.is_absolute():
        rel = os.path.relpath(cand, root)
    elif cwd != root and cwd.is_relative_to(root) and (cwd / cand).exists():
        rel = os.path.relpath(cwd / cand, root)  # a path given from a subfolder of the repo
    else:
        rel = t  # repo-relative
    hit = None
    for o in lock_outs(stages):
        if o.kind != "out":
            continue
        if rel == o.path or rel.startswith(o.path.rstrip("/") + "/") or (len(t) >= 6 and o.md5.removesuffix(".dir").startswith(t.removesuffix(".dir"))):
            hit = o
            break
    looks_like_hash = len(t) >= 6 and all(c in "0123456789abcdef" for c in t.lower().removesuffix(".dir"))
    if hit is None and looks_like_hash:
        from evoharness.ops.records import find_record

        commit, _ = find_record(t, root)
        text = git(["show", f"{commit}:dvc.lock"], root)
        stages = parse_lock(text)
        hit = next((o for o in lock_outs(stages) if o.kind == "out" and o.md5.removesuffix(".dir").startswith(t.removesuffix(".dir"))), None)
    if hit is None:
        raise EvoError(f"{target!r} is not an output of any stage in {lock_path} (nor a hash in its history)")
    producers = {o.path: o.stage for o in lock_outs(stages) if o.kind == "out"}
    chain, seen, todo = [], set(), [hit.stage]
    while todo:
        s = todo.pop(0)
        if s in seen:
            continue
        seen.add(s)
        st = stages[s]
        deps = [{"path": d["path"], "md5": d.get("md5"), "from_stage": producers.get(d["path"])} for d in st.get("deps") or []]
        chain.append({"stage": s, "cmd": st.get("cmd"), "params": st.get("params", {}), "deps": deps,
                      "outs": [{"path": o["path"], "md5": o.get("md5")} for o in st.get("outs") or []]})
        todo += [d["from_stage"] for d in deps if d["from_stage"]]
    echo(f"{target} <- stage {hit.stage} (md5 {hit.md5})" + (f" at commit {commit[:12]}" if commit else ""))
    for c in chain:
        echo(f"  stage {c['stage']}: {c['cmd']}")
        for pfile, vals in (c["params"] or {}).items():
            for k, v in vals.items():
                echo(f"    param {k} = {json.dumps(v)}  ({pfile})")
        for d in c["deps"]:
            src = f"  <- stage {d['from_stage']}" if d["from_stage"] else ""
            echo(f"    dep   {d['path']}  {d['md5']}{src}")
        for o in c["outs"]:
            echo(f"    out   {o['path']}  {o['md5']}")
    return {"target": target, "stage": hit.stage, "chain": chain, "commit": commit}
