"""What another machine can reach: the DVC remote (the default local one, the committed one, a probe that writes,
reads back and deletes an object) and the git origin."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

from evoharness.core.errors import EvoError
from evoharness.core.secrets import redact
from evoharness.ops.vcs import check_remote_url, default_remote, dvc, dvc_config, git, is_network_url

DEFAULT_REMOTE = Path.home() / ".cache" / "evoharness" / "dvc-remote"


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


def check_remote_writable(root: Path) -> str:
    """The default DVC remote accepts a write, a read and a delete: a probe object put, read back and
    removed again through DVC's own filesystem for that remote (its plugin, its URL and this machine's
    credentials, as ``dvc push`` and ``dvc pull`` use them), for every kind (a folder, S3, WebDAV, HTTP,
    SSH...). Returns the remote's name and URL (redacted)."""
    from dvc.fs import get_cloud_fs

    found = default_remote(root)
    if found is None:
        raise EvoError(f"no DVC remote is configured for {root} (no default remote set); set one with `evoharness remote --url PATH_OR_URL`")
    name, url = found
    where = f"DVC remote {name!r} ({redact(url)})"
    try:
        cls, config, base = get_cloud_fs(dvc_config(root), name=name)
        fs = cls(**config)
        probe = fs.join(base, f".evoharness-preflight-{uuid.uuid4().hex[:12]}")
        if "://" not in url:
            fs.makedirs(base, exist_ok=True)
        body = f"evoharness preflight {uuid.uuid4().hex}: this remote accepts a write\n".encode()
        fs.pipe_file(probe, body)
        try:
            if fs.cat_file(probe) != body:
                raise EvoError(f"{where} returned other bytes for the probe object it had just stored; the outputs pushed there could not be pulled")
        finally:
            fs.rm_file(probe)
    except EvoError:
        raise
    except Exception as e:  # any plugin's error: a missing plugin, refused credentials, an unreachable host
        text = " ".join(str(e).split())[:200] or type(e).__name__
        raise EvoError(f"{where} does not accept a write, read and delete from {root} ({type(e).__name__}: {redact(text)}); "
                       "the retrain pushes every output there and pulls from it") from None
    return f"{name} ({redact(url)})"
