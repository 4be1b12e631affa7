"""Faults of a pool on real machines, as two hosts on one (conftest's worker host: another user in its own
HOME, the orchestrator's folders invisible to it; code from a git daemon; data through a real S3 server on
loopback, each host with its own credentials for it). The dispatched stage is a small script (``fault.py``,
driven by the committed ``fault.json``) that sleeps, hangs or finishes, so each fault exercises the real
dispatch, watch, cancellation and adoption machinery in seconds to minutes, without training.

The tests run in order on one project; each commits the fault it wants, pushes it, and runs a retrain
with ``--pool h200``. After the fault stage the retrain goes on to the gate, which finds no evaluation:
a test reads how far the retrain got from its log."""

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

from evoharness.ops.vcs import git
from hosts import POOL, cli, job_runs, kill_user, start_cli, start_worker, wait_for
from project import MICRO, _new_repo, commit

FAULT_PY = '''"""A stage for fault tests: fault.json says what it does (finish, sleep N seconds, hang)."""
import json, os, pathlib, time
cfg = json.loads(pathlib.Path("fault.json").read_text())
print(f"fault stage pid {os.getpid()}: {cfg}", flush=True)
if cfg["mode"] == "sleep":
    time.sleep(cfg["seconds"])
elif cfg["mode"] == "hang":
    while True:
        time.sleep(3600)
out = pathlib.Path("data/fault")
out.mkdir(parents=True, exist_ok=True)
(out / "out.json").write_text(json.dumps(cfg) + "\\n")
'''
DVC_YAML = {"stages": {"fault": {"cmd": "python fault.py", "deps": ["fault.py", "fault.json"], "outs": ["data/fault"]}}}


@pytest.fixture(scope="module")
def faults(hosts_dir, s3, git_server, worker_host, mlflow_template, prefect_server):
    # A box whose wall clock is off: tests/skewclock.c, preloaded, shifts CLOCK_REALTIME (and what derives from it)
    # by SKEW_SECONDS and leaves the monotonic clocks alone, as on a real box whose clock drifted. (Debian's
    # libfaketime 0.9.10 shifts the monotonic clocks too, which stalls Python's timed waits by the offset, or,
    # told not to, fails its sleeps with EINVAL.)
    skew_lib = hosts_dir / "skewclock.so"
    r = subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(skew_lib), str(Path(__file__).parent / "skewclock.c"), "-ldl"],
                       capture_output=True, text=True)
    if r.returncode:
        pytest.fail(f"cannot build tests/skewclock.c (gcc): {r.stderr[-800:]}")
    skew_lib.chmod(0o755)
    for seconds in (300, -300):  # the worker host's clock, as its Python reads it, is off by that much
        got = worker_host.run([sys.executable, "-c", "import time; print(time.time())"], env=worker_host.env(LD_PRELOAD=str(skew_lib), SKEW_SECONDS=str(seconds)),
                              capture_output=True, text=True)
        assert abs(float(got.stdout) - time.time() - seconds) < 30, (got.stdout, got.stderr)
    orch_home = hosts_dir / "orch-home"
    params = json.loads(json.dumps(MICRO))
    params["promotion"]["model_name"] = "evoharness-faults"
    params["pool"] = {"stages": ["fault"], "silence_s": 60, "time_limit_s": {"tiny-cpu": {"default": 900}}}
    repo = _new_repo(hosts_dir / "orch" / "faults", params)  # the orchestrator's folder, which the worker host cannot see
    (repo / "dvc.yaml").write_text(yaml.safe_dump(DVC_YAML, sort_keys=False))
    (repo / "fault.py").write_text(FAULT_PY)
    (repo / "fault.json").write_text(json.dumps({"mode": "finish", "n": 0}))
    bucket = s3.bucket("faults")
    s3.configure(repo, bucket)  # URL and endpoint committed, the key pair only in this host's config.local
    shutil.copy(mlflow_template, repo / "mlflow.db")
    git(["add", "-A"], repo)
    commit(repo, "-q", "-m", "fault pipeline")
    git(["remote", "add", "origin", git_server.bare("faults")], repo)
    git(["push", "-q", "origin", "main"], repo)
    git(["branch", "-q", "--set-upstream-to=origin/main"], repo)
    r = cli(repo, orch_home, "deploy")
    assert r.returncode == 0, r.stderr[-2000:]
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        for name in ("retrain/retrain", "retrain/retrain-h200"):
            c.pause_deployment(c.read_deployment_by_name(name).id)
    # The worker host's own S3 credentials, as a GPU box has them (its environment), never sent by the orchestrator.
    creds = {"AWS_ACCESS_KEY_ID": s3.key_id, "AWS_SECRET_ACCESS_KEY": s3.secret, "AWS_DEFAULT_REGION": "us-east-1"}
    yield {"repo": repo, "home": orch_home, "worker": worker_host, "creds": creds, "s3": s3, "n": 0, "skew_lib": skew_lib}
    # The server is shared with the two-host tests: a fault job a failed test left Running is closed.
    from prefect.states import Crashed

    kill_user(worker_host.user)
    with get_client(sync_client=True) as c:
        for fr in job_runs("fault"):
            if fr.state and not fr.state.is_final():
                c.set_flow_run_state(fr.id, Crashed(message="left over by a failed fault test"), force=True)


