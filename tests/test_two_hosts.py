"""The h200 pool on another machine, as two hosts on one: the orchestrator in its own folder and HOME
(closed to others), the worker as another user in its own HOME that cannot read the orchestrator's,
the code on a git server (git daemon on loopback) as origin, the data through a DVC network remote (a
WebDAV server on loopback), Prefect the session's server. Nothing of the orchestrator's disk reaches
the worker. The tests run in order on one project: a worker killed mid-job, then a rerun with a live
worker beside a second retrain of the same repository."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

from evoharness.ops import stagerun
from evoharness.core import environment
from evoharness.ops.vcs import dvc, git
from tasks.stages import _job_result
from hosts import POOL, cli, job_runs, kill_user, start_chat, start_cli, start_worker, wait_for
from project import commit, make_shared_project, MICRO

DEPLOYMENT = "train-stage/train-stage-h200"


@pytest.fixture(scope="module")
def hosts(hosts_dir, webdav, git_server, worker_host, mlflow_server, prefect_server, canary):
    orch, orch_home = hosts_dir / "orch", hosts_dir / "orch-home"  # made by worker_host, which hides them from the worker
    chat = start_chat()  # a chat baseline whose key is the session's secret, read from an environment variable
    params = json.loads(json.dumps(MICRO))
    params["promotion"]["model_name"] = "evoharness-hosts"
    params["pool"] = {"silence_s": 60}
    params["eval"]["baselines"] = ["teacher", f"chat:base_url=http://127.0.0.1:{chat.server_port}/v1,model=m1,api_key_env=EVO_CHAT_KEY,max_new_tokens=32"]
    repo = make_shared_project(orch, params, git_server.bare("evoharness"), webdav.collection("hosts-store"), webdav.user, webdav.password)
    # The orchestrator's credentials: the MLflow server's password in its tracking URI, the chat key in the
    # environment, the remote's password in config.local (all the session's canary).
    env = {"MLFLOW_TRACKING_URI": mlflow_server.uri, "EVO_CHAT_KEY": canary}
    # The worker's own DVC credentials for the remote, in its own global config (never sent by the orchestrator).
    for args in (["remote", "add", "--global", "storage", webdav.collection("hosts-store")], ["remote", "modify", "--global", "storage", "user", webdav.user],
                 ["remote", "modify", "--global", "storage", "password", webdav.password]):
        worker_host.run([sys.executable, "-m", "dvc", *args], check=True, capture_output=True)
    r = cli(repo, orch_home, "deploy", **env)
    assert r.returncode == 0, r.stderr[-2000:]
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        for name in ("retrain/retrain", "retrain/retrain-h200"):
            c.pause_deployment(c.read_deployment_by_name(name).id)  # no cron firing during the tests
        dep = c.read_deployment_by_name(DEPLOYMENT)
    assert dep.work_pool_name == POOL and dep.pull_steps[0]["prefect.deployments.steps.git_clone"]["repository"].startswith("git://127.0.0.1")
    assert str(orch) not in json.dumps(dep.pull_steps)  # the job's code comes from the origin, not from this folder
    yield {"repo": repo, "orch": orch, "orch_home": orch_home, "worker": worker_host, "webdav": webdav, "env": env, "mlflow": mlflow_server,
           "chat": chat, "logs": []}
    chat.shutdown()


def test_the_worker_cannot_read_the_orchestrators_folder(hosts):
    w = hosts["worker"]
    r = w.run(["ls", str(hosts["repo"])], capture_output=True, text=True)
    assert r.returncode != 0 and "No such file or directory" in r.stderr  # not there at all on the worker host
    r = w.run(["ls", str(hosts["orch"])], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == ""
    assert w.run(["id", "-un"], capture_output=True, text=True).stdout.strip() == w.user


def test_a_worker_killed_mid_job_is_detected_and_the_retrain_fails_in_one_line(hosts, tmp_path):
    from prefect.client.orchestration import get_client

    repo, w = hosts["repo"], hosts["worker"]
    worker = start_worker(w, "gpu-box-1", tmp_path / "worker1.log")
    log = tmp_path / "retrain1.log"
    hosts["logs"] += [log, tmp_path / "worker1.log"]
    proc = start_cli(repo, hosts["orch_home"], log, "run", "--pool", POOL, **hosts["env"])
    try:
        # The two SFT stages go out together and this one worker takes one at a time (either first): the
        # worker's machine dies during the first.
        running = wait_for(lambda: [fr for s in ("sft_inline", "sft_env_only") for fr in job_runs(s) if fr.state and fr.state.is_running()], 600,
                           "an SFT job running on the worker", proc, log)
        time.sleep(3)  # mid-job
        killed = time.time()
        kill_user(w.user)
        proc.wait(300)
        detected = time.time() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        worker.wait(30)
    out = log.read_text()
    last = out.strip().splitlines()[-1]
    assert proc.returncode == 2, out[-3000:]
    stage = running[0].name.split("@")[0]
    assert re.match(rf"error: stage '{stage}': its job on \S+ \(pid \d+\) \(pool h200\) had no heartbeat for \d+ s \(pool.silence_s 60\): "
                    r"no worker answered its cancellation within 90 s \(the box is gone\), so it is marked crashed", last), last
    assert detected < 60 + 35 + 30 + 90, detected  # the silence allowed, one heartbeat period, polling, the wait for a worker to kill it
    print(f"dead worker detected {detected:.0f} s after the kill")
    with get_client(sync_client=True) as c:
        fr = c.read_flow_run(running[0].id)
        assert fr.state.is_crashed() and "no heartbeat" in fr.state.message
        ours = ("base_model@", "sft_inline@", "sft_env_only@", "grpo@", "evaluate@")
        assert not [x for x in c.read_flow_runs(limit=200) if x.name.startswith(ours) and x.state and x.state.is_running()]  # no job left running
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    assert "base_model" in lock and "sft_inline" not in lock and "sft_env_only" not in lock  # the base was made on the worker before it died
    hosts["crashed_job"] = str(running[0].id)


def test_a_rerun_with_a_live_worker_dispatches_fresh_jobs_beside_a_second_retrain_that_waits(hosts, tmp_path):
    from prefect.client.orchestration import get_client

    repo, w = hosts["repo"], hosts["worker"]
    worker = start_worker(w, "gpu-box-2", tmp_path / "worker2.log", EVOHARNESS_MACHINE="gpu-box-2")
    # A second box (its own workspace folder and DVC cache): the two SFT stages need nothing of each other.
    worker3 = start_worker(w, "gpu-box-3", tmp_path / "worker3.log", EVOHARNESS_MACHINE="gpu-box-3", EVOHARNESS_WORKER_HOME=str(w.home / "box3"))
    log2, log3 = tmp_path / "retrain2.log", tmp_path / "retrain3.log"
    t0 = time.time()
    hosts["logs"] += [log2, log3, tmp_path / "worker2.log", tmp_path / "worker3.log"]
    r2 = start_cli(repo, hosts["orch_home"], log2, "run", "--pool", POOL, **hosts["env"])
    try:
        wait_for(lambda: "holding the DVC slot" in log2.read_text(), 300, "the rerun holding the DVC slot", r2, log2)
        r3 = start_cli(repo, hosts["orch_home"], log3, "run", "--pool", POOL, **hosts["env"])  # a second retrain of the same repository
        wait_for(lambda: "waiting for the DVC slot" in log3.read_text(), 300, "the second retrain waiting", r3, log3)
        r2.wait(1500)
        r2_end = time.time()
        r3.wait(600)
        r3_end = time.time()
    finally:
        for p in (r2, locals().get("r3")):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        kill_user(w.user)
        worker.wait(30)
        worker3.wait(30)
    out2, out3 = log2.read_text(), log3.read_text()
    assert r2.returncode == 0, out2[-4000:]
    line = next(ln for ln in out2.splitlines() if ln.startswith("stages run:"))
    assert line.startswith("stages run: sft_inline, sft_env_only, grpo, evaluate; reused from DVC: games, grpo_games, panel, demos, pairs, demos_react, pairs_react, validate, baselines, base_model"), line
    assert "PROMOTED" in out2
    print(f"rerun with a live worker: {r2_end - t0:.0f} s; {line}")
    # The stages ran as fresh jobs on the worker (not the crashed one), from the origin's commit.
    with get_client(sync_client=True) as c:
        for stage in ("sft_inline", "sft_env_only", "grpo", "evaluate"):
            runs = [fr for fr in job_runs(stage) if fr.state and fr.state.is_completed()]
            assert runs and str(runs[0].id) != hosts.get("crashed_job"), stage
            assert str(hosts["orch"]) not in json.dumps(runs[0].parameters, default=str)  # nothing of the orchestrator's disk
            assert runs[0].parameters["spec"]["repo"].startswith("git://127.0.0.1")
        # The two SFT stages ran at the same time, one on each box (each worker takes one job at a time).
        a, b = (next(fr for fr in job_runs(s) if fr.state and fr.state.is_completed()) for s in ("sft_inline", "sft_env_only"))
        assert a.start_time < b.end_time and b.start_time < a.end_time, (a.start_time, a.end_time, b.start_time, b.end_time)
        boxes = {t for fr in (a, b) for t in fr.tags if t.startswith("box:")}
        assert boxes == {"box:gpu-box-2", "box:gpu-box-3"}, boxes
        assert "dispatching sft_inline, sft_env_only side by side" in out2
    # DVC agrees every stage is up to date here, but for the weights: they never came to the scheduler (pool.stay_on_remote).
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    status = json.loads(dvc(["status", "--json"], repo) or "{}")
    assert {p_ for items in status.values() for i in items if isinstance(i, dict) for ps in i.values() for p_ in ps} <= \
        {o["path"] for st in lock.values() for o in st.get("outs", []) if o["path"].startswith("data/models/")}, status
    assert stagerun.changes(repo, "dvc.yaml", ["data/models"]) == {}
    assert not (repo / "data" / "models").exists()
    weights = [o for st in lock.values() for o in st.get("outs", []) if o["path"].startswith("data/models/")]
    cloud = json.loads(dvc(["status", "--cloud", "--json"], repo) or "{}")  # "deleted": on the remote, not in this machine's cache
    assert len(weights) == 4 and any(f.startswith("data/models/grpo/") and f.endswith(".safetensors") for f in cloud), cloud
    assert set(cloud.values()) == {"deleted"} and all(f.startswith("data/models/") for f in cloud), cloud
    assert (w.home / ".cache" / "evoharness" / "worker").is_dir()  # the jobs' checkouts live in the worker's own home
    # The second retrain (the pool's too) waited for the first, then found nothing to do.
    assert r3.returncode == 0, out3[-3000:]
    assert "stages run: none; reused from DVC: games" in out3 and "decided before; nothing changed" in out3
    assert r3_end > r2_end
    # The rerun left its git record on origin: a tag naming its MLflow run, holding its dvc.lock.
    rec = re.search(r"git record: (retrain/([0-9a-f]{32})) \(([0-9a-f]{12})\)", out2)
    assert rec, out2[-2000:]
    hosts["run_id"] = rec.group(2)
    # Each stage's MLflow run names the machine its job ran on: the worker's (its label travels back with the
    # job's result), not the orchestrator's, which the parent run names.
    from mlflow import MlflowClient

    assert "EVOHARNESS_MACHINE" not in os.environ
    c = MlflowClient(tracking_uri=hosts["mlflow"].uri)  # the team's tracking server (basic auth)
    assert not (repo / "mlflow.db").exists()
    parent = c.get_run(rec.group(2))
    kids = {k.data.tags["stage"]: k for k in c.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{rec.group(2)}'")}
    assert kids["grpo"].data.tags["where"].startswith(f"pool {POOL} job ")
    assert kids["grpo"].data.tags["machine"] in {f"gpu-box-{n}: {environment.machine()}" for n in (2, 3)} and parent.data.tags["machine"] == environment.machine()
    # The gate compared the candidate with its SFT parent split by split (no_regression), on the evaluations it read.
    mv = c.get_model_version_by_alias("evoharness-hosts-tiny-cpu", "champion")
    assert {"check.seen_vs_sft-inline", "check.unseen_vs_sft-inline"} <= set(mv.tags), mv.tags
    # The version points at the weights on the DVC remote; the gate bound the evaluation to them by dvc.lock's hashes.
    assert mv.tags["weights_in_mlflow"] == "false" and mv.tags["dvc_md5"] == weights[-1]["md5"]
    pointer = yaml.safe_load(open(c.download_artifacts(mv.run_id, "model/dvc-pointer.yaml", str(tmp_path))))
    assert pointer["md5"] == weights[-1]["md5"] and pointer["model_digest"]
    remote_tags = git(["ls-remote", "--tags", "origin"], repo)
    assert f"refs/tags/{rec.group(1)}" in remote_tags
    assert yaml.safe_load(git(["show", f"{rec.group(1)}:dvc.lock"], repo)) == yaml.safe_load((repo / "dvc.lock").read_text())


def test_a_stage_trained_on_one_box_is_restored_not_retrained_on_the_other(hosts, tmp_path):
    """The scheduler lost its record of the two SFT stages (their dvc.lock entries): the rerun dispatches them again,
    and only the box that did not train sft_inline is up. DVC's run-cache (pushed by every job) restores each stage
    there from the remote: nothing is retrained, and the outputs are the ones trained before."""
    if "run_id" not in hosts:
        pytest.fail("no pool retrain before this one: test_a_rerun_with_a_live_worker_... failed or was deselected")
    repo, w = hosts["repo"], hosts["worker"]
    trained = {}
    for stage in ("sft_inline", "sft_env_only"):
        fr = next(fr for fr in job_runs(stage) if fr.state and fr.state.is_completed())
        trained[stage] = next(t.split(":", 1)[1] for t in fr.tags if t.startswith("box:"))
    other = "gpu-box-3" if trained["sft_inline"] == "gpu-box-2" else "gpu-box-2"
    lock_p = repo / "dvc.lock"
    before = yaml.safe_load(lock_p.read_text())
    lock = json.loads(json.dumps(before))
    for stage in ("sft_inline", "sft_env_only"):
        del lock["stages"][stage]
    lock_p.write_text(yaml.safe_dump(lock, sort_keys=False))
    # A new commit that no stage depends on: the jobs are new (a job of the same commit and inputs would be adopted)
    (repo / "NOTES.md").write_text("a change no stage depends on\n")
    git(["add", "NOTES.md"], repo)
    commit(repo, "-q", "-m", "notes")
    git(["push", "-q", "origin", "HEAD"], repo)
    log = tmp_path / "worker-other.log"
    hosts["logs"] += [log]
    extra = {"EVOHARNESS_WORKER_HOME": str(w.home / "box3")} if other == "gpu-box-3" else {}
    worker = start_worker(w, other, log, EVOHARNESS_MACHINE=other, **extra)
    t0 = time.time()
    try:
        r = cli(repo, hosts["orch_home"], "run", "--pool", POOL, timeout=1200, **hosts["env"])
    finally:
        kill_user(w.user)
        worker.wait(30)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    line = next(ln for ln in out.splitlines() if ln.startswith("stages run:"))
    assert line.startswith("stages run: none; reused from DVC:") and "sft_inline" in line and "sft_env_only" in line, line
    print(f"both SFT stages restored on {other} (sft_inline trained on {trained['sft_inline']}): {time.time() - t0:.0f} s")
    after = yaml.safe_load(lock_p.read_text())
    for stage in ("sft_inline", "sft_env_only"):
        assert after["stages"][stage] == before["stages"][stage], stage  # the same outputs, by hash
        fr = job_runs(stage)[0]
        assert fr.state.is_completed() and f"box:{other}" in fr.tags, (stage, fr.tags)
        assert _job_result(fr.id)["ran"] is False, stage  # the job's own report: DVC restored it, ran nothing


def test_the_sessions_secret_is_in_no_store_record_log_or_data_folder(hosts, canary, prefect_service, webdav, git_server):
    """The canary: one secret is the MLflow server's password (in the orchestrator's tracking URI), the chat
    baseline's key (an environment variable) and the WebDAV remote's password (config.local here, the worker's
    own DVC config there). After the retrains above, it is in none of: the MLflow server's store and artifacts,
    the Prefect database, the git objects on origin (the records included), the retrains', workers' and servers'
    logs, the data folders of both hosts, the DVC remote's objects."""
    if "run_id" not in hosts:
        pytest.fail("no retrain ran: test_a_rerun_with_a_live_worker_... did not record one (it failed or was deselected)")
    assert hosts["chat"].seen and {a for a, _ in hosts["chat"].seen} == {f"Bearer {canary}"}  # the key was used
    needle = canary.encode()
    w = hosts["worker"]
    places = [hosts["mlflow"].base / "mlflow.db", hosts["mlflow"].base / "artifacts", hosts["mlflow"].base / "server.log",
              *prefect_service.home.glob("*.db*"), prefect_service.home / "server.log", hosts["repo"] / "data", hosts["repo"] / "reports",
              *hosts["logs"], webdav.root, *(w.home / ".cache" / "evoharness" / "worker").glob("*/data")]
    hits, looked = [], 0
    for place in places:
        files = [f for f in place.rglob("*") if f.is_file()] if place.is_dir() else [place] if place.exists() else []
        for f in files:
            looked += 1
            if needle in f.read_bytes():
                hits.append(str(f))
    for where in (hosts["repo"], git_server.base / "evoharness.git"):  # every object, loose or packed, here and on origin
        objects = subprocess.run(["git", "cat-file", "--batch-all-objects", "--batch"], cwd=where, capture_output=True).stdout
        assert objects, where
        if needle in objects:
            hits.append(f"a git object in {where}")
    assert git(["ls-remote", "--tags", "origin"], hosts["repo"]).count("refs/tags/retrain/") >= 1  # the records are among them
    assert looked > 100 and not hits, hits


