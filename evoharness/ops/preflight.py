"""What the end of a retrain needs, checked before its first stage: git itself, a record commit and its
tag, the origin accepting the push, the DVC remote accepting a write, and MLflow accepting a run, an
artifact, a model version and an alias (and, when there is a champion, its evidence being readable).

Nothing that can be checked in seconds may fail after an hour of work. Each check leaves nothing behind
that lasts (a probe commit no ref keeps, a probe file and a probe model version deleted again) and each
failure is one line naming what and where.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

from evoharness.core.errors import EvoError
from evoharness.core.secrets import redact
from evoharness.ops.vcs import child_env, git, is_network_url, record_identity

PUSH_TIMEOUT_S = 60
PROBE_MODEL_SUFFIX = "-preflight"


def check_git() -> str:
    """git on PATH: the record, the origin and DVC's own scm calls all need it."""
    exe = shutil.which("git")
    if exe is None:
        raise EvoError("git is not installed (not on PATH): the retrain records every run in git; install it (`apt-get install git`)")
    return exe


def writable_dir(path: Path, what: str) -> Path:
    """A folder this run writes outside the project (made if missing), or one line naming it."""
    path = Path(path).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".evoharness-preflight-"):
            pass
    except OSError as e:
        raise EvoError(f"{what} {path} cannot be created or written ({e.strerror or type(e).__name__}); "
                       "set HOME to a writable folder or point the setting elsewhere") from None
    return path


def check_record(root: Path) -> tuple[str, str]:
    """A record commit can be made here: a commit of HEAD's tree with the identity the record will use,
    and a ref to it written and deleted again. Returns (the probe commit, who the record commits as)."""
    root = Path(root)
    if subprocess.run(["git", "rev-parse", "--verify", "--quiet", "HEAD^{commit}"], cwd=root, capture_output=True).returncode:
        raise EvoError(f"{root} has no git commit yet, and each retrain's record is a commit on top of the code it ran; commit the project first")
    ident_env, who = record_identity(root)
    index = Path(tempfile.mkdtemp(prefix="evoharness-preflight-")) / "index"
    env = child_env(GIT_INDEX_FILE=str(index), **ident_env)
    ref = f"refs/evoharness-preflight/{uuid.uuid4().hex[:12]}"
    try:
        head = git(["rev-parse", "HEAD"], root)
        git(["read-tree", "HEAD"], root, env=env)
        tree = git(["write-tree"], root, env=env)
        try:
            commit = git(["commit-tree", tree, "-p", head, "-m", "evoharness preflight: a record commit can be made"], root, env=env)
            git(["update-ref", ref, commit], root)
            git(["update-ref", "-d", ref], root)
        except EvoError as e:
            raise EvoError(f"the run's git record cannot be made in {root}: {e}") from None
    finally:
        shutil.rmtree(index.parent, ignore_errors=True)
    return commit, who