def skew(f: dict, seconds: int) -> dict:
    """The worker's environment for a box whose wall clock is ``seconds`` off."""
    return {"LD_PRELOAD": str(f["skew_lib"]), "SKEW_SECONDS": str(seconds)}


def set_fault(f: dict, branch: str = "main", limit: float = 900, **cfg) -> str:
    """Commit fault.json (a new one each time: a new commit and new inputs) and the stage's time limit, and
    push them; returns the commit."""
    repo = f["repo"]
    f["n"] += 1
    (repo / "fault.json").write_text(json.dumps({**cfg, "n": f["n"]}))
    params = yaml.safe_load((repo / "params.yaml").read_text())
    params["pool"]["time_limit_s"]["tiny-cpu"]["fault"] = limit
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    git(["add", "fault.json", "params.yaml"], repo)
    commit(repo, "-q", "-m", f"fault {cfg}")
    git(["push", "-q", "origin", f"HEAD:{branch}"], repo)
    return git(["rev-parse", "HEAD"], repo)


def job_processes(user: str) -> list[str]:
    r = subprocess.run(["pgrep", "-a", "-u", user, "-f", "evoharness.ops.stagejob|fault.py"], capture_output=True, text=True)
    return [ln for ln in r.stdout.splitlines() if ln.strip()]


def job_log(stage: str = "fault") -> str:
    """The newest job's logs, as its flow run has them on the server."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    runs = job_runs(stage)
    if not runs:
        return "(no job)"
    with get_client(sync_client=True) as c:
        return "\n".join(lg.message for lg in c.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[runs[0].id]))))[-3000:]


def last_line(log: Path) -> str:
    return log.read_text().strip().splitlines()[-1]


def stop(proc) -> None:
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def test_the_job_runs_the_dispatched_commit_and_refuses_a_box_with_another_environment(faults, tmp_path):
    """The driver's code comes from the origin's default branch (the pull step); the job's from the dispatched
    commit, here on another branch. A commit whose constraints.txt this box does not match is refused in one line."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    repo, w = faults["repo"], faults["worker"]
    git(["checkout", "-q", "-b", "work"], repo)
    marker = "EVOHARNESS-JOB-CODE-OF-THE-WORK-BRANCH"
    job = repo / "evoharness" / "ops" / "stagejob.py"
    anchor = "    spec = json.loads(Path(argv[0]).read_text())"
    assert anchor in job.read_text()
    job.write_text(job.read_text().replace(anchor, f"    print({marker!r}, flush=True)\n{anchor}"))
    git(["add", "-A"], repo)
    commit(repo, "-q", "-m", "the job prints a marker")
    git(["push", "-q", "-u", "origin", "work"], repo)
    set_fault(faults, branch="work", mode="finish")
    worker = start_worker(w, "gpu-box-a", tmp_path / "worker.log", **faults["creds"])
    try:
        r = cli(repo, faults["home"], "run", "--pool", POOL, timeout=600)
        out = r.stdout + r.stderr
        assert "fault: ran" in out, out[-3000:]
        fr = job_runs("fault")[0]
        with get_client(sync_client=True) as c:
            logs = c.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[fr.id])))
        assert any(marker in lg.message for lg in logs), [lg.message for lg in logs][-20:]
        # A commit pinning a version this box does not have: refused before anything runs.
        cons = repo / "constraints.txt"
        cons.write_text(re.sub(r"^pyyaml==.*$", "PyYAML==0.0.1", cons.read_text(), flags=re.M | re.I))
        git(["add", "constraints.txt"], repo)
        commit(repo, "-q", "-m", "another environment")
        set_fault(faults, branch="work", mode="finish")
        r = cli(repo, faults["home"], "run", "--pool", POOL, timeout=600)
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 2 and re.match(r"error: stage 'fault': its job on \S+ \(pid \d+\) ended Failed \(stage 'fault' on \S+: commit [0-9a-f]{12} "
                                              r"pins pyyaml==0\.0\.1 \(constraints\.txt\), the environment of \S+ has pyyaml==[\d.]+; this box does not run", last), last
        # A job naming a repository other than the one the deployment clones (anyone who may create flow runs
        # could ask): refused before anything is cloned.
        from prefect.deployments import run_deployment

        spec = {**fr.parameters["spec"], "repo": "git://127.0.0.1:9/not-ours.git"}
        evil = run_deployment("train-stage/train-stage-h200", parameters={"spec": spec}, timeout=300)
        assert evil.state.is_failed() and "the job names repository git://127.0.0.1:9/not-ours.git, not the origin this deployment clones" in (evil.state.message or ""), evil.state
    finally:
        kill_user(w.user)
        worker.wait(30)
        git(["checkout", "-q", "main"], repo)


