"""Prefect tasks that log a retrain to MLflow: a parent run, a child run per stage, the gate."""

from __future__ import annotations

import json
import platform
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import yaml
from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from evoharness.core import environment
from evoharness.core.errors import EvoError
from evoharness.core.secrets import redact
from evoharness.ops import stagerun, tracking
from evoharness.ops.vcs import git

# Stage → its metrics JSON (the DVC metrics file) and, for GRPO, the per-update curve.
METRICS = {
    "games": "data/metrics/games.json", "grpo_games": "data/metrics/grpo_games.json", "demos": "data/metrics/demos.json", "pairs": "data/metrics/pairs.json",
    "validate": "data/metrics/validation.json", "baselines": "data/metrics/baselines.json",
    "sft_inline": "data/metrics/sft-inline.json", "sft_env_only": "data/metrics/sft-env_only.json",
    "grpo": "data/metrics/grpo.json", "evaluate": "data/metrics/eval.json",
}
CURVE = "data/plots/grpo_curve.jsonl"


def read_metrics(root: Path, stage: str) -> dict:
    p = Path(root) / METRICS.get(stage, "-")
    try:
        return json.loads(p.read_text()) if p.is_file() else {}
    except ValueError as e:  # torn or corrupt: never read as "no metrics"
        raise EvoError(f"{p}: the {stage} stage's metrics file is not valid JSON ({e}); rerun the stage (`dvc repro -f {stage}`)") from None


def git_state(root: Path) -> dict[str, str]:
    commit = git(["rev-parse", "HEAD"], root, check=False) or "none"
    dirty = bool(git(["status", "--porcelain", "--untracked-files=no"], root, check=False))
    return {"git_commit": commit, "git_dirty": str(dirty).lower()}


@task(name="mlflow-start-retrain", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=3)
def start_parent(root: str, params_path: str, profile: str, pool: str | None, flow_run_id: str | None) -> str:
    c = tracking.client(Path(root))
    exp = tracking.experiment_id(c, Path(root))
    tags = {**git_state(Path(root)), "profile": profile, "pool": pool or "in-process", "kind": "retrain",
            "prefect.flow_run_id": flow_run_id or "none", "host": platform.node(), "machine": environment.machine()}
    run = c.create_run(exp, run_name=f"retrain-{profile}", tags=tags)
    params = yaml.safe_load(Path(root, params_path).read_text()) or {}
    prof = (params.get("profiles") or {}).get(profile, {})
    flat = {k: v for k, v in params.items() if k not in ("profiles", "promotion")}
    tracking.log_params(c, run.info.run_id, {**flat, "profile_spec": prof})
    return run.info.run_id


@task(name="mlflow-log-stage", task_run_name="mlflow: {res.stage}", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=3)
def log_stage(root: str, parent_id: str, res: stagerun.StageResult) -> str:
    """A child run for one stage: hashes of its inputs and outputs as tags, its metrics, its time."""
    c = tracking.client(Path(root))
    parent = c.get_run(parent_id)
    tags = {"mlflow.parentRunId": parent_id, "stage": res.stage, "cached": str(not res.ran).lower(), "where": res.where,
            "git_commit": parent.data.tags.get("git_commit", "none"), **tracking.stage_hash_tags(res.entry),
            **({"machine": res.machine} if res.machine else {})}
    metrics = read_metrics(Path(root), res.stage)
    if res.ran and isinstance(metrics, dict) and metrics.get("resumed_from"):  # trained only the steps after a checkpoint
        tags["resumed_from"] = str(metrics["resumed_from"])
    run = c.create_run(parent.info.experiment_id, run_name=res.stage, tags=tags)
    rid = run.info.run_id
    if res.stage == "evaluate":
        results = {}
        evald = Path(root) / "data" / "eval"
        for f in sorted(evald.glob("*/results.json")) if evald.exists() else []:
            results[f.parent.name] = json.loads(f.read_text())
        num = tracking.eval_metrics(results)
        if (evald / "comparison.md").exists():
            c.log_artifact(rid, str(evald / "comparison.md"))
    else:
        num = tracking.numeric(metrics)
    num["stage_seconds"] = res.seconds
    tracking.log_metrics(c, rid, num)
    if res.stage == "grpo":
        for row in tracking.curve_rows(Path(root) / CURVE):
            step = int(row.get("update", 0))
            tracking.log_metrics(c, rid, {f"curve.{k}": v for k, v in tracking.numeric(row).items() if k != "update"}, step=step)
    if res.entry:
        c.log_dict(rid, res.entry, "dvc_lock_entry.yaml")
    c.set_terminated(rid, "FINISHED")
    return rid