def check_origin_push(root: Path, commit: str) -> str | None:
    """The origin accepts the record's tag: ``git push --dry-run`` of the probe commit as a ``retrain/``
    tag reaches the origin's push service with this machine's credentials and sends nothing. None when
    there is no network origin (the record then stays in this repository)."""
    root = Path(root)
    origin = git(["config", "--get", "remote.origin.url"], root, check=False)
    if not origin or not is_network_url(origin):
        return None
    env = child_env(GIT_TERMINAL_PROMPT="0")  # a missing credential fails here instead of waiting at a prompt
    try:
        r = subprocess.run(["git", "push", "--dry-run", "--porcelain", "origin", f"{commit}:refs/tags/retrain/preflight-{commit[:12]}"],
                           cwd=root, capture_output=True, text=True, env=env, timeout=PUSH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise EvoError(f"git origin {redact(origin)} did not answer a push within {PUSH_TIMEOUT_S} s; the run's record could not be pushed") from None
    if r.returncode:
        why = [ln.strip() for ln in (r.stderr or r.stdout).splitlines() if ln.strip()]
        raise EvoError(f"git origin {redact(origin)} refuses a push from {root} ({redact(why[-1] if why else 'no output')}); "
                       "the run's record is pushed there at the end: fix the origin's URL or this machine's credentials for it")
    return redact(origin)


def check_mlflow(root: Path, model_name: str) -> str:
    """MLflow accepts what the end of the run writes: a run with a tag and an artifact in the retrain's
    experiment, a version of a probe model, an alias on it; all deleted again. When ``model_name`` has a
    champion, its evidence must be readable too (the gate compares with it and fails closed otherwise)."""
    from evoharness.ops import promotion, tracking

    c = tracking.client(root)
    uri = redact(c.tracking_uri)
    step = "create a run"
    run_id = probe = version = None
    try:
        exp = tracking.experiment_id(c, root)
        run_id = c.create_run(exp, run_name="preflight", tags={"kind": "preflight"}).info.run_id
        step = "store an artifact"
        with tempfile.TemporaryDirectory() as d:
            f = Path(d) / "preflight.txt"
            f.write_text("the retrain's end writes artifacts here\n")
            c.log_artifact(run_id, str(f), "preflight")
        step = "register a model version"
        probe = model_name + PROBE_MODEL_SUFFIX
        try:
            c.get_registered_model(probe)
        except Exception:
            try:
                c.create_registered_model(probe, description="evoharness preflight probe: each retrain registers and deletes a version here")
            except Exception as e:  # another retrain's preflight made it a moment ago
                if getattr(e, "error_code", "") != "RESOURCE_ALREADY_EXISTS":
                    raise
                c.get_registered_model(probe)
        version = c.create_model_version(probe, source=f"{c.get_run(run_id).info.artifact_uri}/preflight", run_id=run_id).version
        step = "set an alias"
        alias = f"preflight-{run_id[:12]}"  # its own: two retrains' preflights may probe at the same moment
        c.set_registered_model_alias(probe, alias, version)
        if str(c.get_model_version_by_alias(probe, alias).version) != str(version):
            raise RuntimeError("the alias does not point at the version it was set to")
        c.delete_registered_model_alias(probe, alias)
    except Exception as e:
        text = " ".join(str(e).split())[:200] or type(e).__name__
        raise EvoError(f"MLflow store {uri} refused to {step} ({type(e).__name__}: {redact(text)}); the promotion at the end of the run "
                       "needs it") from None
    finally:
        for cleanup in ((lambda: c.delete_model_version(probe, version)) if version else None,
                        (lambda: c.delete_run(run_id)) if run_id else None):
            if cleanup is not None:
                try:
                    cleanup()
                except Exception:  # noqa: BLE001 - a probe left behind harms nothing; the check itself has passed or failed
                    pass
    champ, _ = promotion.read_champion(c, model_name)  # fails closed, as the gate would after the run
    return f"{uri} (champion of {model_name}: {'version ' + str(champ.version) if champ else 'none yet'})"


def check_stage_params(root: Path) -> None:
    """Every params key a stage of dvc.yaml reads is in params.yaml (DVC stops a stage whose key is missing, an hour
    into the run: a key added by a newer version, ``consolidator``, absent from an older params.yaml)."""
    import yaml

    root = Path(root)
    raw = yaml.safe_load((root / "params.yaml").read_text()) or {}
    stages = (yaml.safe_load((root / "dvc.yaml").read_text()) or {}).get("stages", {})
    for name, st in stages.items():
        for key in st.get("params") or []:
            if not isinstance(key, str) or "${" in key:
                continue
            node = raw
            for part in key.split("."):
                if not isinstance(node, dict) or part not in node:
                    raise EvoError(f"{root / 'params.yaml'}: no {key!r}, which dvc.yaml's stage {name} reads; add it "
                                   "(the repository's params.yaml has every key with its default)")
                node = node[part]
