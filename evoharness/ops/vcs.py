"""git and DVC as the project runs them: the commands (DVC as ``python -m dvc`` with the virtualenv's ``bin`` first on
PATH, so stage commands use this environment and, run from a worktree's root, import that worktree's code), the
DVC remote's configuration and checks, and DVC's locks (dvc.lock's entries are ``lockfile``'s). Lineage, records,
stage runs and reproduction all call these; this module calls none of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, suppress
from pathlib import Path

from evoharness.core.errors import EvoError
from evoharness.core.secrets import public_url, redact


# The tracking server's credentials. Only the orchestrating process talks to MLflow (tracking.client_uri moves a
# URI's userinfo into these, which MLflow reads per request), so no process it starts (DVC and the stages' trainers,
# pool jobs, git, setup scripts) inherits them, and the tracking URI it sees carries no userinfo.
TRACKING_CREDENTIALS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")


def child_env(**extra: str) -> dict:
    """The environment for a process this one starts: ours without the tracking server's credentials, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in TRACKING_CREDENTIALS}
    if env.get("MLFLOW_TRACKING_URI"):
        env["MLFLOW_TRACKING_URI"] = public_url(env["MLFLOW_TRACKING_URI"])
    env.update(extra)
    return env


def _env(python: str | None = None) -> dict:
    env = child_env()
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
        r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=child_env() if env is None else env)
    except FileNotFoundError:
        raise EvoError("git is not installed (not on PATH): the project is a git repository and every retrain is recorded in git; "
                       "install it (`apt-get install git`)") from None
    if check and r.returncode != 0:
        raise EvoError(redact(f"git {' '.join(args)} in {cwd}: {_last_error(r.stderr or r.stdout)}"))
    return r.stdout.strip()


_EMAIL_VARS = ("GIT_AUTHOR_EMAIL", "GIT_COMMITTER_EMAIL", "EMAIL")


RECORD_NAME, RECORD_EMAIL = "evoharness", "retrain@localhost"


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


def python_module(module: str, args: list[str], cwd: Path, what: str) -> str:
    """Run ``python -m module args`` as a DVC command is run (watched by the guards, its process group killed with this
    process); a failure is one line: ``what``, then the module's own ``error: ...`` line or its last line."""
    r = _run_guarded([sys.executable, "-m", module, *args], cwd, _env())
    if r.returncode != 0:
        raise EvoError(redact(f"{what} in {cwd}: {_last_error(r.stderr or r.stdout)}"))
    return r.stdout


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
