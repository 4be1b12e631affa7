"""Each retrain's git record, found again by run id, commit or tag, and the MLflow run tags that name it.

The record is a commit on top of the code commit the retrain started from, holding that run's
``dvc.lock``, ``dvc.yaml``, ``params.yaml``, the metrics and plots DVC does not cache and the code its
stages ran, nothing else (a settings or result file holding a credential is refused): made with a
private index, so the user's branch and working tree stay as they are. Its tag
``retrain/<MLflow run id>`` is pushed to origin when origin is a network one, and the run's data is on
the DVC remote (the retrain pushed it). The MLflow run names the tag (``git_ref``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from evoharness.core.errors import EvoError
from evoharness.core.secrets import redact
from evoharness.ops.lockfile import lock_outs, parse_lock
from evoharness.ops.vcs import child_env, git, is_network_url, record_identity

RECORD_PREFIX = "retrain/"


def record_ref(run_id: str) -> str:
    return f"{RECORD_PREFIX}{run_id}"


def record_run(root: Path, run_id: str, message: str, push: bool = True, echo=print) -> tuple[str, str]:
    """Commit what this retrain ran (see the module's docstring) and tag it ``retrain/<run_id>``;
    push the tag to a network origin. Returns (tag, commit)."""
    import yaml

    root = Path(root)
    tag = record_ref(run_id)
    existing = git(["rev-parse", "--verify", "--quiet", f"refs/tags/{tag}^{{commit}}"], root, check=False)
    if existing:  # a retry of this run's record: the record made before is the record (records never move)
        echo(f"the run's record {tag} exists ({existing[:12]}); reusing it")
        _push_record(root, tag, existing, push, echo)
        return tag, existing
    index = Path(tempfile.mkdtemp(prefix="evoharness-record-")) / "index"
    env = child_env(GIT_INDEX_FILE=str(index), **record_identity(root)[0])

    def g(*args: str) -> str:
        r = subprocess.run(["git", *args], cwd=root, env=env, capture_output=True, text=True)
        if r.returncode:
            raise EvoError(f"recording the run in git: git {' '.join(args[:2])} failed in {root}: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
        return r.stdout.strip()

    try:
        head = g("rev-parse", "HEAD")
        g("read-tree", "HEAD")  # the code commit as it is; of the working tree, only the run's own files below
        stages = (yaml.safe_load((root / "dvc.yaml").read_text()) or {}).get("stages", {})
        paths = ["dvc.lock", "dvc.yaml", "params.yaml"]
        for st in stages.values():
            for kind in ("outs", "metrics", "plots"):
                for o in st.get(kind) or []:
                    if isinstance(o, dict):
                        path, opts = next(iter(o.items()))
                        if opts and opts.get("cache") is False:
                            paths.append(path)
            for d in st.get("deps") or []:
                d = d if isinstance(d, str) else next(iter(d))
                if not d.startswith("data/"):
                    paths.append(d)  # code a stage ran, even if not yet committed
        paths = [p for p in dict.fromkeys(paths) if (root / p).exists()]
        check_no_credentials(root, paths)
        g("add", "--", *paths)
        tree = g("write-tree")
        commit = g("commit-tree", tree, "-p", head, "-m", message)
    finally:
        shutil.rmtree(index.parent, ignore_errors=True)
    git(["tag", tag, commit], root)  # never -f: a record does not move
    _push_record(root, tag, commit, push, echo)
    return tag, commit


# The record's files a credential could be pasted into (settings, locks, metrics); code is reviewed as code.
_DATA_SUFFIXES = (".yaml", ".yml", ".lock", ".json", ".jsonl", ".csv", ".tsv", ".txt", ".md", ".toml", ".cfg", ".ini")


def check_no_credentials(root: Path, paths: list[str]) -> None:
    """Refuse, in one line naming the file and line, to record a settings or result file that holds a credential
    (what ``redact`` would hide: a URL's password, a signed query, a token header, a secret-named setting)."""
    from evoharness.core.secrets import redact

    for p in paths:
        q = root / p
        files = sorted(f for f in q.rglob("*") if f.is_file()) if q.is_dir() else [q]
        for f in files:
            if f.name != "dvc.lock" and not f.name.endswith(_DATA_SUFFIXES):
                continue
            try:
                text = f.read_text()
            except (OSError, UnicodeDecodeError):
                continue
            if redact(text) != text:
                n = next(i for i, line in enumerate(text.splitlines(), 1) if redact(line) != line)
                raise EvoError(f"recording the run in git: {f.relative_to(root)} line {n} holds a credential; "
                               "move it to an environment variable or a secret store (nothing was recorded)")


def _push_record(root: Path, tag: str, commit: str, push: bool, echo) -> None:
    """Push the record's tag (never forced: origin keeps the record it has; one naming another commit is an
    error, not overwritten)."""
    origin = git(["config", "--get", "remote.origin.url"], root, check=False)
    if not (push and origin and is_network_url(origin)):
        echo(f"recorded the run as {tag} ({commit[:12]}) in {root} (no network origin to push it to)")
        return
    env = child_env(GIT_TERMINAL_PROMPT="0")
    for attempt in range(3):
        r = subprocess.run(["git", "push", "-q", "origin", f"refs/tags/{tag}"], cwd=root, capture_output=True, text=True, env=env)
        if r.returncode == 0:
            break
        there = subprocess.run(["git", "ls-remote", "origin", f"refs/tags/{tag}"], cwd=root, capture_output=True, text=True, env=env).stdout.split()
        if there and there[0] == commit:
            break  # already there, as it is here
        if there:
            raise EvoError(f"origin {redact(origin)} already has the record {tag} naming commit {there[0][:12]}, not {commit[:12]}; "
                           "records never move: nothing was pushed")
        time.sleep(2 * (attempt + 1))
    else:
        raise EvoError(f"could not push the run's record {tag} to {redact(origin)} ({redact(r.stderr.strip().splitlines()[-1] if r.stderr.strip() else '')}); "
                       f"push it with `git push origin refs/tags/{tag}`")
    echo(f"recorded the run as {tag} ({commit[:12]}) and pushed it to {redact(origin)}")


def _fetch_records(root: Path) -> None:
    origin = git(["config", "--get", "remote.origin.url"], root, check=False)
    if origin:
        # Without '+': a record this machine has is never overwritten by origin's (git refuses to clobber a tag).
        git(["fetch", "-q", "origin", f"refs/tags/{RECORD_PREFIX}*:refs/tags/{RECORD_PREFIX}*"], root, check=False)


SHA = re.compile(r"[0-9a-f]{40}")


def find_record(ref: str, root: Path) -> tuple[str, str]:
    """(commit, how it was found) for an MLflow run id (its ``retrain/<id>`` record, here or on
    origin, else the commit its MLflow run names), a ref or commit, or a DVC output hash in any
    recorded or committed dvc.lock."""
    root = Path(root)

    def rev(name: str) -> str | None:
        r = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{name}^{{commit}}"], cwd=root, capture_output=True, text=True)
        return r.stdout.strip() if r.returncode == 0 else None

    name = ref.strip()
    for attempt in range(2):
        c = rev(f"refs/tags/{record_ref(name)}") or (rev(f"refs/tags/{name}") if name.startswith(RECORD_PREFIX) else None)
        if c:
            return c, f"the record of MLflow run {name.removeprefix(RECORD_PREFIX)} ({record_ref(name.removeprefix(RECORD_PREFIX))})"
        h = name.lower().removesuffix(".dir")
        if len(h) >= 6 and all(ch in "0123456789abcdef" for ch in h):
            for commit in git(["log", "--all", "--format=%H", "--", "dvc.lock"], root, check=False).split():
                text = subprocess.run(["git", "show", f"{commit}:dvc.lock"], cwd=root, capture_output=True, text=True).stdout
                for o in lock_outs(parse_lock(text)):
                    if o.kind == "out" and o.md5.removesuffix(".dir").startswith(h):
                        return commit, f"{o.path} (stage {o.stage}) has md5 {o.md5}"
        c = rev(name)
        if c:
            return c, "git ref"
        if attempt == 0:
            _fetch_records(root)  # another machine's retrain: its record is on origin
    commit = run_commit(name, root)
    if commit:
        if not SHA.fullmatch(commit):
            raise EvoError(f"MLflow run {name}: its git_commit tag {commit[:60]!r} is not a commit id; nothing is reproduced")
        return commit, f"MLflow run {name} (its git_commit tag: no record of it in git)"
    raise EvoError(f"{ref!r} is neither a retrain's MLflow run id (no tag {record_ref(name)} here or on origin), nor a git ref, "
                   "nor an output hash in any recorded dvc.lock")


def run_tags(run_id: str, root: Path) -> dict | None:
    """A run's tags in the project's tracking store; None when it is not a run there."""
    from evoharness.ops import tracking

    uri = tracking.tracking_uri(root)
    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).exists():
        return None
    try:
        run = tracking.client(root).get_run(run_id)
    except Exception:  # not a run id in this store (or the store is unreachable): not an MLflow reference
        return None
    return dict(run.data.tags)


def run_commit(run_id: str, root: Path) -> str | None:
    """The git commit a retrain's MLflow run was tagged with, in the project's tracking store."""
    tags = run_tags(run_id, root) or {}
    return tags.get("git_commit") or tags.get("mlflow.source.git.commit")
