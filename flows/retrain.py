"""``retrain``: the end-to-end flow. Data stages, the validation gate, SFT, GRPO, evaluation and the
promotion gate, each a visible task with an artifact; MLflow gets a parent run and a child per
stage. DVC decides what actually runs, so a rerun (after a kill, or with nothing changed) redoes
nothing that finished. With ``pool`` set, the model stages go to that work pool's stage deployment,
on machines that share nothing with this one but the git origin, the DVC remote and Prefect.
Everything that writes to the repository (DVC, the promotion, the end of the MLflow run) happens
while the retrain holds the repository's DVC slot. Whatever the end of the run needs (the git record and
its push, the DVC remote, the MLflow registry) is checked before the first stage, and the gate's decision
becomes final (its aliases move) only once the run's git record exists.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from evoharness.core.errors import EvoError
from evoharness.ops import stagerun
from evoharness.ops.tracking import client_uri, tracking_uri
from tasks import stages as st
from tasks import tracking as tr

GATE = "validate"


def preflight(root: Path, params_path: str, pool: str | None = None, echo=None):
    """Everything that can be checked before an hour of work, the end of the run included: the params
    and profile, git, the DVC remote (reachable and accepting a write) and its lock, the MLflow store
    (a run, an artifact, a model version and an alias; the champion's evidence), the git record (a commit
    can be made, the origin accepts its push), and for a pool what another machine can use. Each failure
    is one line; each check that passed says so in one line through ``echo``."""
    from evoharness.agent.training.profiles import load_profile
    from evoharness.core.config import load_params
    from evoharness.ops import decision, remote, tracking
    from evoharness.ops import preflight as pf
    from evoharness.ops.remote import check_shared, ensure_remote
    from evoharness.ops.vcs import check_remote

    say = echo or (lambda _m: None)
    if not (root / "dvc.yaml").exists():
        raise EvoError(f"{root} has no dvc.yaml: run retrain from the project root (or pass root=)")
    pf.check_git()
    given = (root / params_path).resolve()
    if given != (root / "params.yaml").resolve():
        # dvc.yaml's stages read params.yaml and the record commits it: another file would reach the flow only
        raise EvoError(f"params {params_path}: the stages read {root / 'params.yaml'} (dvc.yaml) and the git record commits it; "
                       "put these settings in params.yaml (DVC reruns the stages they change)")
    p = load_params(str(root / params_path))
    load_profile(p.profile, root / params_path)
    pf.check_stage_params(root)
    pp, _ = decision.load_promotion(root / params_path, p.profile)
    if pool:
        check_shared(root, f"--pool {pool}")  # before ensure_remote could make a local one
    ensure_remote(root)
    check_remote(root)
    say(f"preflight: DVC remote {remote.check_remote_writable(root)} accepts a write")
    stagerun.clear_stale_locks(root)
    tracking.check_tracking(tracking.tracking_uri(root))
    say(f"preflight: MLflow {pf.check_mlflow(root, decision.registered_name(pp, p.profile))} accepts a run, an artifact, a model version and an alias")
    commit, who = pf.check_record(root)
    say(f"preflight: the git record can be committed, as {who}")
    pushed_to = pf.check_origin_push(root, commit)
    say(f"preflight: origin {pushed_to} accepts the record's push" if pushed_to else "preflight: no network git origin; the record stays in this repository")
    if pool:
        unknown = [s for s in p.pool.stages if s not in stagerun.stages(root)]
        if unknown:
            raise EvoError(f"{root / params_path}: pool.stages names {unknown}, which dvc.yaml does not have")
    return p


class _Monitor:
    """MLflow's system metrics (CPU, memory, disk, network; GPU where present) on the parent run,
    started when the run exists (a callback of its task) and never after the retrain ended."""

    def __init__(self, root: Path):
        self.uri = client_uri(tracking_uri(root))  # no userinfo: MLflow prints the URI in links
        self.lock = threading.Lock()
        self.monitor = None
        self.done = False

    def start(self, fut) -> None:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        if not fut.state.is_completed():
            return
        with self.lock:
            if self.done:
                return
            self.monitor = SystemMetricsMonitor(fut.result(), sampling_interval=10, tracking_uri=self.uri)
            self.monitor.start()

    def finish(self) -> None:
        with self.lock:
            self.done = True
            m = self.monitor
            if m is None:
                return
            m.finish()
            # MLflow's loop logs its first sample after one interval and gives up for good when one read of the
            # run fails (a busy SQLite store answers "database is locked"): the run still gets one sample.
            if getattr(m, "_logging_step", 1) == 0:
                try:
                    m.collect_metrics()
                    m.publish_metrics(m.aggregate_metrics())
                    m.mlflow_logger.flush()
                except Exception:  # noqa: BLE001 -- system metrics are a convenience, never a reason to fail a retrain
                    pass


def check_deployment(name: str, pool: str) -> None:
    """A pool is reached through its stage deployment: say so before any stage runs."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as c:
        try:
            c.read_deployment_by_name(name)
        except ObjectNotFound:
            raise EvoError(f"--pool {pool}: no deployment {name!r} on the Prefect server; register prefect.yaml's deployments with `evoharness deploy`") from None


