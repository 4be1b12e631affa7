"""Prefect tasks over DVC stages: run one here, dispatch one to a work pool, receive its outputs.

DVC locks the repo, so two commands at once fail. A retrain holds its checkout's slot for its whole run
(``dvc_slot``): an exclusive ``flock`` on a file in the checkout, so a second retrain of the same checkout
(a scheduled one beside a manual one) waits for it. The slot is local on purpose: it guards this
checkout's own DVC state, it needs no server (a Prefect restart of any length cannot take it away; the
server's concurrency leases live in its memory unless configured otherwise) and the kernel frees it the
moment its holder dies (nothing to expire, nothing stuck). A pool job holds its own workspace the same
way on its box (``dispatch.workspace_lock``).

A dispatched job is watched, never waited on blindly, and only by clocks that cannot disagree: the
orchestrator notes, on its own monotonic clock, when it first sees each new heartbeat of the job's
flow run (prefect.yaml: every ``JOB_HEARTBEAT_S``), so a box whose clock is minutes off is judged like
any other. A job silent for ``pool.silence_s`` while the server answers, or running past its stage's
time limit, is moved to ``Cancelling``, so that its worker kills it (with everything it started), and the
retrain fails in one line naming the stage and the box. While the server is away nothing is judged;
once it is back, a job gets ``pool.fence_s`` plus a margin to be heard from again (a job that cannot
reach the server for ``fence_s`` stops its stage itself). A retrain rerun after its orchestrator died
adopts the job still in flight for the same commit, stage and inputs (or its finished result) instead
of dispatching a duplicate. The tasks carry no tags: Prefect takes a tag concurrency slot for every
tagged task run, one more write per task that a busy SQLite server may answer with 503 and a back-off.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import re
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import yaml
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from evoharness.core.errors import EvoError
from evoharness.ops import dispatch, stagerun

JOB_HEARTBEAT_S = 30  # prefect.yaml: PREFECT_FLOWS_HEARTBEAT_FREQUENCY of the stage jobs
JOB_ARTIFACT = "stage-job-result"
JOB_TAG = "evoharness-job:"
CANCEL_WAIT_S = 90  # how long the watch waits for a worker to kill a job it moved to Cancelling
LOST_MARGIN_S = 120  # after the server's return, on top of fence_s


def job_pickup_s() -> float:
    """How long a dispatched job may wait for a worker while none of the pool's workers is online."""
    import os

    return float(os.environ.get("EVOHARNESS_JOB_PICKUP_S", 600))