def test_a_stage_that_hangs_while_its_heartbeats_go_on_is_killed_at_its_time_limit(faults, tmp_path):
    repo, w = faults["repo"], faults["worker"]
    set_fault(faults, mode="hang", limit=30)
    worker = start_worker(w, "gpu-box-a", tmp_path / "worker.log", **faults["creds"])
    log = tmp_path / "retrain.log"
    try:
        t0 = time.time()
        proc = start_cli(repo, faults["home"], log, "run", "--pool", POOL)
        wait_for(lambda: job_processes(w.user), 300, "the hanging stage running", proc, log)
        proc.wait(300)
        took = time.time() - t0
        last = last_line(log)
        assert proc.returncode == 2 and re.match(r"error: stage 'fault': its job on \S+ \(pid \d+\) ended Failed \(stage 'fault' on .*: ran past its time "
                                                 r"limit of 30 s; its processes were killed\)", last), last
        assert job_processes(w.user) == []  # the stage, its DVC command and the job are gone
        assert worker.poll() is None  # the worker lives on and takes the next job
        print(f"hung stage: the retrain failed {took:.0f} s after it started (time limit 30 s)")
    finally:
        kill_user(w.user)
        worker.wait(30)


def test_a_stopped_job_on_a_box_whose_clock_is_ahead_is_cancelled_through_its_worker(faults, tmp_path):
    """SIGSTOP on the job (its heartbeats stop; the worker lives) on a box 5 minutes ahead: silence is measured
    on the orchestrator's own clock, so it is found; the job is moved to Cancelling and its worker kills it."""
    repo, w = faults["repo"], faults["worker"]
    set_fault(faults, mode="sleep", seconds=600)
    worker = start_worker(w, "gpu-box-ahead", tmp_path / "worker.log", **skew(faults, +300), **faults["creds"])
    log = tmp_path / "retrain.log"
    proc = None
    try:
        proc = start_cli(repo, faults["home"], log, "run", "--pool", POOL)
        wait_for(lambda: job_processes(w.user), 300, "the stage running", proc, log)
        job = int(wait_for(lambda: subprocess.run(["pgrep", "-u", w.user, "-f", "evoharness.ops.stagejob"], capture_output=True, text=True).stdout.split(),
                           60, "the job's process", proc, log)[0])
        driver = int(Path(f"/proc/{job}/stat").read_text().rsplit(")", 1)[1].split()[1])  # the flow run's process, which sends the heartbeats
        time.sleep(35)  # a heartbeat or two first
        assert proc.poll() is None and Path(f"/proc/{driver}").exists(), log.read_text()[-3000:] + (tmp_path / "worker.log").read_text()[-3000:]
        stopped = time.time()
        os.kill(driver, signal.SIGSTOP)
        proc.wait(400)
        detected = time.time() - stopped
        last = last_line(log)
        assert proc.returncode == 2 and re.match(r"error: stage 'fault': its job on \S+ \(pid \d+\) \(pool h200\) had no heartbeat for \d+ s "
                                                 r"\(pool\.silence_s 60\): it was stopped \((Cancelled|Crashed)\)", last), (last, job_log())
        wait_for(lambda: job_processes(w.user) == [], 60, "the job's processes gone")
        assert worker.poll() is None
        print(f"stopped job on a box 5 min ahead: cancelled {detected:.0f} s after SIGSTOP")
        assert detected < 60 + 30 + 10 + 90, detected
    finally:
        stop(proc)
        kill_user(w.user)
        worker.wait(30)


