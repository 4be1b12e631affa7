"""Prefect tasks over DVC stages: run one here, dispatch one to a work pool, receive its outputs.

DVC locks the repo, so two commands at once fail. Every DVC command runs while its caller holds
the repository's slot of a global concurrency limit of one: a retrain takes the slot once for its
whole run (a second retrain of the same repo, say a scheduled one beside a manual one, waits for
it), and a pool job takes the slot of its own checkout. Taking it once per retrain rather than once
per command also avoids ten round trips that a busy SQLite Prefect server answers with 503 and a
2 s client back-off. The slot is per repository path: a job's clean checkout on a worker is another
repository, so the orchestrator waiting for it never deadlocks it. Leases expire 60 s after a
killed holder stops renewing them. The tasks below assume the caller holds the slot. They carry
no tags: Prefect takes a tag concurrency slot for every tagged task run, one more write per task
that a busy SQLite server may answer with 503 and a 2 s back-off.
"""

from __future__ import annotations

import hashlib
import json
import re
from contextlib import contextmanager
from pathlib import Path

import yaml
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from evoharness import stagerun
from evoharness.errors import EvoError

LEASE_S = 60
JOB_ARTIFACT = "stage-job-result"


def limit_name(root: Path) -> str:
    return "dvc-" + hashlib.sha256(str(Path(root).resolve()).encode()).hexdigest()[:12]


def ensure_limit(root: Path) -> str:
    from prefect.client.orchestration import get_client

    name = limit_name(root)
    with get_client(sync_client=True) as c:
        c.upsert_global_concurrency_limit_by_name(name, 1)
    return name


@contextmanager
def dvc_slot(root: Path):
    from prefect.concurrency.sync import concurrency

    # A renewal that fails once (a busy server) must not kill an hour of training: it is logged, and
    # the lease lasts LEASE_S more seconds for the next renewal to succeed.
    with concurrency(limit_name(root), occupy=1, lease_duration=LEASE_S, strict=True, raise_on_lease_renewal_failure=False):
        yield


def artifact_key(stage: str) -> str:
    return re.sub(r"[^a-z0-9-]", "-", f"stage-{stage}".lower())


def stage_markdown(res: stagerun.StageResult, metrics: dict | None) -> str:
    lines = [f"### {res.stage}: {'ran' if res.ran else 'cached (DVC: nothing changed)'} — {res.seconds:.1f} s ({res.where})", "",
             "| kind | path | md5 |", "|---|---|---|"]
    for key, md5 in res.hashes().items():
        kind, path = key.split(":", 1)
        if kind == "out" or path.startswith("data/"):
            lines.append(f"| {kind} | `{path}` | `{md5}` |")
    if metrics:
        lines += ["", "| metric | value |", "|---|---|"]
        from evoharness.tracking import flatten

        for k, v in list(flatten(metrics).items())[:60]:
            lines.append(f"| {k} | {v} |")
    return "\n".join(lines)


@task(name="dvc-stage", cache_policy=NO_CACHE)
def run_stage(root: str, stage: str) -> stagerun.StageResult:
    """Run the stage here (``dvc repro --single-item``); DVC skips it when nothing changed."""
    return stagerun.run_here(Path(root), stage)


@task(name="validation-gate", cache_policy=NO_CACHE)
def validate_stage(root: str, stage: str = "validate") -> stagerun.StageResult:
    """The Great Expectations gate: on failure the flow stops with a readable report artifact (the
    data is already quarantined by the stage, with its report beside it)."""
    root_p = Path(root)
    try:
        return stagerun.run_here(root_p, stage)
    except EvoError as e:
        md = ["# Validation failed: the flow stopped", "", f"`{e}`", ""]
        for name in ("trajectories", "pairs"):
            p = root_p / "data" / "validation" / f"{name}.json"
            if not p.exists():
                continue
            rep = json.loads(p.read_text())
            if rep.get("success"):
                continue
            md += [f"## {name}: {len(rep['failed'])} of {rep['expectations']} expectations failed ({rep['rows']} rows)", "",
                   "| expectation | column | bad rows | examples |", "|---|---|---|---|"]
            for f in rep["failed"]:
                ex = "; ".join(str(x) for x in (f.get("where") or f.get("examples") or [])[:3])
                md.append(f"| {f['expectation']} | {f.get('column') or ''} | {f.get('unexpected_count')} | {ex[:200]} |")
        qroot = root_p / "data" / "quarantine"
        if qroot.exists():
            md += ["", "Quarantined (moved, with their report): " + ", ".join(f"`{q.name}`" for q in sorted(qroot.iterdir())[-3:])]
        create_markdown_artifact(key="validation-report", markdown="\n".join(md), description="why the data gate stopped the retrain")
        raise


