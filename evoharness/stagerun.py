"""Run one DVC stage here, or as a job in a clean checkout of a commit (what a pool worker does),
and bring a job's outputs back by hash. No Prefect here: flows/ and tasks/ wrap these calls.

A job needs nothing of the orchestrator's machine. It clones the repository from its git origin
(once per repository and stage, under the worker's own home, so checkpoints survive for resume),
checks out the dispatched commit, installs the orchestrator's ``dvc.lock``, pulls the stage's inputs
by those hashes from the DVC remote the commit's ``.dvc/config`` names (with the worker's own
credentials for it), runs the stage (the profile's launcher applies, e.g. ``accelerate launch``),
pushes its outputs, and returns the stage's new ``dvc.lock`` entry. The orchestrator merges that
entry into its own lock and pulls the outputs it names: the hashes decide what arrives, never a path.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from evoharness.errors import EvoError
from evoharness.lineage import check_remote, check_shared, default_remote, dvc, git, parse_lock, unlock
from evoharness.secrets import public_url, redact

WORKER_HOME = Path.home() / ".cache" / "evoharness" / "worker"


def machine() -> str:
    """The processor (and GPUs) this process runs on, as a tag: CPU training is bit-exact only between
    machines of one kind (the matrix kernels differ by vector unit), so a run that does not reproduce a
    hash names the kind it ran on. Read from /proc/cpuinfo and ``nvidia-smi``; "unknown" where neither says.
    ``EVOHARNESS_MACHINE``, when set, is put first: a name the hardware cannot give (an instance type, a box)."""
    import platform
    import shutil
    import subprocess

    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            if k.strip() in ("vendor_id", "cpu family", "model", "model name", "flags") and k.strip() not in info:
                info[k.strip()] = v.strip()
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "avx" if "avx" in flags else (platform.machine() or "unknown")
    cpu = (f"{info.get('model name', platform.processor() or 'unknown')} (family {info.get('cpu family', '?')} model {info.get('model', '?')}, "
           f"{isa}, {os.cpu_count()} cores)") if info else f"{platform.processor() or platform.machine() or 'unknown'} ({os.cpu_count()} cores)"
    gpus = ""
    if shutil.which("nvidia-smi"):
        try:
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.split("\n")
            names = [n.strip() for n in names if n.strip()]
            gpus = f"; {len(names)}x {names[0]}" if names else ""
        except (OSError, subprocess.SubprocessError):
            gpus = "; nvidia-smi did not answer"
    label = os.environ.get("EVOHARNESS_MACHINE", "").strip()
    return f"{label}: {cpu}{gpus}" if label else cpu + gpus


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
    pulls the weights, ``pool.stay_on_remote``). Anything else (a modified file, a file half there) still counts."""
    out = dvc(["status", target, "--json"], root)
    try:
        status = json.loads(out or "{}")
    except ValueError:
        return {"?": out}
    kept = {}
    for name, items in status.items():
        left = []
        for item in items if isinstance(items, list) else [items]:
            if isinstance(item, dict):
                item = {kind: {path: state for path, state in (paths or {}).items()
                               if not (under(path, remote_only) and state in ("deleted", "not in cache") and not (Path(root) / path).exists())}
                        if isinstance(paths, dict) else paths for kind, paths in item.items()}
                item = {kind: paths for kind, paths in item.items() if paths}
                if not item:
                    continue
            left.append(item)
        if left:
            kept[name] = left
    return kept


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
    "missing cache files": those are sent here, from this cache to the default remote, by DVC's own transfer."""
    root = Path(root)
    if not run_cache_supported(root):
        dvc(["push", *(targets or [])], root)
        return
    dvc(["push", "--run-cache", *(targets or [])], root)
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
            raise EvoError(f"pushing the run-cache's metrics objects from {root}: {len(failed)} did not reach the remote "
                           f"({sorted(map(str, failed))[0]})")


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


