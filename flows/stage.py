"""The job a work pool runs: one DVC stage in a clean checkout of the dispatched commit, cloned from
the git origin under the worker's own home.

This flow is only the driver (its code is whatever the pull step cloned): it checks out the dispatched
commit, refuses a box whose packages differ from the commit's constraints file, holds the workspace
with a local lock, and runs the job with the commit's own code in a subprocess (``dispatch.run_in_checkout``),
killed at the stage's time limit or when this box has not reached the Prefect server for ``fence_s``.
Inputs arrive by hash from the DVC remote and outputs leave the same way; the stage's new ``dvc.lock``
entry is published as an artifact the orchestrator reads back. The flow run sends Prefect's heartbeats
while it runs (prefect.yaml), which is how the orchestrator knows it is alive.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.request
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from evoharness.core.errors import EvoError
from evoharness.ops import dispatch
from flows.common import prefect_api
from tasks.stages import JOB_ARTIFACT, job_markdown

DEFAULT_TIME_LIMIT_S = 6 * 3600
DEFAULT_FENCE_S = 600


class Fence:
    """Whether this box still reaches the Prefect server: probed every ``every_s``; once it has not for
    ``fence_s``, the orchestrator may have declared the job lost, so the job stops (``__call__`` says why)."""

    def __init__(self, fence_s: float, every_s: float = 10.0):
        self.fence_s, self.every_s = fence_s, every_s
        self.url = (prefect_api() or "").rstrip("/")
        self.last_ok = time.monotonic()
        self._stop = threading.Event()
        threading.Thread(target=self._loop, daemon=True, name="prefect-fence").start()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        self.last_ok = time.monotonic()
            except OSError:
                pass

    def __call__(self) -> str | None:
        away = time.monotonic() - self.last_ok
        if self.url and away > self.fence_s:
            return f"has not reached the Prefect server {self.url} for {away:.0f} s (fence_s {self.fence_s:.0f}): fenced, the orchestrator may have given it up"
        return None

    def close(self) -> None:
        self._stop.set()


GIT_TOKEN_BLOCK = "evoharness-git-token"


def stored_git_token() -> str | None:
    """The Prefect Secret block ``evoharness-git-token`` (``TOKEN`` or ``USER:TOKEN``), or None when there is no
    such block. A server that cannot be asked raises: never read as "no token"."""
    from prefect.blocks.system import Secret

    try:
        return str(Secret.load(GIT_TOKEN_BLOCK).get())
    except ValueError as e:
        if "Unable to find block document" in str(e):
            return None
        raise


def git_token(repo: str) -> str | None:
    """An HTTPS origin's token (the deployment's git_clone step reads the same block); None for other origins."""
    return stored_git_token() if repo.startswith("https://") else None


def without_userinfo(url: str) -> str:
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url.strip())
    if not parts.hostname:
        return url.strip()
    return urlunsplit(parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else "")))


def check_origin(repo: str) -> None:
    """Only the origin this deployment clones runs here: its git_clone step checked this code out, so the
    code's own checkout names it. A job naming any other repository (whoever can create flow runs could)
    is refused in one line, as is a job whose own origin cannot be read."""
    import subprocess

    here = Path(__file__).resolve().parent.parent
    r = subprocess.run(["git", "remote", "get-url", "origin"], cwd=here, capture_output=True, text=True)
    mine = r.stdout.strip()
    if r.returncode or not mine:
        raise EvoError(f"this job's code at {here} has no git origin to compare the dispatched repository with; nothing runs")
    if without_userinfo(repo) != without_userinfo(mine):
        from evoharness.core.secrets import redact

        raise EvoError(f"the job names repository {redact(repo)}, not the origin this deployment clones ({redact(without_userinfo(mine))}); nothing runs")


def box_name() -> str:
    """How the orchestrator names this box in its messages: ``EVOHARNESS_MACHINE`` (an instance or rack name), else the host name."""
    import os

    return os.environ.get("EVOHARNESS_MACHINE", "").strip() or socket.gethostname()


def _name_the_box() -> None:
    """Tag this job's flow run ``box:<name>``: a flow run records the worker's pid, not its machine."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    if not flow_run.id:
        return
    with get_client(sync_client=True) as c:
        fr = c.read_flow_run(flow_run.id)
        c.update_flow_run(flow_run.id, tags=[*fr.tags, f"box:{box_name()}"])


@flow(name="train-stage", log_prints=True)
def train_stage(spec: dict, home: str | None = None) -> dict:
    """spec: {stage, repo, commit, lock, remote, time_limit_s, fence_s} as built by the orchestrator (``dispatch.job_spec``)."""
    from evoharness.ops.reproduce import environment_mismatch

    _name_the_box()
    check_origin(spec["repo"])
    home_p = Path(home) if home else None
    ws = dispatch.workspace(spec["repo"], spec["stage"], home_p)
    with dispatch.workspace_lock(ws, print):
        ws = dispatch.checkout(spec, home_p, print, token=git_token(spec["repo"]))
        mismatch = environment_mismatch(spec["commit"], ws)
        if mismatch:
            raise EvoError(f"stage {spec['stage']!r} on {box_name()}: {mismatch}; this box does not run the commit's environment: "
                           "build it there (`bash scripts/setup.sh` at that commit) and rerun the retrain")
        fence = Fence(float(spec.get("fence_s") or DEFAULT_FENCE_S))
        try:
            # The job's output reaches the flow run's logs through its logger (a thread's print() would not).
            from prefect.runtime import flow_run

            spec = {**spec, "flow_run_id": str(flow_run.id) if flow_run.id else None}
            res = dispatch.run_in_checkout(spec, ws, float(spec.get("time_limit_s") or DEFAULT_TIME_LIMIT_S), fence, get_run_logger().info)
        finally:
            fence.close()
    create_markdown_artifact(key=JOB_ARTIFACT, markdown=job_markdown(res), description=f"outputs of {res.stage} by hash")
    return {"stage": res.stage, "ran": res.ran, "seconds": res.seconds, "outs": {k: v for k, v in res.hashes().items() if k.startswith("out:")}}
