"""Prefect tasks over DVC stages: run one here, dispatch one to a work pool, receive its outputs.

DVC locks the repo, so two commands at once fail. Every DVC command runs while its caller holds
the repository's slot of a global concurrency limit of one: a retrain takes the slot once for its
whole run (a second retrain of the same repo, say a scheduled one beside a manual one, waits for
it), and a pool job takes the slot of its own checkout. The slot is per repository path: a job's
clean checkout on a worker is another repository, so the orchestrator waiting for it never
deadlocks it. The slot is a lease (``DvcSlot``) renewed every ``RENEW_S``; one that cannot be
renewed (revoked, expired while the server was away) stops the retrain at once, killing the DVC
command it was running, instead of letting it run unprotected beside the next holder. A killed
holder's lease expires ``LEASE_S`` after its last renewal.

A dispatched job is watched, never waited on blindly: its flow run sends Prefect's heartbeats every
``JOB_HEARTBEAT_S`` (prefect.yaml sets the frequency), and a job silent for ``job_lease_s()`` (a
worker killed, its machine gone) is marked crashed and the retrain stops with one line naming the
stage and the worker. The tasks carry no tags: Prefect takes a tag concurrency slot for every tagged
task run, one more write per task that a busy SQLite server may answer with 503 and a back-off.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from pathlib import Path

import yaml
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from evoharness import stagerun
from evoharness.errors import EvoError

LEASE_S = 60  # the server's shortest lease
RENEW_S = 10
JOB_HEARTBEAT_S = 30  # prefect.yaml: PREFECT_FLOWS_HEARTBEAT_FREQUENCY of the stage jobs (Prefect's minimum)
JOB_ARTIFACT = "stage-job-result"


def job_lease_s() -> float:
    """How long a running job may stay silent before it is declared dead: three heartbeats."""
    return float(os.environ.get("EVOHARNESS_JOB_LEASE_S", 3 * JOB_HEARTBEAT_S))


def job_pickup_s() -> float:
    """How long a dispatched job may wait for a worker while none of the pool's workers is online."""
    return float(os.environ.get("EVOHARNESS_JOB_PICKUP_S", 600))


def limit_name(root: Path) -> str:
    return "dvc-" + hashlib.sha256(str(Path(root).resolve()).encode()).hexdigest()[:12]


def ensure_limit(root: Path) -> str:
    from prefect.client.orchestration import get_client

    name = limit_name(root)
    with get_client(sync_client=True) as c:
        c.upsert_global_concurrency_limit_by_name(name, 1)
    return name