def job_spec(root: Path, stage: str, what: str = "pool") -> dict:
    """What a worker on another machine needs to run a stage: the git origin to clone, the commit,
    the lock, the DVC remote's name. Refused in one line when another machine could not use them
    (``lineage.check_shared``). Nothing in it is a path or a credential of this machine."""
    root = Path(root)
    dirty = dirty_inputs(root, stage)
    if dirty:
        raise EvoError(f"cannot dispatch stage {stage!r}: uncommitted changes in {', '.join(dirty)} (the worker runs commit HEAD); commit them first")
    origin, commit, remote = check_shared(root, what)
    lock = (root / "dvc.lock").read_text() if (root / "dvc.lock").exists() else ""
    return {"stage": stage, "repo": public_url(origin), "commit": commit, "lock": lock, "remote": remote}


def push_inputs(root: Path, stage: str) -> list[str]:
    ups = upstream(root, stage)
    if ups:
        dvc(["push", *ups], root)
    return ups


def workspace(repo: str, stage: str, home: Path | None = None) -> Path:
    key = hashlib.sha256(repo.encode()).hexdigest()[:12]
    return Path(home or os.environ.get("EVOHARNESS_WORKER_HOME") or WORKER_HOME) / key / stage


# git's askpass program for an HTTPS origin's token: it answers from the environment of the one git command
# that needs it, so the token is never in a URL, a git config, a process's arguments or a log line.
_ASKPASS = """#!/bin/sh
case "$1" in
  Username*) printf '%s\\n' "${EVOHARNESS_GIT_USER:-x-access-token}" ;;
  *) printf '%s\\n' "$EVOHARNESS_GIT_TOKEN" ;;
esac
"""


@contextlib.contextmanager
def git_credentials(token: str | None):
    """The environment for git commands that reach the origin: with ``token`` (``TOKEN`` or ``USER:TOKEN``, as
    Prefect's git_clone step reads the same secret), git asks ``_ASKPASS`` for the password (the user: the
    token's, else the URL's, else ``x-access-token``, as GitHub and GitLab accept); git never prompts."""
    import tempfile

    env = dict(os.environ, GIT_TERMINAL_PROMPT="0")
    if not token:
        yield env
        return
    with tempfile.TemporaryDirectory(prefix="evoharness-askpass-") as d:
        helper = Path(d) / "askpass"
        helper.write_text(_ASKPASS)
        helper.chmod(0o700)
        user, _, secret = token.partition(":") if ":" in token else ("", "", token)
        yield {**env, "GIT_ASKPASS": str(helper), "EVOHARNESS_GIT_TOKEN": secret, **({"EVOHARNESS_GIT_USER": user} if user else {})}


def checkout(spec: dict, home: Path | None = None, echo=print, token: str | None = None) -> Path:
    """The worker's workspace for the stage, at the dispatched commit itself (fetched from the origin;
    never the default branch's HEAD), cleaned of everything but checkpoints, models and DVC's cache.
    ``token``: an HTTPS origin's access token (the job reads it from a Prefect Secret block)."""
    import socket

    stage, repo, commit = spec["stage"], spec["repo"], spec["commit"]
    ws = workspace(repo, stage, home)
    with git_credentials(token) as env:
        if not (ws / ".git").exists():
            ws.parent.mkdir(parents=True, exist_ok=True)
            git(["clone", "-q", "--no-checkout", repo, str(ws)], ws.parent, env=env)
        else:
            git(["remote", "set-url", "origin", repo], ws)
            git(["fetch", "-q", "origin"], ws, env=env)
    git(["checkout", "-q", "--force", "--detach", commit], ws)
    git(["clean", "-q", "-fdx", "-e", "data/checkpoints", "-e", ".dvc/config.local", "-e", ".dvc/cache", "-e", ".dvc/tmp", "-e", "models"], ws)
    if git(["rev-parse", "HEAD"], ws) != commit:
        raise EvoError(f"{stage} on {socket.gethostname()}: the workspace {ws} is not at the dispatched commit {commit[:12]} after its checkout")
    echo(f"{stage}: checked out {commit[:12]} of {repo} in {ws} on {socket.gethostname()}")
    return ws