@task(name="git-record-retrain", cache_policy=NO_CACHE)
def record(root: str, parent_id: str, summary: dict) -> dict:
    """The retrain's git record (``reproduce.record_run``): a commit holding its dvc.lock, params and
    metrics, tagged ``retrain/<run id>`` and pushed to a network origin; the MLflow run names it. Made
    after the gate decided and before the decision is final (``finalize``): no alias moves without it."""
    from evoharness.ops.records import record_run

    msg = (f"retrain {parent_id}: {summary.get('profile', '')} profile; ran {summary.get('ran', 'none')}; reused {summary.get('cached', 'none')}; "
           f"{summary.get('decision', '?')} (model version {summary.get('model_version', '?')})\n\nMLflow run {parent_id}")
    tag, commit = record_run(Path(root), parent_id, msg, echo=print)
    c = tracking.client(Path(root))
    c.set_tag(parent_id, "git_ref", tag)
    c.set_tag(parent_id, "git_record_commit", commit)
    return {"git_ref": tag, "git_record_commit": commit}


@task(name="mlflow-finish-retrain", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=3)
def finish_parent(root: str, parent_id: str, params_path: str, status: str, summary: dict) -> None:
    c = tracking.client(Path(root))
    rootp = Path(root)
    lock = rootp / "dvc.lock"
    if lock.exists():
        c.log_artifact(parent_id, str(lock))
        for name, st in stagerun.parse_lock(lock.read_text()).items():
            for k, v in tracking.stage_hash_tags(st).items():
                if k.startswith("dvc.out."):
                    c.set_tag(parent_id, k, v)
    if (rootp / params_path).exists():
        c.log_artifact(parent_id, str(rootp / params_path))
    for k, v in summary.items():
        c.set_tag(parent_id, k, v)
    c.set_terminated(parent_id, status)


def close_orphan(root: str, holder: dict, log=print) -> None:
    """A retrain that died holding this checkout's slot (its orchestrator killed) left its MLflow parent
    run RUNNING and its Prefect flow run Running: both are marked so, in one line each."""
    why = "its orchestrator died mid-retrain (the next retrain of this checkout found the checkout's slot left by it)"
    run_id, fr_id = holder.get("parent_run_id"), holder.get("flow_run_id")
    if run_id:
        c = tracking.client(Path(root))
        try:
            run = c.get_run(run_id)
        except Exception:
            run = None
        if run is not None and run.info.status == "RUNNING":
            c.set_tag(run_id, "error", why)
            c.set_terminated(run_id, "FAILED")
            log(f"marked MLflow run {run_id} FAILED: {why}")
    if fr_id:
        from prefect.client.orchestration import get_client
        from prefect.states import Crashed

        with get_client(sync_client=True) as pc:
            try:
                fr = pc.read_flow_run(fr_id)
            except Exception:
                fr = None
            if fr is not None and fr.state is not None and not fr.state.is_final():
                pc.set_flow_run_state(fr_id, Crashed(message=why), force=True)
                log(f"marked flow run {fr.name} ({fr_id}) crashed: {why}")


def fail_parent(root: str, parent_id: str, error: str) -> None:
    try:
        c = tracking.client(Path(root))
        c.set_tag(parent_id, "error", redact(error)[:4000])
        c.set_terminated(parent_id, "FAILED")
    except Exception:  # the flow is failing already; its own error is the one to show
        pass