class DvcSlot:
    """The repository's slot of its global concurrency limit (one), held as a lease for the block.
    Every DVC command inside is guarded (``lineage.guarded``): once the lease is lost, the command
    running is killed and the block raises one line. ``check()`` raises the same between commands."""

    def __init__(self, root: Path, log=None):
        self.root, self.name, self.log = Path(root), limit_name(root), log
        self.lease_id = None
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> None:
        if self.lost:
            raise EvoError(self.lost)

    def _acquire(self, c) -> None:
        import httpx

        said = False
        while True:
            try:
                r = c.increment_concurrency_slots_with_lease([self.name], 1, "concurrency", LEASE_S)
                self.lease_id = r.json()["lease_id"]
                return
            except httpx.HTTPStatusError as e:
                if e.response.status_code != 423:  # 423: every slot is held (another retrain of this repository)
                    raise
                if not said and self.log:
                    self.log(f"waiting for the DVC slot of {self.root} ({self.name}): another retrain of this repository holds it")
                    said = True
                time.sleep(min(float(e.response.headers.get("Retry-After", 2) or 2), 5))

    def _renew_loop(self) -> None:
        import httpx
        from prefect.client.orchestration import get_client

        last_ok = time.monotonic()
        with get_client(sync_client=True) as c:
            while not self._stop.wait(RENEW_S):
                try:
                    c.renew_concurrency_lease(self.lease_id, LEASE_S)
                    last_ok = time.monotonic()
                except httpx.HTTPStatusError as e:
                    if e.response.status_code in (404, 410):
                        self.lost = (f"lost the DVC slot of {self.root} (lease {self.lease_id} was revoked or expired); stopped rather than "
                                     "run DVC beside another holder; rerun the retrain")
                        return
                except Exception as e:  # the server away: the lease still holds until LEASE_S after the last renewal
                    if time.monotonic() - last_ok > LEASE_S - RENEW_S:
                        self.lost = (f"could not renew the DVC slot of {self.root} for {time.monotonic() - last_ok:.0f} s ({type(e).__name__}); "
                                     "its lease expires; stopped rather than run DVC unprotected; rerun the retrain")
                        return

    def __enter__(self) -> "DvcSlot":
        from prefect.client.orchestration import get_client

        from evoharness.lineage import guarded

        with get_client(sync_client=True) as c:
            self._acquire(c)
        if self.log:
            self.log(f"holding the DVC slot of {self.root} (limit {self.name}, lease {self.lease_id})")
        self._thread = threading.Thread(target=self._renew_loop, daemon=True, name=f"dvc-slot-{self.name}")
        self._thread.start()
        self._guard = guarded(self.check)
        self._guard.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        from prefect.client.orchestration import get_client

        self._guard.__exit__(None, None, None)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=RENEW_S + 5)
        if not self.lost:
            try:
                with get_client(sync_client=True) as c:
                    c.release_concurrency_slots_with_lease(self.lease_id)
            except Exception:  # it expires LEASE_S after the last renewal anyway
                pass
        if self.lost and exc_type is None:
            raise EvoError(self.lost)


def dvc_slot(root: Path, log=None) -> DvcSlot:
    return DvcSlot(root, log)


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


@task(name="dvc-stage", task_run_name="{stage}", cache_policy=NO_CACHE)
def run_stage(root: str, stage: str) -> stagerun.StageResult:
    """Run the stage here (``dvc repro --single-item``); DVC skips it when nothing changed."""
    return stagerun.run_here(Path(root), stage)


@task(name="validation-gate", task_run_name="{stage} (Great Expectations gate)", cache_policy=NO_CACHE)
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
    doc = {"stage": res.stage, "ran": res.ran, "seconds": res.seconds, "machine": res.machine, "entry": res.entry, "files": res.files}
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


def _last_heartbeat(c, flow_run_id, since):
    """When the job's flow run last sent Prefect's heartbeat event (None: not since ``since``)."""
    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter

    page = c.read_events(EventFilter(occurred=EventOccurredFilter(since=since), event=EventNameFilter(name=["prefect.flow-run.heartbeat"]),
                                     resource=EventResourceFilter(id=[f"prefect.flow-run.{flow_run_id}"])), limit=1)
    return page.events[0].occurred if page.events else None


def _online_workers(c, pool: str) -> list[str]:
    try:
        return [w.name for w in c.read_workers_for_work_pool(pool) if str(w.status).upper().endswith("ONLINE")]
    except Exception:
        return []