@contextlib.contextmanager
def workspace_lock(ws: Path, echo=print):
    """This box's hold on the stage's workspace: an exclusive ``flock`` on a file beside it, so two jobs of
    one stage on one box take turns. It is local on purpose: it needs no server (a Prefect outage cannot
    take it away) and the kernel drops it when its holder dies (nothing to expire)."""
    import fcntl

    path = Path(ws).parent / f".{Path(ws).name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            echo(f"waiting for the workspace {ws}: another job of this stage runs on this box")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield path
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_checked_out(spec: dict, ws: Path, echo=print) -> StageResult:
    """The job inside its checkout, with the commit's own code (``evoharness.stagejob`` runs it there):
    check the remote, install the orchestrator's lock, pull the inputs by hash, run, push."""
    import socket

    from evoharness.preflight import check_remote_writable

    stage, commit = spec["stage"], spec["commit"]
    host = socket.gethostname()
    t0 = time.time()
    found = default_remote(ws)
    if found is None or found[0] != spec["remote"]:
        raise EvoError(f"{stage}: commit {commit[:12]} names DVC remote {found[0] if found else 'none'!r}, the orchestrator {spec['remote']!r}")
    try:
        check_remote(ws)
        check_remote_writable(ws)  # with this box's own credentials: a write, a read and a delete
    except EvoError as e:
        raise EvoError(f"{stage} on worker {host}: {e}") from None
    clear_stale_locks(ws)  # a job killed here before (its worker died) left DVC's lock behind
    shared_cache = ws.parent / "dvc-cache"
    dvc(["cache", "dir", "--local", str(shared_cache)], ws)
    if spec["lock"].strip():
        (ws / "dvc.lock").write_text(spec["lock"])
    else:  # the first stage of a pipeline: no lock yet (DVC refuses an empty one)
        (ws / "dvc.lock").unlink(missing_ok=True)
    ups = upstream(ws, stage)
    if ups:
        dvc(["pull", *ups], ws)
    echo(f"{stage}: pulled the outputs of {', '.join(ups) or 'nothing'} by hash from remote {spec['remote']!r}")
    res = run_here(ws, stage)
    push_run_cache(ws, [stage])  # its outputs and its run-cache entry: another box restores this run instead of repeating it
    echo(f"{stage}: {'ran' if res.ran else 'was up to date'} in {res.seconds:.1f} s and pushed its outputs")
    return StageResult(stage, res.ran, round(time.time() - t0, 2), res.entry, where=f"job on {host}", files=small_files(ws, stage), machine=res.machine)


_MD5 = re.compile(r"[0-9a-f]{32}(\.dir)?")


def check_lock_entry(root: Path, stage: str, entry) -> None:
    """A job's returned lock entry is untrusted input: its shape is DVC's, its command is the stage's own, and
    every path it names is inside the repository (its outputs exactly the stage's declared ones)."""
    def bad(why: str) -> EvoError:
        return EvoError(f"job for stage {stage!r} returned a dvc.lock entry that {why}; nothing was merged")

    if not isinstance(entry, dict) or set(entry) - {"cmd", "deps", "params", "outs"}:
        raise bad("is not a DVC lock entry (keys cmd, deps, params, outs)")
    spec = (yaml.safe_load((Path(root) / "dvc.yaml").read_text()) or {}).get("stages", {}).get(stage, {})
    if entry.get("cmd") != spec.get("cmd"):
        raise bad("names another command than dvc.yaml's")
    declared = set()
    for kind in ("outs", "metrics", "plots"):
        declared |= {o if isinstance(o, str) else next(iter(o)) for o in spec.get(kind) or []}
    for kind in ("deps", "outs"):
        items = entry.get(kind) or []
        if not isinstance(items, list):
            raise bad(f"has {kind} that are not a list")
        for o in items:
            path = o.get("path") if isinstance(o, dict) else None
            if not isinstance(path, str) or not path or Path(path).is_absolute() or ".." in Path(path).parts:
                raise bad(f"names a path outside the repository in its {kind} ({str(path)[:80]!r})")
            if "md5" in o and not (isinstance(o["md5"], str) and _MD5.fullmatch(o["md5"])):
                raise bad(f"has an md5 that is not one in its {kind} ({str(o['md5'])[:40]!r})")
            if kind == "outs" and path not in declared:
                raise bad(f"names output {path!r}, which dvc.yaml does not declare for the stage")
    if not isinstance(entry.get("params", {}), dict):
        raise bad("has params that are not a mapping")