def test_an_orchestrator_killed_mid_job_is_followed_by_a_rerun_that_adopts_the_job_on_a_box_behind(faults, tmp_path):
    """The orchestrator dies while its job runs on a box whose clock is 5 minutes behind (healthy jobs there
    must not look silent). The rerun marks the dead run failed, adopts the job in flight (no duplicate),
    and receives its outputs."""
    from mlflow import MlflowClient

    repo, w = faults["repo"], faults["worker"]
    set_fault(faults, mode="sleep", seconds=150)
    worker = start_worker(w, "gpu-box-behind", tmp_path / "worker.log", **skew(faults, -300), **faults["creds"])
    log1, log2 = tmp_path / "retrain1.log", tmp_path / "retrain2.log"
    first = second = None
    try:
        first = start_cli(repo, faults["home"], log1, "run", "--pool", POOL)
        wait_for(lambda: job_processes(w.user), 300, "the stage running", first, log1)
        time.sleep(10)
        stop(first)  # the orchestrator's machine is gone mid-job
        jobs_before = [x.id for x in job_runs("fault")]
        t0 = time.time()
        second = start_cli(repo, faults["home"], log2, "run", "--pool", POOL)
        second.wait(600)
        out = log2.read_text()
        assert "fault: ran" in out, out[-3000:]
        assert re.search(r"fault: adopting job fault@\S+ \([0-9a-f-]{36}, Running\) dispatched before", out), out[-3000:]
        assert "no heartbeat" not in out  # 150 s of a healthy job on a clock 5 minutes behind
        assert [x.id for x in job_runs("fault")] == jobs_before  # no duplicate job
        dead = re.search(r"marked MLflow run ([0-9a-f]{32}) FAILED: its orchestrator died", out)
        assert dead, out[-3000:]
        c = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
        assert c.get_run(dead.group(1)).info.status == "FAILED"
        print(f"orchestrator killed: the rerun adopted the job and received it {time.time() - t0:.0f} s later")
    finally:
        stop(first)
        stop(second)
        kill_user(w.user)
        worker.wait(30)


def test_a_prefect_server_restart_of_five_minutes_mid_job_kills_nothing(faults, tmp_path, prefect_service):
    repo, w = faults["repo"], faults["worker"]
    set_fault(faults, mode="sleep", seconds=420)
    worker = start_worker(w, "gpu-box-a", tmp_path / "worker.log", **faults["creds"])
    log = tmp_path / "retrain.log"
    proc = None
    try:
        proc = start_cli(repo, faults["home"], log, "run", "--pool", POOL)
        wait_for(lambda: job_processes(w.user), 300, "the stage running", proc, log)
        time.sleep(20)
        prefect_service.stop()
        down = time.time()
        time.sleep(300)
        assert job_processes(w.user) and proc.poll() is None and worker.poll() is None  # nothing killed while the server was away
        prefect_service.start()
        back = time.time()
        proc.wait(900)
        out = log.read_text()
        assert "fault: ran" in out and re.search(r"fault: the Prefect server is back after \d+ s", out), out[-3000:]
        fr = job_runs("fault")[0]
        assert fr.state.is_completed(), fr.state
        print(f"Prefect server down {back - down:.0f} s mid-job: the job completed and the retrain went on")
    finally:
        if prefect_service.proc.poll() is not None:
            prefect_service.start()
        stop(proc)
        kill_user(w.user)
        worker.wait(30)


