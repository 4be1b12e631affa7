"""DVC owns lineage: run DVC for the project, say which stage/params/inputs made an artifact, check
what another machine can reach (the git origin, the DVC remote). Reproducing a past run lives in
``evoharness.reproduce``.

DVC is run as ``python -m dvc`` with the virtualenv's ``bin`` first on PATH, so stage commands
(``python -m evoharness.cli ...``) use this environment and, run from a worktree's root, import
that worktree's code.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import yaml

from evoharness.errors import EvoError
from evoharness.secrets import redact

DEFAULT_REMOTE = Path.home() / ".cache" / "evoharness" / "dvc-remote"


def _env(python: str | None = None) -> dict:
    env = dict(os.environ)
    env["PATH"] = str(Path(python or sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env.setdefault("GX_ANALYTICS_ENABLED", "false")
    env["DVC_NO_ANALYTICS"] = "1"
    return env


def _last_error(text: str) -> str:
    """The most specific reason in a failed command's output: a stage's own ``error: ...`` line
    (our CLI's), else DVC's last ``ERROR: ...`` line, else the last line."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if any("no default remote set" in ln for ln in lines):
        return "no DVC remote is configured (no default remote set); set one with `evoharness remote --url PATH_OR_URL`"
    for prefix in ("error:", "ERROR:", "fatal:"):
        for i in range(len(lines) - 1, -1, -1):
            if lines[i].startswith(prefix):
                msg = lines[i].split(":", 1)[1].strip()
                if msg.endswith(":"):  # DVC continues a message on the next lines (targets, reasons)
                    more = [ln for ln in lines[i + 1 : i + 5] if not ln.startswith("<")]
                    msg = f"{msg} {', '.join(more)}"
                return msg
    return lines[-1] if lines else "no output"


def git(args: list[str], cwd: Path, check: bool = True, env: dict | None = None) -> str:
    try:
        r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=env)
    except FileNotFoundError:
        raise EvoError("git is not installed (not on PATH): the project is a git repository and every retrain is recorded in git; "
                       "install it (`apt-get install git`)") from None
    if check and r.returncode != 0:
        raise EvoError(redact(f"git {' '.join(args)} in {cwd}: {_last_error(r.stderr or r.stdout)}"))
    return r.stdout.strip()


# The identity a retrain's git record is committed as when none is configured here (a fresh server, a
# container, a CI runner): passed to each command in its environment, never written to any git config.
RECORD_NAME, RECORD_EMAIL = "evoharness", "retrain@localhost"
_EMAIL_VARS = ("GIT_AUTHOR_EMAIL", "GIT_COMMITTER_EMAIL", "EMAIL")