def watch_job(flow_run_id, stage: str, pool: str, poll_s: float = 5.0, log=None):
    """Wait for a dispatched job's flow run to end, and never longer than its heartbeats allow: a job
    silent for ``job_lease_s()`` is marked crashed and the wait ends in one line; so does a job no
    online worker picked up within ``job_pickup_s()``, and a Prefect server that stays unreachable."""
    from datetime import datetime, timedelta, timezone

    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Crashed

    lease, t0, failures = job_lease_s(), time.time(), 0
    with get_client(sync_client=True) as c:
        while True:
            try:
                fr = c.read_flow_run(flow_run_id)
                failures = 0
            except Exception as e:
                failures += 1
                if failures * poll_s > max(lease, 60):
                    raise EvoError(f"stage {stage!r}: the Prefect server did not answer for {failures * poll_s:.0f} s while job {flow_run_id} ran "
                                   f"({type(e).__name__}); the job may still run: see its flow run when the server is back") from None
                time.sleep(poll_s)
                continue
            st = fr.state
            if st is None or st.is_final():
                return fr
            now = datetime.now(timezone.utc)
            who = fr.infrastructure_pid or "not yet known"
            if st.is_running() or st.is_pending():
                entered = st.timestamp
                beat = _last_heartbeat(c, flow_run_id, entered - timedelta(seconds=1))
                # A pending job is starting (its clone, its process): the first heartbeat may take a while longer.
                allowed = lease if (beat is not None or st.is_running()) else lease + 120
                silent = (now - (beat or entered)).total_seconds()
                if silent > allowed:
                    msg = f"no heartbeat for {silent:.0f} s from the {stage} job on worker {who} (pool {pool}): the worker died or lost its machine"
                    c.set_flow_run_state(flow_run_id, Crashed(message=msg), force=True)
                    raise EvoError(f"stage {stage!r}: {msg}; its flow run {fr.name} ({flow_run_id}) is marked crashed; rerun the retrain with a live worker")
            elif (time.time() - t0) > job_pickup_s() and not _online_workers(c, pool):
                c.set_flow_run_state(flow_run_id, Cancelled(message="no live worker on the pool picked it up"), force=True)
                raise EvoError(f"stage {stage!r}: no live worker on pool {pool!r} picked up its job for {time.time() - t0:.0f} s; start one "
                               f"(`prefect worker start --pool {pool}`) and rerun the retrain")
            time.sleep(poll_s)


@task(name="dispatch-stage", task_run_name="{stage} on pool {pool}", cache_policy=NO_CACHE)
def dispatch_stage(root: str, stage: str, deployment: str, pool: str, poll_s: float = 5.0) -> stagerun.StageResult:
    """Hand the stage to a work pool's deployment and watch it; then receive its outputs by hash."""
    from prefect.deployments import run_deployment
    from prefect.runtime import flow_run

    log = get_run_logger()
    root_p = Path(root)
    t0 = time.time()
    spec = stagerun.job_spec(root_p, stage, f"--pool {pool}")
    ups = stagerun.push_inputs(root_p, stage)
    inputs = {o["path"]: o.get("md5") for u in ups for o in stagerun.lock_entry(root_p, u).get("outs", [])}
    # One job per retrain and stage: a retry of this task finds the same job, a later retrain makes its own.
    key = hashlib.sha256(json.dumps([deployment, spec["commit"], stage, inputs, str(flow_run.id)], sort_keys=True).encode()).hexdigest()[:24]
    log.info(f"{stage}: dispatching to {deployment} (commit {spec['commit'][:12]} of {spec['repo']}, inputs {inputs})")
    fr = run_deployment(deployment, parameters={"spec": spec}, idempotency_key=key, flow_run_name=f"{stage}@{spec['commit'][:8]}", timeout=0)
    fr = watch_job(fr.id, stage, pool, poll_s, log.info)
    if not fr.state.is_completed():
        why = (fr.state.message or "").strip().splitlines()
        raise EvoError(f"stage {stage!r}: its job on worker {fr.infrastructure_pid or '?'} ended {fr.state.name} ({why[-1][:300] if why else 'no message'}); "
                       f"flow run {fr.name} ({fr.id}) has its logs")
    job = _job_result(fr.id)
    outs = stagerun.receive(root_p, stage, job["entry"], job.get("files") or {})
    log.info(f"{stage}: received {outs} from job {fr.id} on {fr.infrastructure_pid}")
    return stagerun.StageResult(stage, bool(job.get("ran")), round(time.time() - t0, 2), job["entry"], where=f"pool {pool} job {fr.id} on {fr.infrastructure_pid}",
                                machine=str(job.get("machine") or ""))


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
