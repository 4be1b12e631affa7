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
import time
from pathlib import Path

import yaml

from evoharness.core.environment import machine
from evoharness.core.errors import EvoError
from evoharness.core.secrets import public_url
from evoharness.ops.remote import check_shared
from evoharness.ops.stagerun import (
    _MD5,
    StageResult,
    changes,
    clear_stale_locks,
    dirty_inputs,
    merge_lock_entry,
    push_run_cache,
    run_here,
    small_files,
    uncached_outs,
    under,
    upstream,
)
from evoharness.ops.vcs import check_remote, child_env, default_remote, dvc, git

WORKER_HOME = Path.home() / ".cache" / "evoharness" / "worker"


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

    env = child_env(GIT_TERMINAL_PROMPT="0")
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
    """The job inside its checkout, with the commit's own code (``evoharness.ops.stagejob`` runs it there):
    check the remote, install the orchestrator's lock, pull the inputs by hash, run, push."""
    import socket

    from evoharness.ops.remote import check_remote_writable

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
        env = child_env(PYTHONUNBUFFERED="1")
        env.pop("PYTHONPATH", None)  # the checkout's code, first on sys.path as the working directory of `-m`
        proc = subprocess.Popen([sys.executable, "-m", "evoharness.ops.stagejob", str(spec_f), str(result_f)], cwd=ws, env=env,
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
