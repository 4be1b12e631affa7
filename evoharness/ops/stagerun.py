"""DVC stages in this checkout: which are up to date (outputs left on the remote count while absent), run one here,
its dvc.lock entry, the stages upstream of it, and DVC's run-cache on the remote. Jobs in other checkouts: ``dispatch``."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from evoharness.core.environment import machine
from evoharness.core.errors import EvoError
from evoharness.core.secrets import redact
from evoharness.ops.lockfile import parse_lock
from evoharness.ops.vcs import check_remote, default_remote, dvc, dvc_config, git, unlock


@dataclass
class StageResult:
    stage: str
    ran: bool
    seconds: float
    entry: dict = field(default_factory=dict)
    where: str = "local"
    files: dict = field(default_factory=dict)  # a job's uncached outputs (metrics, plots), by path
    machine: str = ""  # the processor kind the stage ran on (``machine()``); empty when it did not run

    def hashes(self) -> dict[str, str]:
        return {f"{k[:-1]}:{o['path']}": o.get("md5", "") for k in ("deps", "outs") for o in self.entry.get(k, []) or []}


def stages(root: Path) -> list[str]:
    """The pipeline's stages in dvc.yaml order (which is a topological order)."""
    p = Path(root) / "dvc.yaml"
    if not p.exists():
        raise EvoError(f"{p} does not exist: not an EvoHarness project root")
    return list((yaml.safe_load(p.read_text()) or {}).get("stages", {}))


def lock_entry(root: Path, stage: str) -> dict:
    p = Path(root) / "dvc.lock"
    if not p.exists():
        return {}
    return parse_lock(p.read_text(), p).get(stage, {})


def merge_lock_entry(root: Path, stage: str, entry: dict) -> None:
    p = Path(root) / "dvc.lock"
    if p.exists():
        parse_lock(p.read_text(), p)  # a dvc.lock of another shape is refused, never merged into
    data = yaml.safe_load(p.read_text()) if p.exists() else None
    data = data or {"schema": "2.0", "stages": {}}
    data["stages"] = data.get("stages") or {}
    names = stages(root)
    data["stages"][stage] = entry
    data["stages"] = {k: data["stages"][k] for k in sorted(data["stages"], key=lambda s: names.index(s) if s in names else len(names))}
    tmp = p.with_suffix(".lock.tmp")
    tmp.write_text(yaml.safe_dump(data, sort_keys=False))
    tmp.replace(p)


def clear_stale_locks(root: Path) -> list[int]:
    """A DVC lock left by a dead process (a killed flow) blocks every later command; its holder
    is provably gone, so the entries are dropped. Live holders are kept."""
    return unlock(root)


def under(path: str, prefixes) -> bool:
    return any(path == p.rstrip("/") or path.startswith(p.rstrip("/") + "/") for p in prefixes)


def changes(root: Path, target: str, remote_only=()) -> dict:
    """``dvc status --json`` of a stage (or a dvc.yaml), less what is left on the remote on purpose: an output or
    dep under ``remote_only`` that is absent here altogether ("deleted", "not in cache"; a pool retrain never
    pulls the weights, ``pool.stay_on_remote``), and only while the remote still holds it: what was left out is
    looked up on the remote (``_not_on_remote``), and an object of it the remote lost counts again, as
    ``{"not on the remote": {path: "missing"}}``. A remote that cannot be asked stops with one line (fails closed).
    Anything else (a modified file, a file half there) still counts."""
    out = dvc(["status", target, "--json"], root)
    try:
        status = json.loads(out or "{}")
    except ValueError:
        return {"?": out}
    kept, left_out = {}, {}
    for name, items in status.items():
        left = []
        for item in items if isinstance(items, list) else [items]:
            if isinstance(item, dict):
                away = {path for paths in item.values() if isinstance(paths, dict) for path, state in paths.items()
                        if under(path, remote_only) and state in ("deleted", "not in cache") and not (Path(root) / path).exists()}
                if away:
                    left_out.setdefault(name, set()).update(away)
                item = {kind: {path: state for path, state in paths.items() if path not in away} if isinstance(paths, dict) else paths
                        for kind, paths in item.items()}
                item = {kind: paths for kind, paths in item.items() if paths}
                if not item:
                    continue
            left.append(item)
        if left:
            kept[name] = left
    if left_out:
        lost = _not_on_remote(root, set().union(*left_out.values()))
        for name, paths in left_out.items():
            gone = {f: "missing" for f, owner in lost.items() if owner in paths}
            if gone:
                kept.setdefault(name, []).append({"not on the remote": gone})
    return kept


