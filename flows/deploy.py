"""Register the project's deployments (prefect.yaml) with their work pools. A re-deploy keeps what the
team chose on the server: which deployments are paused and which schedules are active (prefect.yaml's
``active`` is only the first registration's; ``prefect deploy`` alone would reset it, so that, say, the
CPU ``retrain`` schedule came back beside ``retrain-h200``'s and the Monday cron trained on the scheduler)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from evoharness.core.errors import EvoError
from evoharness.core.secrets import public_url, redact
from evoharness.ops.vcs import child_env, git, is_network_url
from flows.common import check_prefect


def _schedule_key(s) -> str:
    sched = s.schedule
    return str(getattr(sched, "cron", None) or getattr(sched, "interval", None) or getattr(sched, "rrule", None) or sched)


def _server_choices(names: list[str]) -> dict:
    """For each deployment already registered: whether it is paused, and each schedule's active flag."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    kept = {}
    with get_client(sync_client=True) as c:
        for name in names:
            try:
                dep = c.read_deployment_by_name(name)
            except ObjectNotFound:
                continue
            kept[name] = {"paused": bool(dep.paused), "active": {_schedule_key(s): s.active for s in c.read_deployment_schedules(dep.id)}}
    return kept


def _restore_choices(kept: dict, echo) -> None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        for name, was in kept.items():
            dep = c.read_deployment_by_name(name)
            for s in c.read_deployment_schedules(dep.id):
                want = was["active"].get(_schedule_key(s))
                if want is not None and want != s.active:
                    c.update_deployment_schedule(dep.id, s.id, active=want)
                    echo(f"kept {name}'s schedule {_schedule_key(s)} {'active' if want else 'inactive'}, as it was on the server")
            if was["paused"] and not c.read_deployment_by_name(name).paused:
                c.pause_deployment(dep.id)
                echo(f"kept {name} paused, as it was on the server")


def _with_git_token(root: Path, spec: dict, repo_url: str, echo) -> tuple[str, Path]:
    """An HTTPS origin: when the Prefect Secret block ``evoharness-git-token`` exists, the stage jobs' git_clone
    steps read their token from it (and the job's own checkout does too, ``flows.stage.git_token``): returns
    the URL without its user (the step puts the token there) and a copy of prefect.yaml saying so."""
    from flows.stage import GIT_TOKEN_BLOCK, stored_git_token, without_userinfo

    if stored_git_token() is None:
        echo(f"the origin {repo_url} is HTTPS and there is no Prefect Secret block {GIT_TOKEN_BLOCK!r}: the stage jobs clone it "
             "without a token (create the block with the token to clone a private repository)")
        return repo_url, root / "prefect.yaml"
    bare = without_userinfo(repo_url)
    for d in spec.get("deployments") or []:
        for step in d.get("pull") or []:
            clone = step.get("prefect.deployments.steps.git_clone")
            if isinstance(clone, dict):
                clone["access_token"] = "{{ prefect.blocks.secret.%s }}" % GIT_TOKEN_BLOCK
    out = root / ".dvc" / "tmp" / "prefect-deploy.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(spec, sort_keys=False))
    echo(f"the stage jobs clone {bare} with the token in the Prefect Secret block {GIT_TOKEN_BLOCK!r}")
    return bare, out


def deploy(root: Path, echo=print) -> list[str]:
    root = Path(root).resolve()
    url = check_prefect(required=True)
    spec_path = root / "prefect.yaml"
    if not spec_path.exists():
        raise EvoError(f"{spec_path} does not exist: run deploy from the project root")
    try:
        spec = yaml.safe_load(spec_path.read_text()) or {}
    except yaml.YAMLError as e:
        raise EvoError(f"{spec_path} is not valid YAML ({str(e).splitlines()[0]})") from None
    deps = spec.get("deployments") or []
    if not deps:
        raise EvoError(f"{spec_path}: no deployments")
    pools = sorted({(d.get("work_pool") or {}).get("name") for d in deps} - {None})

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as c:
        for name in pools:
            try:
                c.read_work_pool(name)
            except ObjectNotFound:
                c.create_work_pool(WorkPoolCreate(name=name, type="process", description=f"EvoHarness {name} machines"))
                echo(f"created work pool {name!r} (process)")
    names = [f"{d['entrypoint'].split(':')[-1].replace('_', '-')}/{d['name']}" for d in deps]
    kept = _server_choices(names)
    # The stage jobs clone the code from the git origin on whichever machine runs them; the retrain
    # deployments run on this machine's scheduler worker, in this very checkout (its data and stores).
    origin = git(["config", "--get", "remote.origin.url"], root, check=False)
    if not origin or not is_network_url(origin):
        raise EvoError(f"deploy: the stage jobs clone the code from the git origin, and {root}'s is "
                       f"{redact(origin) if origin else 'not set'}; push to a git server the workers reach and set it (`git remote add origin <url>`)")
    repo_url, deploy_file = public_url(origin), spec_path
    if repo_url.startswith("https://"):
        repo_url, deploy_file = _with_git_token(root, spec, repo_url, echo)
    env = child_env(EVOHARNESS_PROJECT_DIR=str(root), EVOHARNESS_REPO_URL=repo_url, PREFECT_API_URL=url)
    prefect = Path(sys.executable).parent / "prefect"
    try:
        r = subprocess.run([str(prefect), "--no-prompt", "deploy", "--all", "--prefect-file", str(deploy_file)], cwd=root, env=env,
                           capture_output=True, text=True)
    finally:
        if deploy_file != spec_path:
            deploy_file.unlink(missing_ok=True)
    if r.returncode != 0:
        lines = [ln.strip(" │╭╮╰╯─") for ln in (r.stdout + r.stderr).splitlines() if ln.strip(" │╭╮╰╯─")]
        raise EvoError(f"prefect deploy failed in {root}: {lines[-1] if lines else 'no output'}")
    _restore_choices(kept, echo)
    for d in deps:
        sched = ", ".join(f"cron {s['cron']} {s.get('timezone', 'UTC')}" for s in d.get("schedules") or [] if "cron" in s)
        echo(f"deployment {d['name']!r} on pool {d['work_pool']['name']!r}" + (f" ({sched})" if sched else ""))
    return names
