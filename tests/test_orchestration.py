"""Orchestration on real servers: the session's Prefect server, a real process worker in a
subprocess, the project's MLflow SQLite store, a real DVC repo and local remote. The project is a
copy of this one in a temp folder with micro parameters (every stage runs in seconds)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from evoharness.lineage import dvc, git
from project import MICRO, make_project


@pytest.fixture(scope="module")
def project(tmp_path_factory, mlflow_template):
    repo = make_project(tmp_path_factory.mktemp("orch"), MICRO)
    shutil.copy(mlflow_template, repo / "mlflow.db")  # already migrated: the store the CLI defaults to
    return repo


def _env(**extra) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", **extra)
    env.pop("MLFLOW_TRACKING_URI", None)  # the project's own sqlite store
    return env


def _cli(repo: Path, *args, env: dict | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evoharness.cli", *args], cwd=repo, env=env or _env(), capture_output=True,
                          text=True, timeout=timeout)


def _lock_holder(repo: Path) -> str:
    rw = repo / ".dvc" / "tmp" / "rwlock"
    try:
        return rw.read_text()
    except OSError:
        return ""


def _line(out: str, prefix: str) -> str:
    return next((ln for ln in out.splitlines() if ln.startswith(prefix)), "")


def test_retrain_killed_mid_stage_resumes_without_redoing_finished_stages(prefect_server, project):
    from evoharness import tracking

    proc = subprocess.Popen([sys.executable, "-m", "evoharness.cli", "run"], cwd=project, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    try:
        while "repro --single-item sft_inline" not in _lock_holder(project):
            assert proc.poll() is None, "retrain ended before SFT started"
            assert time.time() < deadline, "SFT never started"
            time.sleep(0.2)
        time.sleep(2)  # in the middle of the SFT stage
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
    assert {"games", "demos", "pairs", "validate", "baselines", "base_model"} <= set(lock) and "sft_inline" not in lock
    before = {s: lock[s]["outs"] for s in ("games", "demos", "base_model")}
    games_mtime = (project / "data" / "games").stat().st_mtime_ns

    t0 = time.time()
    r = _cli(project, "run")
    assert r.returncode == 0, r.stderr[-3000:]
    assert _line(r.stdout, "stages run:").startswith("stages run: sft_inline, sft_env_only, grpo, evaluate; reused from DVC: games, demos, pairs, validate, baselines, base_model")
    assert "PROMOTED" in _line(r.stdout, "decision:")
    lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
    assert {s: lock[s]["outs"] for s in before} == before and (project / "data" / "games").stat().st_mtime_ns == games_mtime
    resumed_s = time.time() - t0

    # MLflow: the parent run carries the commit, every output hash, dvc.lock and params; a child per stage.
    os.environ["MLFLOW_TRACKING_URI"] = tracking.tracking_uri(project)
    try:
        c = tracking.client(project)
        exp = c.get_experiment_by_name(tracking.EXPERIMENT)
        parents = c.search_runs([exp.experiment_id], "tags.kind = 'retrain' and attributes.status = 'FINISHED'")
        every = [(x.info.run_name, x.info.status, x.data.tags.get("kind"), x.data.tags.get("error", "")[:300])
                 for x in c.search_runs([exp.experiment_id], "")]
        assert len(parents) == 1, f"{tracking.tracking_uri(project)}: {every}\n{r.stdout[-2000:]}"
        p = parents[0]
        assert p.data.tags["git_commit"] == git(["rev-parse", "HEAD"], project)
        grpo_md5 = next(o["md5"] for o in lock["grpo"]["outs"] if o["path"] == "data/models/grpo")
        assert p.data.tags["dvc.out.data/models/grpo"] == grpo_md5 and p.data.tags["decision"] == "promoted"
        assert {a.path for a in c.list_artifacts(p.info.run_id)} >= {"dvc.lock", "params.yaml"}
        assert p.data.params["profile"] == "tiny-cpu" and not any("key" in k.lower() for k in p.data.params)
        assert "system/cpu_utilization_percentage" in p.data.metrics  # sampled from when the parent run exists
        children = {r.data.tags["stage"]: r for r in c.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{p.info.run_id}'")}
        assert set(children) == {*lock, "promote"}
        assert children["games"].data.tags["cached"] == "true" and children["sft_inline"].data.tags["cached"] == "false"
        assert children["sft_inline"].data.tags["dvc.dep.data/pairs"] == next(o["md5"] for o in lock["pairs"]["outs"] if o["path"] == "data/pairs")
        assert "grpo-inline.valid_seen.all.success" in children["evaluate"].data.metrics
        assert "grpo-inline.valid_unseen.calls.track" in children["evaluate"].data.metrics
        assert len(c.get_metric_history(children["grpo"].info.run_id, "curve.success")) == MICRO["profiles"]["tiny-cpu"]["grpo"]["steps"]
        mv = c.get_model_version_by_alias("evoharness-test-tiny-cpu", "champion")
        assert mv.tags["dvc_md5"] == grpo_md5 and mv.tags["decision"] == "promoted"
    finally:
        os.environ.pop("MLFLOW_TRACKING_URI", None)

    # Nothing changed: every stage is reused, nothing new is registered or decided.
    t0 = time.time()
    r = _cli(project, "run")
    noop_s = time.time() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    assert _line(r.stdout, "stages run:").startswith("stages run: none; reused from DVC: games, demos")
    assert "decided before; nothing changed" in _line(r.stdout, "decision:")
    print(f"resumed retrain {resumed_s:.0f} s; no-op retrain {noop_s:.1f} s")
    git(["add", "-A"], project)
    git(["commit", "-q", "-m", "retrain"], project)

    # Each training stage depends on its own slice of its own profile: a GRPO-only change leaves the
    # base model and SFT up to date, and the other profile's changes touch nothing here.
    text = (project / "params.yaml").read_text()
    p = yaml.safe_load(text)
    p["profiles"]["tiny-cpu"]["grpo"]["learning_rate"] *= 2
    p["profiles"]["qwen3-8b-h200"] = {"base": {"kind": "pretrained", "path": "/nowhere"}, "launcher": "local", "num_processes": 1,
                                      "deepspeed_config": "", "decoding": "constrained", "episode_workers": 1}
    (project / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    try:
        assert set(json.loads(dvc(["status", "--json"], project) or "{}")) == {"grpo", "evaluate"}
    finally:
        (project / "params.yaml").write_text(text)
    assert json.loads(dvc(["status", "--json"], project) or "{}") == {}


def test_a_pool_worker_runs_the_sft_job_and_the_orchestrator_gets_its_outputs_by_hash(prefect_server, project, tmp_path):
    from prefect import flow
    from prefect.client.orchestration import get_client

    from evoharness import stagerun
    from tasks.stages import dispatch_stage, limit_name

    r = _cli(project, "deploy")
    assert r.returncode == 0, r.stderr[-2000:]
    with get_client(sync_client=True) as c:
        dep = c.read_deployment_by_name("retrain/retrain")
        assert [s.schedule.cron for s in dep.schedules] == ["0 3 * * 1"] and dep.work_pool_name == "cpu"
        assert {p.name for p in c.read_work_pools()} >= {"cpu", "h200"}
        assert c.read_deployment_by_name("train-stage/train-stage-h200").work_pool_name == "h200"
        assert c.read_global_concurrency_limit_by_name(limit_name(project)).limit == 1
        c.pause_deployment(dep.id)  # its cron must not fire on this worker during the test

    dvc(["repro", "base_model", "pairs"], project)  # no-op after the previous test; builds them otherwise
    p = yaml.safe_load((project / "params.yaml").read_text())
    p["profiles"]["tiny-cpu"]["sft"]["max_steps"] = 4  # a new SFT job
    (project / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    git(["add", "-A"], project)
    git(["commit", "-q", "-m", "sft: 4 steps"], project)

    home = tmp_path / "worker-home"
    log = open(tmp_path / "worker.log", "w")
    worker = subprocess.Popen([str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool", "cpu", "--type", "process"],
                              cwd=tmp_path, env=_env(EVOHARNESS_WORKER_HOME=str(home)), stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)

    @flow
    def orchestrate():
        return dispatch_stage(str(project), "sft_inline", "train-stage/train-stage-cpu", None, 1.0)

    try:
        res = orchestrate()
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:  # a worker can take its time to deregister; the test is over
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
        log.close()
    assert res.where.startswith("pool job") and res.ran, (tmp_path / "worker.log").read_text()[-3000:]
    ws = stagerun.workspace(str(project), "sft_inline", home)
    assert (ws / "data" / "models" / "sft-inline" / "config.json").exists()  # the job ran in its own checkout
    job_lock = yaml.safe_load((ws / "dvc.lock").read_text())["stages"]["sft_inline"]
    here = yaml.safe_load((project / "dvc.lock").read_text())["stages"]["sft_inline"]
    assert here == job_lock == res.entry
    out = dvc(["status", "sft_inline", "--json"], project)
    assert json.loads(out or "{}") == {}  # DVC agrees: the outputs here are the job's, byte for byte
    assert json.loads((project / "data" / "metrics" / "sft-inline.json").read_text())["steps"] == 4
    assert "submitting flow run" in (tmp_path / "worker.log").read_text()


def test_an_unreachable_prefect_server_is_one_line(project):
    env = _env(PREFECT_API_URL="http://127.0.0.1:9/api")
    for args in (["run"], ["deploy"]):
        r = _cli(project, *args, env=env, timeout=120)
        assert r.returncode == 2, r.stderr[-2000:]
        assert r.stderr.strip().splitlines()[-1].startswith("error: Prefect server http://127.0.0.1:9/api is unreachable")


def test_bad_data_stops_the_flow_with_a_report_and_is_quarantined(prefect_server, project):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from evoharness import tracking

    p = yaml.safe_load((project / "params.yaml").read_text())
    p["validate"]["max_tokens"] = 64  # every SFT pair is now too long for the profile: the gate must stop the flow
    (project / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    r = _cli(project, "run")
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: dvc repro --single-item validate failed") and "validation failed" in last and "quarantine" in last
    quarantined = sorted((project / "data" / "quarantine").iterdir())
    assert quarantined and any((q / "train.parquet").exists() for q in quarantined)  # moved, with the report, not lost
    assert "stages run" not in r.stdout  # nothing after the gate ran
    with get_client(sync_client=True) as c:
        arts = c.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["validation-report"])))
    assert arts and "expect_column_values_to_be_between" in str(arts[0].data)
    os.environ["MLFLOW_TRACKING_URI"] = tracking.tracking_uri(project)
    try:
        c = tracking.client(project)
        exp = c.get_experiment_by_name(tracking.EXPERIMENT)
        failed = c.search_runs([exp.experiment_id], "tags.kind = 'retrain' and attributes.status = 'FAILED'")
        assert failed and "validation failed" in failed[0].data.tags["error"]
    finally:
        os.environ.pop("MLFLOW_TRACKING_URI", None)


def test_a_pool_without_its_deployment_is_one_line(prefect_server):
    from evoharness.errors import EvoError
    from flows.retrain import check_deployment

    with pytest.raises(EvoError, match=r"--pool gpu9: no deployment 'train-stage/train-stage-gpu9' on the Prefect server; .*evoharness deploy"):
        check_deployment("train-stage/train-stage-gpu9", "gpu9")