def _not_on_remote(root: Path, paths: set[str]) -> dict[str, str]:
    """Of the outputs ``paths`` (each as dvc.lock records it): every object the default remote does not hold, as
    ``{path or path/file: owner}``. Asked of the remote itself, object by object (a directory's listing, then each
    file it names): ``dvc status --cloud`` takes a directory as there while its listing is, and reports nothing
    for one whose listing is gone. An output dvc.lock does not record, or a remote that cannot be asked, fails
    closed."""
    from dvc.fs import get_cloud_fs

    check_remote(root)
    lock = parse_lock((Path(root) / "dvc.lock").read_text()) if (Path(root) / "dvc.lock").exists() else {}
    hashes = {o["path"]: o.get("md5") for entry in lock.values() for o in entry.get("outs") or []}
    name, url = default_remote(root)
    try:
        cls, config, base = get_cloud_fs(dvc_config(root), name=name)
        fs = cls(**config)

        def obj(md5: str) -> str:
            return fs.join(base, "files", "md5", md5[:2], md5[2:])

        lost = {}
        for path in sorted(paths):
            md5 = hashes.get(path)
            if not md5:
                lost[path] = path  # left on the remote, but no stage of dvc.lock says what it should hold
            elif not fs.exists(obj(md5)):
                lost[path] = path
            elif md5.endswith(".dir"):
                for e in json.loads(fs.cat_file(obj(md5))):
                    if not fs.exists(obj(e["md5"])):
                        lost[f"{path}/{e['relpath']}"] = path
    except EvoError:
        raise
    except Exception as e:  # any plugin's error: refused credentials, an unreachable host, a listing that is not JSON
        raise EvoError(f"DVC remote {name!r} ({redact(url)}): cannot tell whether it holds {sorted(paths)} "
                       f"({type(e).__name__}: {redact(' '.join(str(e).split())[:200])})") from None
    return lost


def stage_up_to_date(root: Path, stage: str, remote_only=()) -> bool:
    """DVC finds the stage's deps, params and outputs here as its dvc.lock entry names them (those under
    ``remote_only`` may be on the remote only)."""
    if stage not in (parse_lock((Path(root) / "dvc.lock").read_text()) if (Path(root) / "dvc.lock").exists() else {}):
        return False
    return not {k for k in changes(root, stage, remote_only) if k == stage or k.endswith(f":{stage}")}


def up_to_date(root: Path, remote_only=()) -> bool:
    return changes(root, "dvc.yaml", remote_only) == {}  # the main pipeline (ablation/dvc.yaml runs apart)


def run_here(root: Path, stage: str) -> StageResult:
    """``dvc repro --single-item --pull <stage>``: DVC skips it when its deps, params and outs match, and
    restores it instead of running it when any machine ran it on these inputs before (its run-cache entry and
    outputs on the remote: ``push_run_cache``), pulling what it needs."""
    t0 = time.time()
    out = dvc(["repro", "--single-item", *(["--pull"] if run_cache_supported(root) else []), stage], root)
    ran = f"Running stage '{stage}'" in out
    return StageResult(stage, ran, round(time.time() - t0, 2), lock_entry(root, stage), machine=machine() if ran else "")


def run_cache_supported(root: Path) -> bool:
    """DVC keeps no run-cache on a plain HTTP remote (WebDAV, S3, SSH, local folders all do)."""
    found = default_remote(root)
    return found is not None and not found[1].startswith(("http://", "https://"))


def push_run_cache(root: Path, targets: list[str] | None = None) -> None:
    """Push the outputs (of ``targets``, default all) and the run-cache: each stage run's entry, so another
    machine restores the run instead of repeating it (``run_here``). DVC's ``push --run-cache`` leaves out the
    objects of an entry's ``cache: false`` outputs (the metrics it names), without which a restore fails as
    "missing cache files": those are sent too, from this cache to the default remote, by DVC's own transfer, in a
    process of its own run as every DVC command is (``vcs.dvc``: watched by the guards, its group killed with it)."""
    from evoharness.ops.vcs import python_module

    root = Path(root)
    if not run_cache_supported(root):
        dvc(["push", *(targets or [])], root)
        return
    dvc(["push", "--run-cache", *(targets or [])], root)
    python_module("evoharness.ops.stagerun", ["push-uncached-run-outputs", str(root)], root,
                  "pushing the run-cache's metrics objects")