def record_identity(root: Path) -> tuple[dict[str, str], str]:
    """(environment variables, who) for committing a retrain's record in ``root``. A configured identity
    (an email in git's config or in the environment, and git able to form the author and committer from
    it, as ``git commit`` would) is used as it is; otherwise ``evoharness <retrain@localhost>``, never one
    git guessed from the host's name."""
    def var(name: str) -> str | None:
        r = subprocess.run(["git", "var", name], cwd=root, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None

    configured = bool(git(["config", "user.email"], root, check=False)) or any(os.environ.get(v, "").strip() for v in _EMAIL_VARS)
    if configured:
        author, committer = var("GIT_AUTHOR_IDENT"), var("GIT_COMMITTER_IDENT")
        if author and committer:
            return {}, committer.rsplit(">", 1)[0] + "> (the git identity configured here)"
    env = {"GIT_AUTHOR_NAME": RECORD_NAME, "GIT_AUTHOR_EMAIL": RECORD_EMAIL, "GIT_COMMITTER_NAME": RECORD_NAME, "GIT_COMMITTER_EMAIL": RECORD_EMAIL}
    return env, f"{RECORD_NAME} <{RECORD_EMAIL}> (no git identity is configured here)"


def dvc_config(root: Path):
    """The repository's DVC config, merged over every level (system, global, repo, local) by DVC's own
    loader in this process; an invalid one is one line naming the folder."""
    from dvc.config import Config, ConfigError

    dvc_dir = Path(root) / ".dvc"
    try:
        return Config(dvc_dir=str(dvc_dir))
    except ConfigError as e:
        raise EvoError(f"DVC config in {dvc_dir} is invalid: {' '.join(str(e).split())}") from None


def default_remote(root: Path) -> tuple[str, str] | None:
    """(name, url) of the default remote, or None. Read with DVC's own config loader (every level:
    system, global, repo, local) in this process: two ``dvc`` subprocesses cost about 1.6 s here."""
    if not (Path(root) / ".dvc").is_dir():
        return None
    conf = dvc_config(root)
    dvc_dir = Path(root) / ".dvc"
    name = (conf.get("core") or {}).get("remote") or ""
    if not name:
        return None
    remote = (conf.get("remote") or {}).get(name)
    if remote is None:
        raise EvoError(f"DVC default remote {name!r} is not defined in {dvc_dir}/config or config.local")
    return name, str(remote.get("url", ""))  # DVC's loader already made a relative local path absolute


def ensure_verify(root: Path) -> None:
    """Every pull re-hashes what it downloads (DVC's ``verify``; off by default for most remotes): a remote
    object whose bytes do not match its name fails the pull instead of landing in the workspace. Set in
    ``.dvc/config.local`` when no level of the config sets it, so a committed config cannot turn it off
    for this checkout by leaving it out."""
    found = default_remote(root)
    if found is None:
        return
    name = found[0]
    conf = dvc_config(root)
    if (conf.get("remote") or {}).get(name, {}).get("verify") is True:
        return
    with conf.edit("local") as local:
        local.setdefault("remote", {}).setdefault(name, {})["verify"] = True


NETWORK_SCHEMES = ("s3", "gs", "gcs", "azure", "ssh", "sftp", "webdav", "webdavs", "http", "https", "hdfs", "oss", "git")


def is_network_url(url: str) -> bool:
    """A URL another machine can resolve: a network scheme, or git's ``user@host:path``. A folder
    path or ``file://`` names this machine's disk only."""
    url = url.strip()
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme:
        return scheme in NETWORK_SCHEMES
    head = url.split("/", 1)[0]
    return "@" in head and ":" in head  # scp-like git address


def committed_remote(root: Path, commit: str = "HEAD") -> tuple[str, str] | None:
    """(name, url) of the default remote that ``.dvc/config`` holds at ``commit``: what a fresh clone
    on another machine sees (``config.local`` is never cloned)."""
    from configobj import ConfigObj, ConfigObjError

    r = subprocess.run(["git", "show", f"{commit}:.dvc/config"], cwd=root, capture_output=True, text=True)
    if r.returncode != 0:
        return None
    try:
        conf = ConfigObj(r.stdout.splitlines())
    except ConfigObjError as e:
        raise EvoError(f".dvc/config at {commit[:12]} is invalid: {e}") from None
    name = (conf.get("core") or {}).get("remote", "")
    url = (conf.get(f'remote "{name}"') or {}).get("url", "") if name else ""
    return (name, url) if name and url else None


def check_shared(root: Path, what: str) -> tuple[str, str, str]:
    """The repository and DVC remote a machine other than this one can reach, for ``what`` (a pool):
    (git origin URL, the commit, the DVC remote's name). One line naming the fix otherwise: the code
    must be on a git origin both machines reach, the commit pushed there, and the default DVC remote a
    network one named in the committed ``.dvc/config`` (its credentials stay in each machine's own
    config)."""
    origin = git(["config", "--get", "remote.origin.url"], root, check=False)
    if not origin:
        raise EvoError(f"{what}: {root} has no git origin, and the workers clone the code from it; add one both machines reach "
                       "(`git remote add origin ssh://git@host/evoharness.git` and push)")
    if not is_network_url(origin):
        raise EvoError(f"{what}: the git origin {redact(origin)} is a path on this machine, which the workers cannot clone; "
                       "push to a git server both machines reach and `git remote set-url origin <url>`")
    commit = git(["rev-parse", "HEAD"], root)
    git(["fetch", "-q", "origin"], root, check=False)
    if not git(["branch", "-r", "--contains", commit], root, check=False):
        raise EvoError(f"{what}: commit {commit[:12]} is not on origin {redact(origin)}, and the workers run that commit; `git push` it first")
    found = committed_remote(root, commit)
    if found is None:
        raise EvoError(f"{what}: the committed .dvc/config names no default DVC remote (a remote only in .dvc/config.local is "
                       "invisible to another machine); `dvc remote add -d storage <url>` without --local, then commit")
    name, url = found
    if not is_network_url(url):
        raise EvoError(f"{what}: DVC remote {name!r} ({redact(url)}) is a folder on this machine, which the workers cannot reach; "
                       "use a network remote (S3, SSH, WebDAV) that both machines reach")
    return origin, commit, name


def check_remote_url(url: str, what: str) -> None:
    """A remote URL DVC would take and fail on later: a scheme DVC does not know, a port that is not a number,
    no host. One line naming it (redacted)."""
    if "://" not in url:
        return
    from urllib.parse import urlsplit

    scheme = url.split("://", 1)[0].lower()
    if scheme not in NETWORK_SCHEMES + ("file",):
        raise EvoError(f"{what} ({redact(url)}): DVC has no remote of kind {scheme!r} (known: {', '.join(NETWORK_SCHEMES)})")
    parts = urlsplit(url)
    try:
        parts.port
    except ValueError:
        raise EvoError(f"{what} ({redact(url)}) has a port that is not a number from 1 to 65535") from None
    if scheme != "file" and not parts.hostname:
        raise EvoError(f"{what} ({redact(url)}) names no host (or bucket)")


def check_remote(root: Path) -> None:
    """DVC reports an unreachable HTTP or missing local remote as 'everything is up to date';
    check what can be checked without credentials and say so in one line."""
    found = default_remote(root)
    if found is None:
        raise EvoError(f"no DVC remote is configured for {root} (no default remote set); set one with `evoharness remote --url PATH_OR_URL`")
    name, url = found
    check_remote_url(url, f"DVC remote {name!r}")
    if "://" not in url:
        path = Path(url) if Path(url).is_absolute() else (Path(root) / ".dvc" / url)
        if not path.is_dir():
            raise EvoError(f"DVC remote {name!r} ({redact(url)}) does not exist or is not a folder")
    elif url.startswith(("http://", "https://", "webdav://", "webdavs://")):
        import httpx

        probe = url.replace("webdavs://", "https://", 1).replace("webdav://", "http://", 1)
        try:
            httpx.head(probe, timeout=5.0)
        except httpx.HTTPError as e:
            raise EvoError(f"DVC remote {name!r} ({redact(url)}) is unreachable ({type(e).__name__})") from None


_GUARDS: list = []


@contextmanager
def guarded(check):
    """While inside, every DVC command is watched by ``check()``, called about once a second: when it
    raises (say, the caller lost the lease that made it the repository's only DVC user), the command's
    process group is killed at once and the error is raised instead of letting DVC run unprotected."""
    _GUARDS.append(check)
    try:
        yield
    finally:
        _GUARDS.remove(check)


# Kills a DVC command's process group once the process that started it is gone (killed outright, so no
# handler of its ran): the stage's processes must not go on holding DVC's lock and writing outputs under a rerun.
_REAPER = ("import os, signal, sys, time\n"
           "parent, group = int(sys.argv[1]), int(sys.argv[2])\n"
           "while os.getppid() == parent:\n"
           "    time.sleep(0.5)\n"
           "try:\n"
           "    os.killpg(group, signal.SIGKILL)\n"
           "except ProcessLookupError:\n"
           "    pass\n")


def _run_guarded(cmd: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    import signal

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err, text=True, start_new_session=True)
        reaper = subprocess.Popen([sys.executable, "-S", "-c", _REAPER, str(os.getpid()), str(proc.pid)],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
        try:
            while True:
                try:
                    proc.wait(timeout=1.0)
                    break
                except subprocess.TimeoutExpired:
                    pass
                for check in list(_GUARDS):
                    check()
        except BaseException:  # a guard, or this process interrupted (a signal turned into an exception): the command goes too
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        finally:
            reaper.kill()
            reaper.wait()
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())


def dvc(args: list[str], cwd: Path, python: str | None = None) -> str:
    """Run a DVC command (with ``python``'s environment, default this one's); a failure is one line
    naming the command, the folder and DVC's reason, with any credentials in it redacted."""
    check_lock(cwd)
    if args and args[0] in ("push", "pull", "fetch") and not any(a in ("-r", "--remote") for a in args):
        check_remote(cwd)
        if args[0] != "push":
            ensure_verify(cwd)
    cmd = [python or sys.executable, "-m", "dvc", *args]
    for check in list(_GUARDS):
        check()
    r = _run_guarded(cmd, cwd, _env(python))
    out = r.stdout
    if r.returncode != 0:
        err = r.stderr or ""
        raise EvoError(redact(f"dvc {' '.join(args)} failed in {cwd}: {_last_error(err or out)}"))
    return out


def repo_root(start: Path | None = None) -> Path:
    start = Path(start or Path.cwd())
    root = Path(git(["rev-parse", "--show-toplevel"], start))
    if not (root / ".dvc").is_dir():
        raise EvoError(f"{root} is not a DVC repository (no .dvc folder); run `dvc init` there")
    return root


GUARD_WAIT_S = 60.0


@contextmanager
def _rwlock_guard(root: Path):
    """DVC's own guard of its lock file (``.dvc/tmp/rwlock.lock``, the lock ``dvc`` takes to read or
    edit ``rwlock``). DVC rewrites ``rwlock`` in place (truncate, then write) under this guard, so a
    read without it can see half a file, and a write without it can empty the file under a running
    ``dvc repro`` (which then stops: "JSON structure is corrupted"). Held for milliseconds by DVC;
    one held for ``GUARD_WAIT_S`` is reported in one line."""
    from dvc.lock import LockError, make_lock

    tmp = Path(root) / ".dvc" / "tmp"
    hardlink = bool((dvc_config(root).get("core") or {}).get("hardlink_lock", False))
    deadline = time.monotonic() + GUARD_WAIT_S
    while True:
        guard = make_lock(str(tmp / "rwlock.lock"), tmp_dir=str(tmp), hardlink_lock=hardlink)
        try:
            guard.lock()  # DVC's own retries: about 3 s
            break
        except LockError:
            if time.monotonic() > deadline:
                raise EvoError(f"DVC's lock guard {tmp / 'rwlock.lock'} stayed held for {GUARD_WAIT_S:.0f} s; "
                               "is a DVC process hung there?") from None
    try:
        yield tmp / "rwlock"
    finally:
        guard.unlock()


def _read_rwlock(rw: Path) -> dict:
    try:
        data = json.loads(rw.read_text() or "{}")
    except ValueError:
        data = None
    if not isinstance(data, dict):  # not JSON, or JSON DVC cannot read as a lock: never taken for "no holders"
        raise EvoError(f"DVC lock {rw} is corrupt; no DVC command can run until it is removed (`evoharness unlock`)")
    return data


def check_lock(root: Path) -> None:
    """A DVC lock left by a killed process: say so, naming the file and the dead process. Read under
    DVC's guard: another process's ``dvc`` may be rewriting it."""
    if not (Path(root) / ".dvc" / "tmp" / "rwlock").exists():
        return
    with _rwlock_guard(root) as rw:
        data = _read_rwlock(rw) if rw.exists() else {}
    holders = []
    for mode in ("read", "write"):
        for path, info in (data.get(mode) or {}).items():
            infos = info if isinstance(info, list) else [info]
            for i in infos:
                holders.append((int(i.get("pid", 0)), i.get("cmd", "?"), path))
    dead = [(pid, cmd, path) for pid, cmd, path in holders if pid and not _alive(pid)]
    if dead:
        pid, cmd, path = dead[0]
        raise EvoError(f"stale DVC lock {rw}: process {pid} ({cmd!r}) died holding {path}; run `evoharness unlock` to clear it")


def _alive(pid: int) -> bool:
    """Whether the process can still hold a lock. A zombie (killed, not yet reaped: in a container
    whose init does not reap, that can last) holds nothing."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def unlock(root: Path) -> list[int]:
    """Drop lock entries whose process is dead; live ones are kept. Returns the dead processes, each once.
    Done under DVC's guard, and the file is rewritten (atomically) only when an entry was dropped: a
    retrain's preflight runs this while another retrain of the repository may be inside ``dvc repro``."""
    if not (Path(root) / ".dvc" / "tmp" / "rwlock").exists():
        return []
    with _rwlock_guard(root) as rw:
        if not rw.exists():
            return []
        try:
            data = _read_rwlock(rw)
        except EvoError:
            rw.replace(rw.with_name(f"rwlock.corrupt.{os.getpid()}"))  # kept, not deleted
            return []
        removed = []
        for mode in ("read", "write"):
            entries = data.get(mode) or {}
            for path in list(entries):
                info = entries[path]
                infos = info if isinstance(info, list) else [info]
                live = [i for i in infos if _alive(int(i.get("pid", 0)))]
                removed += [int(i.get("pid", 0)) for i in infos if i not in live]
                if not live:
                    del entries[path]
                else:
                    entries[path] = live if isinstance(info, list) else live[0]
        if removed:
            tmp = rw.with_name(f"rwlock.tmp.{os.getpid()}")
            tmp.write_text(json.dumps(data))
            tmp.replace(rw)
    return sorted(set(removed))  # one entry per locked path: a process is named once


def ensure_remote(root: Path, url: str | None = None) -> str:
    """A default remote: the configured one, else a local folder (set in .dvc/config.local)."""
    found = default_remote(root)
    if found and url is None:
        return found[0]
    target = url or os.environ.get("EVOHARNESS_DVC_REMOTE") or str(DEFAULT_REMOTE)
    check_remote_url(target, "the DVC remote")
    if "://" not in target:
        try:
            Path(target).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise EvoError(f"cannot create the local DVC remote {target} ({e.strerror or type(e).__name__}); set HOME to a writable "
                           "folder, or name a remote with EVOHARNESS_DVC_REMOTE or `evoharness remote --url`") from None
    remotes = dvc(["remote", "list"], root)
    verb = "modify" if any(line.split()[0] == "local" for line in remotes.splitlines() if line.strip()) else "add"
    if verb == "add":
        dvc(["remote", "add", "--local", "-d", "local", target], root)
    else:
        dvc(["remote", "modify", "--local", "local", "url", target], root)
        dvc(["remote", "default", "--local", "local"], root)
    return "local"


# ---- dvc.lock -----------------------------------------------------------------------------------

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


def _mlflow_tags(run_id: str, root: Path) -> dict | None:
    """A run's tags in the project's tracking store; None when it is not a run there."""
    from evoharness import tracking

    uri = tracking.tracking_uri(root)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        return None
    try:
        run = tracking.client(root).get_run(run_id)
    except Exception:  # not a run id in this store (or the store is unreachable): not an MLflow reference
        return None
    return dict(run.data.tags)


def _mlflow_commit(run_id: str, root: Path) -> str | None:
    """The git commit a retrain's MLflow run was tagged with, in the project's tracking store."""
    tags = _mlflow_tags(run_id, root) or {}
    return tags.get("git_commit") or tags.get("mlflow.source.git.commit")


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
        from evoharness.reproduce import find_record

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