def test_pool_refuses_what_another_machine_cannot_reach(hosts, tmp_path, git_server):
    from project import make_project

    repo = make_project(tmp_path, MICRO)  # no origin, a local DVC remote in config.local
    r = cli(repo, hosts["orch_home"], "run", "--pool", POOL, timeout=300, **hosts["env"])
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: --pool h200: ") and "has no git origin" in r.stderr
    bare = tmp_path / "origin.git"
    subprocess.run(["git", "init", "-q", "--bare", str(bare)], check=True)
    git(["remote", "add", "origin", str(bare)], repo)
    r = cli(repo, hosts["orch_home"], "run", "--pool", POOL, timeout=300, **hosts["env"])
    assert r.returncode == 2 and "is a path on this machine, which the workers cannot clone" in r.stderr.strip().splitlines()[-1]
    git(["remote", "set-url", "origin", git_server.bare("refuse")], repo)
    r = cli(repo, hosts["orch_home"], "run", "--pool", POOL, timeout=300, **hosts["env"])
    assert r.returncode == 2 and "is not on origin" in r.stderr.strip().splitlines()[-1] and "git push" in r.stderr
    git(["push", "-q", "origin", "main"], repo)
    r = cli(repo, hosts["orch_home"], "run", "--pool", POOL, timeout=300, **hosts["env"])
    assert r.returncode == 2 and "names no default DVC remote" in r.stderr.strip().splitlines()[-1]
    dvc(["remote", "add", "-d", "disk", str(tmp_path / "remote")], repo)
    commit(repo, "-qam", "a remote on this disk")
    git(["push", "-q", "origin", "main"], repo)
    r = cli(repo, hosts["orch_home"], "run", "--pool", POOL, timeout=300, **hosts["env"])
    assert r.returncode == 2 and "is a folder on this machine, which the workers cannot reach" in r.stderr.strip().splitlines()[-1]
    assert not (repo / "dvc.lock").exists()  # refused before any stage ran