def test_a_redeploy_keeps_which_schedule_is_active(faults):
    from prefect.client.orchestration import get_client

    def active(c, name):
        dep = c.read_deployment_by_name(name)
        return [s.active for s in c.read_deployment_schedules(dep.id)], dep.paused

    with get_client(sync_client=True) as c:
        cpu, gpu = c.read_deployment_by_name("retrain/retrain"), c.read_deployment_by_name("retrain/retrain-h200")
        for dep, on in ((cpu, False), (gpu, True)):  # the team moved the Monday cron to the GPU retrain
            for s in c.read_deployment_schedules(dep.id):
                c.update_deployment_schedule(dep.id, s.id, active=on)
        c.resume_deployment(gpu.id)
        r = cli(faults["repo"], faults["home"], "deploy")
        assert r.returncode == 0, r.stderr[-2000:]
        assert active(c, "retrain/retrain") == ([False], True) and active(c, "retrain/retrain-h200") == ([True], False), r.stdout
        c.pause_deployment(gpu.id)


def test_an_https_origin_is_cloned_with_the_token_of_a_prefect_secret_block(faults, tmp_path, hosts_dir):
    """A private HTTPS origin (TLS, a token required): the orchestrator pushes with its own credentials; the
    job's pull step and its checkout read the token from the Prefect Secret block, and the token appears in
    no URL, parameter or log that Prefect or the worker keeps."""
    from prefect.blocks.system import Secret
    from prefect.client.orchestration import get_client

    from flows.stage import GIT_TOKEN_BLOCK
    from githttps import GitHTTPS

    repo, w = faults["repo"], faults["worker"]
    token = "evoharness-forge-token-7f3a"
    forge = GitHTTPS(hosts_dir / "forge", token)
    url = forge.bare("faults")
    tls = {"GIT_SSL_CAINFO": str(forge.cert)}
    before = git(["remote", "get-url", "origin"], repo)
    worker = None
    try:
        refused = subprocess.run(["git", "ls-remote", url], env=dict(os.environ, GIT_TERMINAL_PROMPT="0", **tls), capture_output=True, text=True)
        assert refused.returncode != 0  # the forge wants the token
        git(["remote", "set-url", "origin", url.replace("https://", f"https://ci:{token}@")], repo)  # the scheduler's own credentials
        os.environ.update(tls)  # git, run by set_fault here, trusts the forge
        set_fault(faults, mode="finish")
        Secret(value=token).save(GIT_TOKEN_BLOCK, overwrite=True)
        r = cli(repo, faults["home"], "deploy", **tls)
        assert r.returncode == 0 and f"the stage jobs clone {url} with the token in the Prefect Secret block 'evoharness-git-token'" in r.stdout, r.stdout + r.stderr
        with get_client(sync_client=True) as c:
            steps = json.dumps(c.read_deployment_by_name("train-stage/train-stage-h200").pull_steps)
        assert url in steps and "{{ prefect.blocks.secret.evoharness-git-token }}" in steps and token not in steps
        worker = start_worker(w, "gpu-box-https", tmp_path / "worker.log", **tls, **faults["creds"])
        r = cli(repo, faults["home"], "run", "--pool", POOL, **tls)
        out = r.stdout + r.stderr
        assert "fault: ran" in out, out[-3000:]  # (the fault project has no evaluation to promote on: the job is what is tested)
        fr = job_runs("fault")[0]
        assert fr.state.is_completed() and fr.parameters["spec"]["repo"] == url.replace("https://", "https://ci@"), fr.parameters["spec"]["repo"]
        logs = job_log() + (tmp_path / "worker.log").read_text() + out
        assert f"checked out {git(['rev-parse', 'HEAD'], repo)[:12]} of {url.replace('https://', 'https://ci@')}" in logs
        assert token not in logs and token not in json.dumps(fr.parameters)
        assert forge.refused > 0 and forge.answered > 0
    finally:
        os.environ.pop("GIT_SSL_CAINFO", None)
        git(["remote", "set-url", "origin", before], repo)
        with get_client(sync_client=True) as c:
            try:
                c.delete_block_document(Secret.load(GIT_TOKEN_BLOCK)._block_document_id)
            except ValueError:
                pass
        cli(repo, faults["home"], "deploy")
        with get_client(sync_client=True) as c:
            for name in ("retrain/retrain", "retrain/retrain-h200"):
                c.pause_deployment(c.read_deployment_by_name(name).id)
        if worker is not None:
            kill_user(w.user)
            worker.wait(30)
        forge.close()