@flow(name="retrain", log_prints=True)
def retrain(root: str = ".", params: str = "params.yaml", pool: str | None = None, deployment: str | None = None, poll_s: float = 5.0) -> dict:
    """Retrain end to end. pool: a work pool whose ``train-stage`` deployment runs the model stages
    (``deployment`` overrides its name); none runs every stage in this process."""
    log = get_run_logger()
    rootp = Path(root).resolve()
    p = preflight(rootp, params, pool, log.info)
    profile = p.profile
    if pool:
        check_deployment(deployment or f"train-stage/train-stage-{pool}", pool)
    names = stagerun.stages(rootp)
    t0 = time.time()
    # The parent run is created beside the first stage (a fresh MLflow store migrates for seconds);
    # system metrics are sampled from the moment it exists.
    parent_f = tr.start_parent.submit(str(rootp), params, profile, pool, str(flow_run.id) if flow_run.id else None)
    monitor = _Monitor(rootp)
    parent_f.add_done_callback(monitor.start)
    summary: dict = {}
    try:
        with st.dvc_slot(rootp, log.info) as slot:  # one slot for everything this retrain writes
            if slot.previous:  # its holder died holding it: close what it left open
                tr.close_orphan(str(rootp), slot.previous, log.info)
            slot.mark(parent_run_id=parent_f.result(), flow_run_id=str(flow_run.id) if flow_run.id else None)
            remote_only = p.pool.stay_on_remote if pool else []  # the weights stay on the remote and the boxes
            all_cached = st.pipeline_up_to_date(str(rootp), remote_only)
            ran, cached = [], []

            def done(res: stagerun.StageResult) -> None:
                (ran if res.ran else cached).append(res.stage)
                log.info(f"{res.stage}: {'ran' if res.ran else 'cached'} ({res.seconds:.1f} s, {res.where})")
                st.publish(res, tr.read_metrics(rootp, res.stage), str(rootp))
                tr.log_stage(str(rootp), parent_f.result(), res)

            i = 0
            while i < len(names):
                stage = names[i]
                if not all_cached and pool and stage in p.pool.stages and stage != GATE:
                    # Consecutive pool stages that do not need each other's outputs go out together, to as many boxes.
                    group = [stage]
                    while i + len(group) < len(names) and names[i + len(group)] in p.pool.stages \
                            and not set(stagerun.producers(rootp, names[i + len(group)])) & set(group):
                        group.append(names[i + len(group)])
                    if len(group) > 1:
                        log.info(f"dispatching {', '.join(group)} side by side: none needs another's outputs")
                    key = f"{flow_run.id or id(group)}:{','.join(group)}"
                    futures = [st.dispatch_stage.submit(str(rootp), s, deployment or f"train-stage/train-stage-{pool}", pool,
                                                        {"silence_s": p.pool.silence_s, "fence_s": p.pool.fence_s,
                                                         "time_limit_s": p.pool.time_limit(profile, s), "stay_on_remote": remote_only},
                                                        poll_s, key) for s in group]
                    # The first failure stops the group: jobs not started are cancelled, running ones are left to a rerun.
                    # Waited on locally (never a future's .state while it runs: that asks the Prefect server, which
                    # may be away for minutes while the jobs go on).
                    by_wrapped = {f.wrapped_future: f for f in futures}
                    pending, failed = set(by_wrapped), None
                    while pending:
                        finished, pending = concurrent.futures.wait(pending, timeout=1.0, return_when=concurrent.futures.FIRST_COMPLETED)
                        for w in finished:
                            f = by_wrapped[w]
                            f.wait()  # done: its final state is now known here
                            if not f.state.is_completed() and failed is None:
                                failed = f
                                st.group_abort(key).set()
                    st.group_done(key)
                    for f in futures:
                        if f.state.is_completed():
                            done(f.result())
                    if failed is not None:
                        failed.result()  # raises its error
                    i += len(group)
                    continue
                if all_cached:
                    res = stagerun.StageResult(stage, False, 0.0, stagerun.lock_entry(rootp, stage))
                elif stage == GATE:
                    res = st.validate_stage(str(rootp), stage)
                else:
                    res = st.run_stage(str(rootp), stage)
                done(res)
                i += 1
            st.push_all(str(rootp))  # also what an earlier run's interrupted push left out
            st.check_on_remote(str(rootp))  # the record names only what the remote holds
            parent = parent_f.result()
            with tr.gate_slot(str(rootp), params, profile, log.info):  # one decision on this model at a time, anywhere
                decision = tr.promote(str(rootp), parent, params, profile, remote_only)  # decided, not yet final: no alias has moved
                summary = {"ran": ",".join(ran) or "none", "cached": ",".join(cached) or "none", "decision": decision["decision"],
                           "model_version": str(decision["version"]), "seconds": f"{time.time() - t0:.1f}"}
                rec = tr.record(str(rootp), parent, {**summary, "profile": profile})  # the git record of exactly what ran
                tr.finalize(str(rootp), decision, rec["git_ref"])  # the aliases move only once the record exists
            tr.finish_parent(str(rootp), parent, params, "FINISHED", summary)
        return {"parent_run_id": parent, "ran": ran, "cached": cached, "decision": decision, "seconds": round(time.time() - t0, 1), **rec}
    except BaseException as e:
        parent_f.wait()
        if parent_f.state.is_completed():
            tr.fail_parent(str(rootp), parent_f.result(), f"{type(e).__name__}: {e}")
        raise
    finally:
        monitor.finish()
