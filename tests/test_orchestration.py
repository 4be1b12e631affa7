"""Orchestration on real servers: the session's Prefect server, a real process worker in a
subprocess, the project's MLflow SQLite store, a real DVC repo and local remote. The project is a
copy of this one in a temp folder with micro parameters (every stage runs in seconds)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from evoharness.ops.vcs import dvc, git
from hosts import start_consolidator
from project import commit, make_project, MICRO


@pytest.fixture(scope="module")
def project(tmp_path_factory, mlflow_template):
    repo = make_project(tmp_path_factory.mktemp("orch"), MICRO)
    shutil.copy(mlflow_template, repo / "mlflow.db")  # already migrated: the store the CLI defaults to
    return repo


def _env(**extra) -> dict:
    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)  # the project's own sqlite store, unless the test names a server
    env.update(TOKENIZERS_PARALLELISM="false", **extra)
    return env


def _cli(repo: Path, *args, env: dict | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=repo, env=env or _env(), capture_output=True,
                          text=True, timeout=timeout)


def _line(out: str, prefix: str) -> str:
    return next((ln for ln in out.splitlines() if ln.startswith(prefix)), "")


def test_retrain_killed_mid_stage_resumes_without_redoing_finished_stages(prefect_server, project):
    from evoharness.ops import tracking
    from evoharness.core import environment

    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run"], cwd=project, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    try:
        while not list((project / "data" / "checkpoints" / "sft-inline").glob("*/checkpoint-1")):
            assert proc.poll() is None, "retrain ended before SFT saved its first checkpoint"
            assert time.time() < deadline, "SFT never started"
            time.sleep(0.05)  # in the middle of the SFT stage: its first checkpoint is saved, the rest is not
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
    line = _line(r.stdout, "stages run:")
    # The killed SFT resumes from its checkpoint, or, if it had finished just before the kill, DVC
    # restores it from its run cache: either way nothing that finished runs again.
    assert (line.startswith("stages run: sft_inline, sft_env_only, grpo, evaluate; reused from DVC: games, grpo_games, panel, demos, pairs, demos_react, pairs_react, validate, baselines, base_model")
            or line.startswith("stages run: sft_env_only, grpo, evaluate; reused from DVC: games, grpo_games, panel, demos, pairs, demos_react, pairs_react, validate, baselines, base_model, sft_inline")), line
    sft = json.loads((project / "data" / "metrics" / "sft-inline.json").read_text())
    assert sft["resumed_from"] is not None or "sft_inline" not in line.split(";")[0], sft
    assert "PROMOTED" in _line(r.stdout, "decision:")
    lock = yaml.safe_load((project / "dvc.lock").read_text())["stages"]
    assert {s: lock[s]["outs"] for s in before} == before and (project / "data" / "games").stat().st_mtime_ns == games_mtime
    resumed_s = time.time() - t0
    # The killed retrain's MLflow run and flow run are closed by the rerun, which found the checkout's slot it left.
    dead = re.search(r"marked MLflow run ([0-9a-f]{32}) FAILED: its orchestrator died mid-retrain", r.stdout + r.stderr)
    assert dead and "marked flow run " in r.stdout + r.stderr, r.stdout[-3000:]

    # MLflow: the parent run carries the commit, every output hash, dvc.lock and params; a child per stage.
    os.environ["MLFLOW_TRACKING_URI"] = tracking.tracking_uri(project)
    try:
        c = tracking.client(project)
        exp = c.get_experiment_by_name(tracking.EXPERIMENT)
        parents = c.search_runs([exp.experiment_id], "tags.kind = 'retrain' and attributes.status = 'FINISHED'")
        every = [(x.info.run_name, x.info.status, x.data.tags.get("kind"), x.data.tags.get("error", "")[:300])
                 for x in c.search_runs([exp.experiment_id], "")]
        assert len(parents) == 1, f"{tracking.tracking_uri(project)}: {every}\n{r.stdout[-2000:]}"
        failed = c.get_run(dead.group(1))
        assert failed.info.status == "FAILED" and "orchestrator died" in failed.data.tags["error"]
        p = parents[0]
        assert p.data.tags["git_commit"] == git(["rev-parse", "HEAD"], project)
        grpo_md5 = next(o["md5"] for o in lock["grpo"]["outs"] if o["path"] == "data/models/grpo")
        assert p.data.tags["dvc.out.data/models/grpo"] == grpo_md5 and p.data.tags["decision"] == "promoted"
        assert {a.path for a in c.list_artifacts(p.info.run_id)} >= {"dvc.lock", "params.yaml"}
        assert p.data.params["profile"] == "tiny-cpu" and not any("key" in k.lower() for k in p.data.params)
        assert "system/cpu_utilization_percentage" in p.data.metrics  # sampled from when the parent run exists
        children = {r.data.tags["stage"]: r for r in c.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{p.info.run_id}'")}
        assert set(children) == {*lock, "promote"}
        sft_ran = "sft_inline" in line.split(";")[0]
        # a stage that resumed training says so on its run (the export of stage times leaves such a retrain out)
        assert children["sft_inline"].data.tags.get("resumed_from") == (sft["resumed_from"] if sft_ran else None)
        assert children["games"].data.tags["cached"] == "true" and "machine" not in children["games"].data.tags
        # The processor kind, which decides whether CPU training reproduces a hash: the scheduler's, and each stage's that ran.
        assert p.data.tags["machine"] == environment.machine() and children["grpo"].data.tags["machine"] == environment.machine()
        assert children["sft_inline"].data.tags["cached"] == ("false" if sft_ran else "true"), line
        assert children["sft_inline"].data.tags["dvc.dep.data/pairs"] == next(o["md5"] for o in lock["pairs"]["outs"] if o["path"] == "data/pairs")
        assert "grpo-inline.valid_seen.all.success" in children["evaluate"].data.metrics
        assert "grpo-inline.valid_unseen.calls.track" in children["evaluate"].data.metrics
        assert len(c.get_metric_history(children["grpo"].info.run_id, "curve.success")) == MICRO["profiles"]["tiny-cpu"]["grpo"]["steps"]
        mv = c.get_model_version_by_alias("evoharness-test-tiny-cpu", "champion")
        assert mv.tags["dvc_md5"] == grpo_md5 and mv.tags["decision"] == "promoted"
        # The run's git record, made on a machine with no git identity (conftest), before the champion moved.
        tag = f"retrain/{p.info.run_id}"
        assert p.data.tags["git_ref"] == tag and mv.tags["git_ref"] == tag and _line(r.stdout, "git record:").startswith(f"git record: {tag} (")
        assert git(["log", "-1", "--format=%an <%ae> %s", tag], project).startswith(f"evoharness <retrain@localhost> retrain {p.info.run_id}:")
        assert git(["config", "--get", "user.email"], project, check=False) == ""  # nothing written to any config
        # no_regression (the default, sft-inline): read from the evaluate stage's output and checked split by split.
        for k in ("seen_vs_sft-inline", "unseen_vs_sft-inline"):
            assert re.match(rf"{k}: [01]\.\d{{3}} >= 0\.050 -> pass \(McNemar exact, one-sided: sft-inline-only wins \d+", mv.tags[f"check.{k}"]), mv.tags
    finally:
        os.environ.pop("MLFLOW_TRACKING_URI", None)

    # Nothing changed: every stage is reused, nothing new is registered or decided. Half of the remote's objects
    # are gone first, as after a push killed midway: the rerun pushes them again before it records anything.
    objects = sorted(p for p in (project.parent / "remote").rglob("*") if p.is_file())
    for f in objects[::2]:
        f.unlink()
    assert json.loads(dvc(["status", "--cloud", "--json"], project) or "{}")  # the remote lacks outputs of the last run
    t0 = time.time()
    r = _cli(project, "run")
    noop_s = time.time() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(dvc(["status", "--cloud", "--json"], project) or "{}") == {}  # all there again
    assert any(f.exists() for f in objects[::2])  # pushed again (status --cloud above: every output of the run is there)
    assert _line(r.stdout, "stages run:").startswith("stages run: none; reused from DVC: games, grpo_games, panel, demos")
    assert "decided before; nothing changed" in _line(r.stdout, "decision:")
    print(f"resumed retrain {resumed_s:.0f} s; no-op retrain {noop_s:.1f} s")
    git(["add", "-A"], project)
    commit(project, "-q", "-m", "retrain")

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


def test_two_checkouts_retraining_at_once_decide_one_after_the_other_on_one_tracking_server(prefect_server, project, mlflow_server, tmp_path):
    """Two checkouts of the project (the second a copy of the first, each with its own GRPO learning rate) retrain
    at the same time against one MLflow server: their decisions on the one registered model take turns (a Prefect
    global concurrency limit per model), so exactly one champion results, and the second compared with the first."""
    from mlflow import MlflowClient

    other = tmp_path / "checkout-b"
    shutil.copytree(project, other, symlinks=True)
    logs, procs = {}, {}
    for i, repo in enumerate((project, other)):
        p = yaml.safe_load((repo / "params.yaml").read_text())
        p["profiles"]["tiny-cpu"]["grpo"]["learning_rate"] *= 2 + i  # a new candidate in each checkout: GRPO and evaluate rerun
        (repo / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    env = _env(MLFLOW_TRACKING_URI=mlflow_server.uri)
    try:
        for repo in (project, other):
            logs[repo] = tmp_path / f"{repo.name}.log"
            procs[repo] = subprocess.Popen([sys.executable, "-m", "flows.cli", "run"], cwd=repo, env=env, stdout=open(logs[repo], "w"),
                                           stderr=subprocess.STDOUT, start_new_session=True)
        for repo, proc in procs.items():
            proc.wait(900)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        git(["checkout", "--", "params.yaml"], project)
    outs = {repo: logs[repo].read_text() for repo in procs}
    for repo, proc in procs.items():
        assert proc.returncode == 0, outs[repo][-3000:]
        assert _line(outs[repo], "stages run:").startswith("stages run: grpo, evaluate;"), _line(outs[repo], "stages run:")
    assert any("waiting for the decision slot of evoharness-test-tiny-cpu" in o for o in outs.values())  # they did meet at the gate
    c = MlflowClient(tracking_uri=mlflow_server.uri)
    versions = sorted(c.search_model_versions("name='evoharness-test-tiny-cpu'"), key=lambda v: int(v.version))
    assert len(versions) == 2, [v.version for v in versions]
    first, second = versions
    assert first.tags["decision.state"] == second.tags["decision.state"] == "complete"
    assert first.tags["decision"] == "promoted"  # nothing to compare with: it passes the micro thresholds
    assert second.tags["decision.champion_before"] == first.version  # decided against the first, not against "none"
    champion = c.get_model_version_by_alias("evoharness-test-tiny-cpu", "champion").version
    assert champion == (second.version if second.tags["decision"] == "promoted" else first.version)


def test_an_evolving_evaluation_is_the_retrains_evaluate_stage_and_the_gate_keeps_it_apart(prefect_server, project):
    """eval.bank: evolve with the LLM evolver on loopback: the retrain's evaluate stage plays each split in windows,
    consolidates the bank between them through the server and checkpoints it; the outcomes reach the gate, the version
    names the bank it started from, and the gate refuses to rank it against a champion evaluated on a frozen bank
    (the module's first retrain's: this test follows it, as the two-checkout test does)."""
    from mlflow import MlflowClient

    from evoharness.ops import tracking

    srv = start_consolidator([lambda n: json.dumps([{"op": "add", "category": "notes", "key": f"k{n}", "text": f"evolver note {n}"}])])
    p = yaml.safe_load((project / "params.yaml").read_text())
    p["eval"]["bank"] = "evolve"
    p["profiles"]["tiny-cpu"]["grpo"]["learning_rate"] *= 5  # a new candidate (the gate decides each model's weights once)
    p["consolidator"] = {"endpoint": f"chat:base_url=http://127.0.0.1:{srv.server_port}/v1,model=evolver", "window": 2}
    (project / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    try:
        r = _cli(project, "run")
    finally:
        git(["checkout", "--", "params.yaml"], project)
        srv.shutdown()
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    # baselines reruns too (it depends on every eval key), frozen as always
    assert _line(out, "stages run:").startswith("stages run: baselines, grpo, evaluate;"), _line(out, "stages run:")
    games = len(list((project / "data" / "panel" / "valid_seen").iterdir()))
    windows = -(-games // 2)
    for split in ("valid_seen", "valid_unseen"):
        res = json.loads((project / "data" / "eval" / "grpo-inline" / split / "results.json").read_text())
        assert res["bank_mode"] == "evolve" and res["windows"] == windows and len(res["consolidations"]) == windows
        assert res["bank_digest"] != res["bank_start_digest"]  # the evolver's notes went in
        assert len(list((project / "data" / "eval" / "grpo-inline" / split / "banks").glob("after-w???.json"))) == windows
        assert res["summary"]["all"]["episodes"] == games
    stage = json.loads((project / "data" / "eval" / "grpo-inline" / "results.json").read_text())
    assert stage["bank_mode"] == "evolve" and stage["bank_final_digest_valid_seen"] != stage["bank_digest"]
    banked = 3  # base-inline, sft-inline and grpo-inline; sft-env_only plays without a bank
    # every window of every banked model's splits, and GRPO's one update (it consolidates after each batch), through the server
    assert len(srv.seen) == banked * 2 * windows + MICRO["profiles"]["tiny-cpu"]["grpo"]["steps"]
    c = MlflowClient(tracking_uri=tracking.tracking_uri(project))
    v = max(c.search_model_versions("name='evoharness-test-tiny-cpu'"), key=lambda v: int(v.version))
    assert v.tags["bank_mode"] == "evolve" and v.tags["bank_digest"] == stage["bank_digest"]
    assert v.tags["decision.state"] == "complete" and v.tags["decision"] != "promoted"
    assert "champion evaluated under other conditions" in v.tags["decision.reasons"] and "inline+evolve" in v.tags["decision.reasons"]


def test_an_unreachable_prefect_server_is_one_line(project):
    env = _env(PREFECT_API_URL="http://127.0.0.1:9/api")
    for args in (["run"], ["deploy"]):
        r = _cli(project, *args, env=env, timeout=120)
        assert r.returncode == 2, r.stderr[-2000:]
        assert r.stderr.strip().splitlines()[-1].startswith("error: Prefect server http://127.0.0.1:9/api is unreachable")


def test_a_prefect_server_that_refuses_this_client_is_one_line(prefect_server, project):
    """The test server needs its auth string for every API call (/health is open to all): without it, or with
    a wrong one, the run and deploy stop in one line before anything starts."""
    for auth in (None, "evo-tests:wrong"):
        env = _env()
        env.pop("PREFECT_API_AUTH_STRING")
        if auth:
            env["PREFECT_API_AUTH_STRING"] = auth
        for args in (["run"], ["deploy"]):
            r = _cli(project, *args, env=env, timeout=120)
            assert r.returncode == 2, r.stderr[-2000:]
            assert r.stderr.strip().splitlines()[-1] == f"error: Prefect server {prefect_server} refused this client (401): set PREFECT_API_AUTH_STRING (user:password) or PREFECT_API_KEY"
            assert "evo-tests:" not in r.stdout + r.stderr


def test_bad_data_stops_the_flow_with_a_report_and_is_quarantined(prefect_server, project):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from evoharness.ops import tracking

    p = yaml.safe_load((project / "params.yaml").read_text())
    p["validate"]["max_tokens"] = 64  # every SFT pair is now too long for the profile: the gate must stop the flow
    (project / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    r = _cli(project, "run")
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: dvc repro --single-item --pull validate failed") and "validation failed" in last and "quarantine" in last
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
    from evoharness.core.errors import EvoError
    from flows.retrain import check_deployment

    with pytest.raises(EvoError, match=r"--pool gpu9: no deployment 'train-stage/train-stage-gpu9' on the Prefect server; .*evoharness deploy"):
        check_deployment("train-stage/train-stage-gpu9", "gpu9")


def test_the_library_imports_neither_prefect_nor_the_flows():
    """Layers: evoharness/ is the library; flows/ and tasks/ (and the `evoharness` command, flows.cli) sit above it."""
    import pkgutil

    import evoharness

    import importlib.util

    mods = [m.name for m in pkgutil.walk_packages(evoharness.__path__, "evoharness.") if not m.name.endswith(".__main__")]  # runs the CLI
    if importlib.util.find_spec("vllm") is None:  # the vLLM engine's module is for environments with vLLM (tests/test_vllm.py)
        mods.remove("evoharness.agent.policies.vllm_engine")
    code = "import importlib, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in mods) + (
        "bad = sorted(k for k in sys.modules if k.split('.')[0] in ('prefect', 'flows', 'tasks'))\nprint(','.join(bad))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "", r.stdout[:500]
    src = "\n".join(p.read_text() for p in Path(evoharness.__file__).parent.rglob("*.py"))
    assert not re.search(r"^\s*(from|import) (prefect|flows|tasks)\b", src, re.M)
