"""Register the project's deployments (prefect.yaml) with their work pools and the DVC limit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from evoharness.errors import EvoError
from evoharness.lineage import git, is_network_url, redact
from evoharness.secrets import public_url
from flows.common import check_prefect


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
    from tasks.stages import ensure_limit

    ensure_limit(root)
    # The stage jobs clone the code from the git origin on whichever machine runs them; the retrain
    # deployments run on this machine's scheduler worker, in this very checkout (its data and stores).
    origin = git(["config", "--get", "remote.origin.url"], root, check=False)
    if not origin or not is_network_url(origin):
        raise EvoError(f"deploy: the stage jobs clone the code from the git origin, and {root}'s is "
                       f"{redact(origin) if origin else 'not set'}; push to a git server the workers reach and set it (`git remote add origin <url>`)")
    env = dict(os.environ, EVOHARNESS_PROJECT_DIR=str(root), EVOHARNESS_REPO_URL=public_url(origin), PREFECT_API_URL=url)
    prefect = Path(sys.executable).parent / "prefect"
    r = subprocess.run([str(prefect), "--no-prompt", "deploy", "--all", "--prefect-file", str(spec_path)], cwd=root, env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        lines = [ln.strip(" │╭╮╰╯─") for ln in (r.stdout + r.stderr).splitlines() if ln.strip(" │╭╮╰╯─")]
        raise EvoError(f"prefect deploy failed in {root}: {lines[-1] if lines else 'no output'}")
    names = [f"{d['entrypoint'].split(':')[-1].replace('_', '-')}/{d['name']}" for d in deps]
    for d in deps:
        sched = ", ".join(f"cron {s['cron']} {s.get('timezone', 'UTC')}" for s in d.get("schedules") or [] if "cron" in s)
        echo(f"deployment {d['name']!r} on pool {d['work_pool']['name']!r}" + (f" ({sched})" if sched else ""))
    return names