class DvcSlot:
    """The checkout's slot: an exclusive ``flock`` on ``.dvc/tmp/evoharness-retrain.lock``, held for the block.
    The holder writes who it is into the file (``mark``) and empties it when it leaves, so the next holder
    finds there what a holder that died left open (``previous``): its MLflow run, its flow run."""

    def __init__(self, root: Path, log=None):
        self.root, self.log = Path(root), log
        self.path = self.root / ".dvc" / "tmp" / "evoharness-retrain.lock"
        self._f = None
        self.previous: dict = {}

    def mark(self, **holder) -> None:
        self._f.seek(0)
        self._f.truncate()
        self._f.write(json.dumps(holder))
        self._f.flush()

    def __enter__(self) -> "DvcSlot":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a+")
        try:
            fcntl.flock(self._f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if self.log:
                self.log(f"waiting for the DVC slot of {self.root}: another retrain of this checkout holds it")
            fcntl.flock(self._f, fcntl.LOCK_EX)
        if self.log:
            self.log(f"holding the DVC slot of {self.root} ({self.path})")
        self._f.seek(0)
        try:
            self.previous = json.loads(self._f.read() or "{}")
        except ValueError:
            self.previous = {}
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.mark()  # left in order (a holder killed never gets here)
        self._f.seek(0)
        self._f.truncate()
        fcntl.flock(self._f, fcntl.LOCK_UN)
        self._f.close()


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
        from evoharness.ops.tracking import flatten

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
        for name in ("trajectories", "pairs", "trajectories_react", "pairs_react"):
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


def _last_heartbeat(c, flow_run_id):
    """The id of the job's newest heartbeat event (None: none yet). Only its identity is used: when it
    was sent is the job box's clock, which may be minutes off."""
    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter

    now = datetime.now(timezone.utc)  # a window wide enough for any box's clock (the default ends at this machine's now)
    page = c.read_events(EventFilter(occurred=EventOccurredFilter(since=now - timedelta(days=2), until=now + timedelta(days=2)),
                                     event=EventNameFilter(name=["prefect.flow-run.heartbeat"]),
                                     resource=EventResourceFilter(id=[f"prefect.flow-run.{flow_run_id}"])), limit=1)
    return str(page.events[0].id) if page.events else None


CLOCK_SKEW_ALLOWED_S = 24 * 3600  # how far behind a box's clock may be and still take a job at once


def _online_workers(c, pool: str) -> list[str]:
    try:
        return [w.name for w in c.read_workers_for_work_pool(pool) if str(w.status).upper().endswith("ONLINE")]
    except Exception:
        return []


def _box(fr) -> str:
    """The machine a job runs on (the ``box:`` tag its driver puts on its flow run) and its process id."""
    box = next((t.split(":", 1)[1] for t in fr.tags or [] if t.startswith("box:")), None)
    pid = str(fr.infrastructure_pid or "").rsplit(":", 1)[-1]
    return f"{box or 'a box not yet known'} (pid {pid or '?'})"


def cancel_job(c, fr, why: str, log=None, wait_s: float = CANCEL_WAIT_S, poll_s: float = 2.0) -> str:
    """Move the job to ``Cancelling`` so that its worker kills it, and wait for the worker to say so
    (``Cancelled``). A job whose worker is gone too cannot be killed by anyone: it is marked crashed."""
    from prefect.states import Cancelling, Crashed

    c.set_flow_run_state(fr.id, Cancelling(message=why), force=True)
    if log:
        log(f"job {fr.name} ({fr.id}) on {_box(fr)}: {why}; moved to Cancelling so that its worker kills it")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(poll_s)
        try:
            st = c.read_flow_run(fr.id).state
        except Exception:
            continue
        if st is not None and st.is_final():
            return f"it was stopped ({st.name})"
    c.set_flow_run_state(fr.id, Crashed(message=why + "; no worker answered its cancellation"), force=True)
    return f"no worker answered its cancellation within {wait_s:.0f} s (the box is gone), so it is marked crashed"


_ABORTS: dict[str, threading.Event] = {}


def group_abort(key: str) -> threading.Event:
    """The event that tells the watches of stages dispatched side by side that one of them failed."""
    return _ABORTS.setdefault(key, threading.Event())


def group_done(key: str) -> None:
    _ABORTS.pop(key, None)


def watch_job(flow_run_id, stage: str, pool: str, silence_s: float, time_limit_s: float, fence_s: float, poll_s: float = 5.0, log=None,
              abort: threading.Event | None = None):
    """Wait for a dispatched job's flow run to end, and never longer than its heartbeats and its time
    limit allow (see the module's docstring): a silent or overdue job is cancelled through its worker and
    the wait ends in one line naming the stage and the box; so does a job no online worker picked up
    within ``job_pickup_s()``, and a server away for longer than a job may run without it."""
    from prefect.client.orchestration import get_client

    t0 = time.monotonic()
    seen_beat, seen_at = None, t0  # the newest heartbeat and when (this clock) it was first seen
    running_since = None  # when (this clock) the job was first seen running
    allowed = silence_s + 120  # a job starting (its clone, its environment check) gets longer for its first heartbeat
    away_since = None
    with get_client(sync_client=True) as c:
        while True:
            try:
                fr = c.read_flow_run(flow_run_id)
                beat = _last_heartbeat(c, flow_run_id)
            except Exception as e:
                away_since = away_since or time.monotonic()
                away = time.monotonic() - away_since
                if away > fence_s + LOST_MARGIN_S:
                    raise EvoError(f"stage {stage!r}: the Prefect server did not answer for {away:.0f} s while job {flow_run_id} ran "
                                   f"({type(e).__name__}); the job stopped itself after fence_s {fence_s:.0f} s: rerun the retrain when the server is back") from None
                time.sleep(poll_s)
                continue
            now = time.monotonic()
            if away_since is not None:  # the server is back: judge the job from now on, with time to be heard from again
                if log:
                    log(f"{stage}: the Prefect server is back after {now - away_since:.0f} s; job {flow_run_id} has {fence_s + LOST_MARGIN_S:.0f} s to be heard from")
                away_since, seen_at = None, now
                allowed = max(allowed, fence_s + LOST_MARGIN_S)
            if beat != seen_beat:
                seen_beat, seen_at = beat, now
                if beat is not None:
                    allowed = silence_s
            st = fr.state
            if st is None or st.is_final():
                return fr
            if abort is not None and abort.is_set():  # a stage dispatched beside this one failed: the retrain stops now
                if st.is_running():
                    raise EvoError(f"stage {stage!r}: its job on {_box(fr)} is left running (a stage beside it failed); a rerun adopts it")
                from prefect.states import Cancelled

                c.set_flow_run_state(flow_run_id, Cancelled(message="a stage dispatched beside it failed"), force=True)
                raise EvoError(f"stage {stage!r}: its job was cancelled before it started (a stage beside it failed)")
            if st.is_running() and running_since is None:
                running_since = now
            if st.is_running() or st.is_pending():
                why = None
                if now - seen_at > allowed:
                    why = f"no heartbeat for {now - seen_at:.0f} s (pool.silence_s {silence_s:.0f})"
                elif running_since is not None and now - running_since > time_limit_s + 60:
                    why = f"running for {now - running_since:.0f} s, past its time limit of {time_limit_s:.0f} s (pool.time_limit_s)"
                if why:
                    outcome = cancel_job(c, fr, why, log)
                    raise EvoError(f"stage {stage!r}: its job on {_box(fr)} (pool {pool}) had {why}: {outcome}; flow run {fr.name} ({flow_run_id}); "
                                   "rerun the retrain")
            elif st.is_cancelling():
                pass  # someone cancels it; its worker will end it
            elif (now - t0) > job_pickup_s() and not _online_workers(c, pool):
                from prefect.states import Cancelled

                c.set_flow_run_state(flow_run_id, Cancelled(message="no live worker on the pool picked it up"), force=True)
                raise EvoError(f"stage {stage!r}: no live worker on pool {pool!r} picked up its job for {now - t0:.0f} s; start one "
                               f"(`prefect worker start --pool {pool} --limit 1`) and rerun the retrain")
            time.sleep(poll_s)


def find_job(c, key: str):
    """The jobs dispatched before for this key (commit, stage, inputs), newest first."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.client.schemas.sorting import FlowRunSort

    return c.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[JOB_TAG + key])), sort=FlowRunSort.EXPECTED_START_TIME_DESC)


# Independent stages are dispatched side by side (threads of one retrain): their DVC commands and dvc.lock
# edits in the shared checkout take turns (DVC's own repository lock would refuse a second command).
_CHECKOUT = threading.Lock()


@task(name="dispatch-stage", task_run_name="{stage} on pool {pool}", cache_policy=NO_CACHE)
def dispatch_stage(root: str, stage: str, deployment: str, pool: str, limits: dict, poll_s: float = 5.0, group: str | None = None) -> stagerun.StageResult:
    """Hand the stage to a work pool's deployment and watch it; then receive its outputs by hash.
    limits: silence_s, fence_s, time_limit_s, stay_on_remote (from params' ``pool``). A job already dispatched for the same
    commit, stage and inputs (by a retrain whose orchestrator died) is adopted, never duplicated."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    log = get_run_logger()
    root_p = Path(root)
    remote_only = list(limits.get("stay_on_remote") or [])
    t0 = time.time()
    with _CHECKOUT:
        if stagerun.stage_up_to_date(root_p, stage, remote_only):  # made before (a rerun after a failure): no job is needed
            log.info(f"{stage}: up to date here (dvc status): nothing to dispatch")
            return stagerun.StageResult(stage, False, round(time.time() - t0, 2), stagerun.lock_entry(root_p, stage), where="up to date here")
        spec = dispatch.job_spec(root_p, stage, f"--pool {pool}")
        spec.update(time_limit_s=limits["time_limit_s"], fence_s=limits["fence_s"])
        ups = dispatch.push_inputs(root_p, stage)
        inputs = {o["path"]: o.get("md5") for u in ups for o in stagerun.lock_entry(root_p, u).get("outs", [])}
    key = hashlib.sha256(json.dumps([deployment, spec["commit"], stage, inputs], sort_keys=True).encode()).hexdigest()[:24]
    with get_client(sync_client=True) as c:
        before = find_job(c, key)
    alive = [fr for fr in before if fr.state is not None and not fr.state.is_final() and not fr.state.is_cancelling()]
    done = [fr for fr in before if fr.state is not None and fr.state.is_completed()]
    if alive or done:
        fr = (alive or done)[0]
        log.info(f"{stage}: adopting job {fr.name} ({fr.id}, {fr.state.name}) dispatched before for commit {spec['commit'][:12]} and these inputs; "
                 "no duplicate is dispatched")
    else:
        log.info(f"{stage}: dispatching to {deployment} (commit {spec['commit'][:12]} of {spec['repo']}, inputs {inputs}, "
                 f"time limit {limits['time_limit_s']:.0f} s)")
        # Scheduled in the past: a worker takes runs scheduled before *its own* clock's now, so a job scheduled
        # at this machine's now would wait on a box whose clock is behind for as long as that clock is off.
        fr = run_deployment(deployment, parameters={"spec": spec}, idempotency_key=f"{key}-{len(before)}", tags=[JOB_TAG + key],
                            flow_run_name=f"{stage}@{spec['commit'][:8]}", timeout=0,
                            scheduled_time=datetime.now(timezone.utc) - timedelta(seconds=CLOCK_SKEW_ALLOWED_S))
    fr = watch_job(fr.id, stage, pool, limits["silence_s"], limits["time_limit_s"], limits["fence_s"], poll_s, log.info,
                   group_abort(group) if group else None)
    if not fr.state.is_completed():
        why = (fr.state.message or "").strip().splitlines()
        why = re.sub(r"^Flow run encountered an exception: (EvoError: )?", "", why[-1]) if why else "no message"
        raise EvoError(f"stage {stage!r}: its job on {_box(fr)} ended {fr.state.name} ({why[:400]}); "
                       f"flow run {fr.name} ({fr.id}) has its logs")
    job = _job_result(fr.id)
    with _CHECKOUT:
        outs = dispatch.receive(root_p, stage, job["entry"], job.get("files") or {}, remote_only)
    log.info(f"{stage}: received {outs} from job {fr.id} on {_box(fr)}")
    return stagerun.StageResult(stage, bool(job.get("ran")), round(time.time() - t0, 2), job["entry"], where=f"pool {pool} job {fr.id} on {fr.infrastructure_pid}",
                                machine=str(job.get("machine") or ""))


@task(name="dvc-push", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=5)
def push_all(root: str) -> None:
    stagerun.push_run_cache(Path(root))  # every output, and the run-cache, so any machine restores these runs


@task(name="dvc-status-cloud", cache_policy=NO_CACHE)
def check_on_remote(root: str) -> None:
    """Every output the run's dvc.lock names is on the DVC remote (``dvc status --cloud``), or one line: the
    git record, which others pull by, is made only then."""
    out = stagerun.dvc(["status", "--cloud", "--json"], Path(root))
    try:
        missing = json.loads(out or "{}")
    except ValueError:
        raise EvoError(f"dvc status --cloud in {root} answered something other than JSON ({out[:200]!r}); the run is not recorded") from None
    missing = {path: state for path, state in missing.items() if state != "deleted"}  # "deleted": on the remote, not here (the weights)
    if missing:
        raise EvoError(f"{len(missing)} output(s) of this run are not on the DVC remote after the push ({', '.join(sorted(missing)[:5])}); "
                       "the run is not recorded: rerun the retrain once the remote accepts them")


@task(name="dvc-status", cache_policy=NO_CACHE)
def pipeline_up_to_date(root: str, remote_only: list[str] | None = None) -> bool:
    return stagerun.up_to_date(Path(root), remote_only or ())


def publish(res: stagerun.StageResult, metrics: dict | None, root: str | None = None) -> None:
    md = stage_markdown(res, metrics)
    if root is not None:
        comparison = Path(root) / "data" / "eval" / "comparison.md"
        baselines = Path(root) / "data" / "baselines" / "summary.json"
        if res.stage == "evaluate" and comparison.exists():
            md = "Per-family success (%) on valid_seen / valid_unseen, calls per episode by verb:\n\n" + comparison.read_text() + "\n" + md
        elif res.stage == "baselines" and baselines.exists():
            from evoharness.agent.evaluate import format_table

            tables = "\n".join(format_table(label, s_) for label, s_ in json.loads(baselines.read_text()).items())
            md = f"```\n{tables}\n```\n\n" + md
    create_markdown_artifact(key=artifact_key(res.stage), markdown=md, description=f"DVC stage {res.stage}")