def _push_uncached_run_outputs(root: Path) -> None:
    """``push_run_cache``'s second half, in its own process: the objects of the run-cache entries' ``cache: false``
    outputs that this cache holds, to the default remote."""
    from dvc.repo import Repo
    from dvc_data.hashfile.hash_info import HashInfo
    from dvc_data.hashfile.transfer import transfer

    uncached = {p for st in stages(root) for p in uncached_outs(root, st)}
    with Repo(str(root)) as repo:
        runs = Path(repo.cache.legacy.path) / "runs"
        wanted = set()
        for f in (runs.rglob("*") if runs.is_dir() else []):
            if not f.is_file():
                continue
            try:
                entry = yaml.safe_load(f.read_text()) or {}
            except (OSError, yaml.YAMLError):
                continue
            for o in entry.get("outs") or []:
                if isinstance(o, dict) and o.get("path") in uncached and _MD5.fullmatch(str(o.get("md5", ""))):
                    wanted.add(HashInfo("md5", o["md5"]))
        have = {h for h in wanted if repo.cache.local.exists(h.value)}
        try:
            failed = transfer(repo.cache.local, repo.cloud.get_remote_odb(None, "push"), have).failed if have else set()
        except Exception as e:  # noqa: BLE001 -- the remote's own error (network, credentials), as one line
            failed = {f"{type(e).__name__}: {redact(' '.join(str(e).split())[:200])}"}
        if failed:
            raise EvoError(f"{len(failed)} did not reach the remote ({sorted(map(str, failed))[0]})")


def producers(root: Path, stage: str) -> list[str]:
    """Stages whose outputs are this stage's deps, by dvc.yaml."""
    spec = (yaml.safe_load((Path(root) / "dvc.yaml").read_text()) or {}).get("stages", {})
    deps = [d if isinstance(d, str) else next(iter(d)) for d in spec.get(stage, {}).get("deps", [])]
    found = []
    for name, st in spec.items():
        if name == stage:
            continue
        outs = [o if isinstance(o, str) else next(iter(o)) for o in st.get("outs", [])]
        if any(d == o or d.startswith(o.rstrip("/") + "/") for d in deps for o in outs):
            found.append(name)
    return found


def upstream(root: Path, stage: str) -> list[str]:
    """Stages whose outputs are this stage's deps, each of which must have its dvc.lock entry already."""
    lock = parse_lock((Path(root) / "dvc.lock").read_text(), Path(root) / "dvc.lock") if (Path(root) / "dvc.lock").exists() else {}
    found = producers(root, stage)
    for name in found:
        if name not in lock:
            raise EvoError(f"stage {stage!r} needs {name!r}, which has no dvc.lock entry yet; run it first")
    return found


def uncached_outs(root: Path, stage: str) -> list[str]:
    """Outputs DVC does not cache (metrics, plots), so not on the remote: a job sends them along."""
    spec = (yaml.safe_load((Path(root) / "dvc.yaml").read_text()) or {}).get("stages", {}).get(stage, {})
    found = []
    for kind in ("outs", "metrics", "plots"):
        for o in spec.get(kind, []) or []:
            if isinstance(o, dict):
                path, opts = next(iter(o.items()))
                if opts and opts.get("cache") is False:
                    found.append(path)
    return found


SMALL = 1 << 20


def small_files(root: Path, stage: str) -> dict[str, str]:
    out = {}
    for path in uncached_outs(root, stage):
        f = Path(root) / path
        if f.is_file() and f.stat().st_size <= SMALL:
            out[path] = f.read_text()
    return out


def dirty_inputs(root: Path, stage: str) -> list[str]:
    """Uncommitted git-tracked files this stage depends on (code, params.yaml, dvc.yaml)."""
    spec = (yaml.safe_load((Path(root) / "dvc.yaml").read_text()) or {}).get("stages", {}).get(stage, {})
    deps = [d if isinstance(d, str) else next(iter(d)) for d in spec.get("deps", [])]
    status = git(["status", "--porcelain", "--", "params.yaml", "dvc.yaml", *[d for d in deps if not d.startswith("data/")]], root)
    return [line[3:] for line in status.splitlines() if line.strip()]


_MD5 = re.compile(r"[0-9a-f]{32}(\.dir)?")


if __name__ == "__main__":  # push_run_cache's own process: python -m evoharness.ops.stagerun push-uncached-run-outputs ROOT
    import sys

    if sys.argv[1:2] != ["push-uncached-run-outputs"] or len(sys.argv) != 3:
        raise SystemExit("usage: python -m evoharness.ops.stagerun push-uncached-run-outputs ROOT")
    try:
        _push_uncached_run_outputs(Path(sys.argv[2]))
    except Exception as e:  # noqa: BLE001 -- one line for the caller, whatever failed
        print(f"error: {e if isinstance(e, EvoError) else f'{type(e).__name__}: {redact(str(e))[:300]}'}", file=sys.stderr)
        raise SystemExit(1) from None