def receive(root: Path, stage: str, entry: dict, files: dict[str, str] | None = None, remote_only=()) -> dict[str, str]:
    """Record a job's lock entry here and pull its outputs by the hashes it names (all but those under
    ``remote_only``: they stay on the remote); then DVC must agree the stage is up to date (same commit, same
    inputs), else the job ran something else."""
    check_lock_entry(root, stage, entry)
    if not entry.get("outs"):
        raise EvoError(f"job for stage {stage!r} returned no outputs in its dvc.lock entry")
    uncached = uncached_outs(root, stage)
    for path, text in (files or {}).items():
        if path not in uncached:
            raise EvoError(f"job for stage {stage!r} sent {path!r}, which is not one of its uncached outputs")
        (Path(root) / path).parent.mkdir(parents=True, exist_ok=True)
        (Path(root) / path).write_text(text)
    merge_lock_entry(root, stage, entry)
    wanted = [o["path"] for o in entry["outs"] if o["path"] not in uncached and not under(o["path"], remote_only)]
    if wanted:
        dvc(["pull", *wanted], root)
    changed = {k: v for k, v in changes(root, stage, remote_only).items() if k == stage or k.endswith(f":{stage}")}
    if changed:
        raise EvoError(f"stage {stage!r}: the job's outputs do not match this checkout ({json.dumps(changed)[:300]}); was the job run on another commit?")
    return {o["path"]: o.get("md5", "") for o in entry["outs"]}


def run_in_checkout(spec: dict, ws: Path, time_limit_s: float, fenced=lambda: None, echo=print, poll_s: float = 1.0) -> StageResult:
    """Run the job (``run_checked_out``) in a subprocess started in the checkout, so the dispatched
    commit's own code runs it, not the worker's copy. The subprocess and everything it starts (DVC, the
    launcher, the training processes) form one process group, killed as a whole when the stage passes
    its time limit, when ``fenced()`` says this box lost the orchestrator (returns why), and whenever this
    process leaves early (a cancellation). A job whose driver is killed outright kills its own group too
    (``stagejob`` watches its parent)."""
    import signal
    import subprocess
    import sys
    import tempfile
    import threading

    stage = spec["stage"]
    with tempfile.TemporaryDirectory(prefix=f"evoharness-job-{stage}-") as d:
        spec_f, result_f = Path(d) / "spec.json", Path(d) / "result.json"
        spec_f.write_text(json.dumps(spec))
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("PYTHONPATH", None)  # the checkout's code, first on sys.path as the working directory of `-m`
        proc = subprocess.Popen([sys.executable, "-m", "evoharness.stagejob", str(spec_f), str(result_f)], cwd=ws, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        tail: list[str] = []

        def relay() -> None:
            for line in proc.stdout:
                tail[:] = (tail + [line.rstrip()])[-20:]
                echo(line.rstrip())

        reader = threading.Thread(target=relay, daemon=True)
        reader.start()
        t0, why = time.monotonic(), None
        try:
            while proc.poll() is None:
                if time.monotonic() - t0 > time_limit_s:
                    why = f"ran past its time limit of {time_limit_s:.0f} s"
                else:
                    why = fenced()
                if why:
                    break
                time.sleep(poll_s)
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # whatever the job started and left behind
            reader.join(5)
        if why:
            raise EvoError(f"stage {stage!r} on {machine()}: {why}; its processes were killed")
        if proc.returncode or not result_f.exists():
            last = next((ln for ln in reversed(tail) if ln.strip()), f"exit status {proc.returncode}")
            raise EvoError(last[len("error: "):] if last.startswith("error: ") else f"stage {stage!r}: the job ended with exit status {proc.returncode} ({last[:300]})")
        return StageResult(**json.loads(result_f.read_text()))