def test_reproduce_the_retrain_on_the_worker_host_from_a_fresh_clone(hosts):
    """`reproduce <MLflow run id>` on the other host: a fresh clone in its own folder and HOME, the data
    from the network remote with that host's own credentials; every stage re-run on its recorded inputs."""
    if "run_id" not in hosts:
        pytest.fail("no retrain to reproduce: test_a_rerun_with_a_live_worker_... did not record one (it failed or was deselected)")
    w, run_id = hosts["worker"], hosts["run_id"]
    origin = git(["config", "--get", "remote.origin.url"], hosts["repo"])
    clone = w.home / "reproduce-here"
    r = w.run(["git", "clone", "-q", origin, str(clone)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    t0 = time.time()
    r = w.run([sys.executable, "-m", "flows.cli", "reproduce", run_id], cwd=clone, capture_output=True, text=True, timeout=1500)
    took = time.time() - t0
    out = r.stdout
    print(out[out.find("stage "):])
    print(f"reproduce on the worker host: {took:.0f} s")
    rows = [ln.split() for ln in out.splitlines() if re.match(r"^\S+ +data/\S+ +[0-9a-f]{32}", ln)]
    assert rows and r.returncode in (0, 2), (out[-3000:], r.stderr[-3000:])
    from evoharness.core import environment

    assert f"; on {environment.machine()}" in out  # the processor kind it reproduces on, beside the recording run's `machine` tags
    verdict = {(x[0], x[1]): " ".join(x[4:]) for x in rows}
    resumed = {s for s in ("sft_inline", "sft_env_only", "grpo")
               if json.loads(git(["show", f"retrain/{run_id}:data/metrics/{s.replace('_', '-', 1) if s.startswith('sft') else s}.json"],
                                 hosts["repo"])).get("resumed_from")}
    for (stage, path), v in verdict.items():
        if stage in resumed:  # trained across the worker's death: resumed from a checkpoint, not bit for bit
            continue
        assert v == "yes", (stage, path, v, out[-3000:])
    assert r.returncode == 0 or resumed, r.stderr[-2000:]
    assert {"games", "demos", "pairs", "base_model", "sft_env_only", "grpo", "evaluate"} <= {s for s, _ in verdict}