def _evidence(rootp: Path, params_path: str, games_md5: str, t) -> tuple:
    """The candidate's evaluation and those it must beat or not regress against, read from the evaluate and
    baselines stages."""
    from evoharness.agent.policies.spec import policy_label
    from evoharness.core.config import load_params
    from evoharness.ops import evidence

    mode = load_params(str(rootp / params_path)).episode.harness.mode
    evald, based = rootp / "data" / "eval", rootp / "data" / "baselines"

    def dirs(label: str) -> dict[str, Path]:
        if (evald / label).is_dir():
            return {s: evald / label / s for s in evidence.SPLITS}
        return {s: based / f"{policy_label(label)}-{mode}-{s}" for s in evidence.SPLITS}

    cand = evidence.evidence_from_dirs(evidence.CANDIDATE, dirs(evidence.CANDIDATE), games_md5)
    refs = {label: evidence.evidence_from_dirs(label, dirs(label), games_md5) for label in dict.fromkeys([*t.must_beat, *t.no_regression])}
    return cand, refs


GATE_LIMIT_PREFIX = "evoharness-gate-"
GATE_WAIT_S = 3600  # how long a retrain waits for another retrain's decision on the same model


@contextmanager
def gate_slot(root: str, params_path: str, profile: str, log=print) -> Iterator[str]:
    """The decision on one registered model, one retrain at a time across checkouts and machines: a Prefect
    global concurrency limit of 1 named after the model (made on first use), held from reading the champion to
    moving the aliases. Prefect's, not ours: it spans machines, which a file lock cannot. It holds for seconds,
    so a lease lost to a server restart costs little; the champion's compare-and-set (``promotion.finalize``)
    still refuses a move against a champion that moved meanwhile."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectAlreadyExists

    from evoharness.ops import decision

    pp, _ = decision.load_promotion(Path(root) / params_path, profile)
    name = decision.registered_name(pp, profile)
    limit = GATE_LIMIT_PREFIX + "".join(ch if ch.isalnum() or ch in "._-" else "-" for ch in name)
    with get_client(sync_client=True) as c:
        known = {g.name: g for g in c.read_global_concurrency_limits(limit=200)}
        if limit not in known:  # made on first use (asking first: the server logs a traceback for a limit it already has)
            try:
                c.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=limit, limit=1))
            except ObjectAlreadyExists:
                pass  # another retrain made it a moment ago
        held = known[limit].active_slots if limit in known else 0
    if held:
        log(f"waiting for the decision slot of {name} ({limit}): another retrain is deciding on it")
    holding = False
    try:
        with concurrency(limit, occupy=1, timeout_seconds=GATE_WAIT_S, lease_duration=120, strict=True):
            holding = True
            log(f"holding the decision slot of {name} ({limit})")
            yield name
    except TimeoutError:
        if holding:
            raise
        raise EvoError(f"another retrain held the decision slot of {name} ({limit}) for over {GATE_WAIT_S} s; nothing was decided") from None


@task(name="promotion-gate", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=3)
def promote(root: str, parent_id: str, params_path: str, profile: str, pool_remote_only: list[str] | None = None) -> dict:
    """The gate on the evaluated GRPO model: register and decide, leaving the decision pending until
    ``finalize`` (after the git record). A retry, or a later retrain of the same model, completes the decision a
    failed attempt left pending (``promotion.register``), never reports one it did not make. In a pool retrain
    the weights stay on the remote (``pool_remote_only``): dvc.lock binds the evaluation to them (evaluate's dep
    hash is grpo's output hash, the version's dvc_md5)."""
    from evoharness.ops import decision, evidence, promotion

    rootp = Path(root)
    pool_remote_only = list(pool_remote_only or [])
    pp, thresholds = decision.load_promotion(rootp / params_path, profile)
    c = tracking.client(rootp)
    name = decision.registered_name(pp, profile)
    grpo = stagerun.lock_entry(rootp, "grpo")
    md5 = next((o["md5"] for o in grpo.get("outs", []) if o["path"] == "data/models/grpo"), "")
    games_md5 = next((o["md5"] for o in stagerun.lock_entry(rootp, "panel").get("outs", []) if o["path"] == "data/panel"), "")  # the games the gate decides on
    evaluated = next((d_.get("md5") for d_ in stagerun.lock_entry(rootp, "evaluate").get("deps", []) if d_.get("path") == "data/models/grpo"), "")
    cand, refs = _evidence(rootp, params_path, games_md5, thresholds)
    results = json.loads((rootp / "data" / "eval" / evidence.CANDIDATE / "results.json").read_text())
    parent = c.get_run(parent_id)
    existing = c.search_model_versions(f"name='{name}' and tag.dvc_md5='{md5}'")
    if existing and (max(existing, key=lambda m: int(m.version)).tags or {}).get("decision.state") == "pending":
        run_id = max(existing, key=lambda m: int(m.version)).run_id  # finish the decision that run began
    else:
        run = c.create_run(parent.info.experiment_id, run_name="promote",
                           tags={"mlflow.parentRunId": parent_id, "stage": "promote", "git_commit": parent.data.tags.get("git_commit", "none"),
                                 "dvc.dep.data/models/grpo": md5})
        run_id = run.info.run_id
    report_dir = rootp / "reports" / "promotion" / md5[:12]
    model_dir = rootp / "data" / "models" / "grpo"
    if not model_dir.exists() and not stagerun.under("data/models/grpo", pool_remote_only):
        raise EvoError(f"promotion: {model_dir} is missing (dvc pull it, or run the retrain again); nothing was registered")
    d = promotion.register(c, name, run_id, model_dir if model_dir.exists() else None, md5, cand, refs, thresholds,
                           list(tracking.curve_rows(rootp / CURVE)), report_dir, pp.log_weights.get(profile, True), results.get("model_digest"),
                           evaluated)
    if not d.reused:
        # The agent is its weights and its bank: the bank it was evaluated (and is promoted) with, by digest, on the version.
        bank_file = rootp / "data" / "eval" / evidence.CANDIDATE / "bank.json"
        if bank_file.exists():
            c.log_artifact(run_id, str(bank_file), "model")
        for k in ("bank_digest", "bank_mode"):
            c.set_model_version_tag(name, d.version, k, str(results.get(k, "unknown")))
        c.set_terminated(run_id, "FINISHED")
    md_path = report_dir / "promotion.md"
    md = md_path.read_text() if md_path.exists() and not d.reused else f"# {name} version {d.version}: {d.word} (decided before; reused)\n\n" + "\n".join(f"- {r}" for r in d.reasons)
    create_markdown_artifact(key="promotion-decision", markdown=md, description=f"{name} v{d.version}: {d.word}")
    return {"model": name, "version": d.version, "decision": d.word, "reasons": d.reasons, "reused": d.reused,
            "checks": [c_.line() for c_ in d.checks], "run_id": d.extra.get("run_id"), "champion_before": d.champion_version}


@task(name="promotion-finalize", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=3)
def finalize(root: str, decision: dict, git_ref: str | None) -> dict:
    """Make the gate's decision final now that the run's git record exists: the version names the
    record, the aliases move, the state becomes complete (``promotion.finalize``)."""
    from evoharness.ops import promotion
    from evoharness.ops.decision import Decision

    d = Decision(promoted=decision["decision"] == "promoted", checks=[], reasons=list(decision["reasons"]), version=decision["version"],
             reused=bool(decision["reused"]), extra={"run_id": decision.get("run_id")},
             champion_version=decision["champion_before"])  # the compare-and-set's "compared with"
    promotion.finalize(tracking.client(Path(root)), decision["model"], d, git_ref)
    return decision
