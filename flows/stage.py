"""The job a work pool runs: one DVC stage in a clean checkout of the dispatched commit, cloned from
the git origin under the worker's own home.

Inputs arrive by hash from the DVC remote and outputs leave the same way; the stage's new
``dvc.lock`` entry is published as an artifact the orchestrator reads back. The flow run sends
Prefect's heartbeats while it runs (prefect.yaml), which is how the orchestrator knows it is alive.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from evoharness import stagerun
from tasks.stages import JOB_ARTIFACT, dvc_slot, ensure_limit, job_markdown


@flow(name="train-stage", log_prints=True)
def train_stage(spec: dict, home: str | None = None) -> dict:
    """spec: {stage, repo, commit, lock, remote} as built by the orchestrator (``stagerun.job_spec``)."""
    ws = stagerun.workspace(spec["repo"], spec["stage"], Path(home) if home else None)
    ensure_limit(ws)
    with dvc_slot(ws, print):
        res = stagerun.run_job(spec, Path(home) if home else None, echo=print)
    create_markdown_artifact(key=JOB_ARTIFACT, markdown=job_markdown(res), description=f"outputs of {res.stage} by hash")
    return {"stage": res.stage, "ran": res.ran, "seconds": res.seconds, "outs": {k: v for k, v in res.hashes().items() if k.startswith("out:")}}