def job_markdown(res: stagerun.StageResult) -> str:
    doc = {"stage": res.stage, "ran": res.ran, "seconds": res.seconds, "entry": res.entry, "files": res.files}
    table = "\n".join(f"| `{k}` | `{v}` |" for k, v in res.hashes().items() if k.startswith("out:"))
    return (f"### {res.stage}: {'ran' if res.ran else 'up to date'} in {res.seconds:.1f} s; outputs pushed\n\n| output | md5 |\n|---|---|\n{table}\n\n"
            f"The stage's dvc.lock entry (the orchestrator merges it and pulls by these hashes):\n\n```yaml\n{yaml.safe_dump(doc, sort_keys=False)}```\n")


def _job_result(flow_run_id) -> dict:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as c:
        arts = c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[JOB_ARTIFACT])),
                                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    for a in arts:
        m = re.search(r"```yaml\n(.*?)```", str(a.data), re.S)
        if m:
            return yaml.safe_load(m.group(1)) or {}
    raise EvoError(f"job flow run {flow_run_id} finished without its {JOB_ARTIFACT!r} artifact (the stage's dvc.lock entry)")


@task(name="dispatch-stage", cache_policy=NO_CACHE)
def dispatch_stage(root: str, stage: str, deployment: str, repo_url: str | None = None, poll_s: float = 5.0) -> stagerun.StageResult:
    """Hand the stage to a work pool's deployment and wait; then receive its outputs by hash."""
    import time

    from prefect.deployments import run_deployment

    log = get_run_logger()
    root_p = Path(root)
    t0 = time.time()
    spec = stagerun.job_spec(root_p, stage, repo_url)
    ups = stagerun.push_inputs(root_p, stage)
    inputs = {o["path"]: o.get("md5") for u in ups for o in stagerun.lock_entry(root_p, u).get("outs", [])}
    key = hashlib.sha256(json.dumps([deployment, spec["commit"], stage, inputs], sort_keys=True).encode()).hexdigest()[:24]
    log.info(f"{stage}: dispatching to {deployment} (commit {spec['commit'][:12]}, inputs {inputs})")
    for attempt in range(3):
        fr = run_deployment(deployment, parameters={"spec": spec}, idempotency_key=f"{key}-{attempt}", poll_interval=poll_s,
                            flow_run_name=f"{stage}@{spec['commit'][:8]}", timeout=None)
        if fr.state and fr.state.is_completed():
            break
        log.warning(f"{stage}: job {fr.id} ended {fr.state.name if fr.state else '?'}; attempt {attempt + 2} of 3" if attempt < 2 else f"{stage}: job {fr.id} ended {fr.state.name if fr.state else '?'}")
    else:
        raise EvoError(f"stage {stage!r}: the job on {deployment} failed three times (last flow run {fr.id}, state {fr.state.name if fr.state else '?'}); see its logs in the Prefect UI")
    job = _job_result(fr.id)
    outs = stagerun.receive(root_p, stage, job["entry"], job.get("files") or {})
    log.info(f"{stage}: received {outs} from job {fr.id}")
    return stagerun.StageResult(stage, bool(job.get("ran")), round(time.time() - t0, 2), job["entry"], where=f"pool job {fr.id}")


@task(name="dvc-push", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def push_all(root: str) -> None:
    stagerun.dvc(["push"], Path(root))


@task(name="dvc-status", cache_policy=NO_CACHE)
def pipeline_up_to_date(root: str) -> bool:
    return stagerun.up_to_date(Path(root))


def publish(res: stagerun.StageResult, metrics: dict | None, root: str | None = None) -> None:
    md = stage_markdown(res, metrics)
    if root is not None:
        comparison = Path(root) / "data" / "eval" / "comparison.md"
        baselines = Path(root) / "data" / "baselines" / "summary.json"
        if res.stage == "evaluate" and comparison.exists():
            md = "Per-family success (%) on valid_seen / valid_unseen, calls per episode by verb:\n\n" + comparison.read_text() + "\n" + md
        elif res.stage == "baselines" and baselines.exists():
            from evoharness.evaluate import format_table

            tables = "\n".join(format_table(label, s_) for label, s_ in json.loads(baselines.read_text()).items())
            md = f"```\n{tables}\n```\n\n" + md
    create_markdown_artifact(key=artifact_key(res.stage), markdown=md, description=f"DVC stage {res.stage}")
