"""dvc.lock's stages, their shape checked, and their entries (each output and dependency with its hash), as lineage,
records, stage runs and reproduction read them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from evoharness.core.errors import EvoError


@dataclass
class Out:
    stage: str
    path: str
    md5: str
    kind: str  # "out" or "dep"


def parse_lock(text: str, where: str | Path = "dvc.lock") -> dict:
    """dvc.lock's stages, its shape checked (DVC's own: stages of deps and outs, each a path with its hash):
    a file of another shape is one line naming it, never a traceback further on."""
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise EvoError(f"{where} is not valid YAML ({' '.join(str(e).split())})") from None

    def bad(why: str) -> EvoError:
        return EvoError(f"{where} is not a DVC lock file ({why}); restore it with `git checkout -- dvc.lock`")

    if not isinstance(data, dict):
        raise bad(f"{type(data).__name__} at the top level, not a mapping")
    stages = data.get("stages") or {}
    if not isinstance(stages, dict):
        raise bad(f"stages is {type(stages).__name__}, not a mapping")
    for name, st in stages.items():
        if not isinstance(st, dict):
            raise bad(f"stage {str(name)[:60]!r} is {type(st).__name__}, not a mapping")
        for kind in ("deps", "outs"):
            items = st.get(kind) or []
            if not isinstance(items, list) or not all(isinstance(o, dict) and isinstance(o.get("path"), str) for o in items):
                raise bad(f"stage {str(name)[:60]!r} has {kind} that are not a list of paths")
        if not isinstance(st.get("params") or {}, dict):
            raise bad(f"stage {str(name)[:60]!r} has params that are not a mapping")
    return stages


def lock_outs(stages: dict) -> list[Out]:
    res = []
    for name, st in stages.items():
        for kind in ("outs", "deps"):
            for o in st.get(kind, []) or []:
                res.append(Out(name, o["path"], str(o.get("md5", "")), kind[:-1]))
    return res
