"""What the end of a retrain needs is checked before its first stage, on a fresh machine's terms: no git
identity (conftest empties HOME and git's global and system config), a real git daemon, a real WebDAV
remote with basic auth, a real MLflow store. Each refusal is one line and leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from evoharness.ops import preflight, tracking
from evoharness.ops import remote
from evoharness.core.errors import EvoError
from evoharness.ops.vcs import RECORD_EMAIL, RECORD_NAME
from evoharness.ops.vcs import dvc, git, record_identity
from evoharness.ops.records import record_run
from project import MICRO, make_project


def _author(repo: Path, rev: str) -> str:
    return git(["log", "-1", "--format=%an <%ae> / %cn <%ce>", rev], repo)


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


def test_the_record_commits_as_evoharness_without_an_identity_and_as_the_user_with_one(tmp_path):
    assert os.environ["GIT_CONFIG_GLOBAL"] and not any(os.environ.get(v) for v in ("GIT_AUTHOR_EMAIL", "GIT_COMMITTER_EMAIL", "EMAIL"))
    repo = make_project(tmp_path, MICRO)
    config_before = (repo / ".git" / "config").read_text()
    env, who = record_identity(repo)
    assert who.startswith(f"{RECORD_NAME} <{RECORD_EMAIL}>") and env["GIT_COMMITTER_EMAIL"] == RECORD_EMAIL
    tag, rec = record_run(repo, "run-a", "retrain run-a", push=False, echo=lambda _m: None)
    assert tag == "retrain/run-a" and git(["rev-parse", tag], repo) == rec
    assert _author(repo, tag) == f"{RECORD_NAME} <{RECORD_EMAIL}> / {RECORD_NAME} <{RECORD_EMAIL}>"
    # Nothing was written to any config: the repository's is as it was, the (empty) global one stays empty.
    assert (repo / ".git" / "config").read_text() == config_before and Path(os.environ["GIT_CONFIG_GLOBAL"]).read_text() == ""
    # A configured identity (here the repository's own) is used as it is.
    git(["config", "user.name", "Ada Lovelace"], repo)
    git(["config", "user.email", "ada@example.com"], repo)
    assert record_identity(repo) == ({}, "Ada Lovelace <ada@example.com> (the git identity configured here)")
    tag, _ = record_run(repo, "run-b", "retrain run-b", push=False, echo=lambda _m: None)
    assert _author(repo, tag) == "Ada Lovelace <ada@example.com> / Ada Lovelace <ada@example.com>"


def test_the_record_holds_the_runs_own_files_and_refuses_a_credential(tmp_path):
    """A modified tracked file the run did not make (a password added to .dvc/config, a README edit) is not
    committed by the record; a credential pasted into a file the record holds stops it in one line."""
    repo = make_project(tmp_path, MICRO)
    (repo / ".dvc" / "config").write_text((repo / ".dvc" / "config").read_text() + "['remote \"s\"']\n    password = hunter2\n")
    (repo / "README.md").write_text("edited, not by the run\n")
    (repo / "params.yaml").write_text((repo / "params.yaml").read_text() + "\n# tuned by hand\n")
    tag, rec = record_run(repo, "run-own", "retrain run-own", push=False, echo=lambda _m: None)
    changed = git(["diff", "--name-only", f"{rec}^", rec], repo).split()
    assert changed == ["params.yaml"] and "hunter2" not in git(["show", f"{rec}:.dvc/config"], repo)
    (repo / "params.yaml").write_text((repo / "params.yaml").read_text() + "chat_url: https://me:hunter2@llm.example/v1\n")
    tags_before = git(["tag"], repo)
    with pytest.raises(EvoError, match=r"^recording the run in git: params.yaml line \d+ holds a credential; .*nothing was recorded"):
        record_run(repo, "run-cred", "retrain run-cred", push=False, echo=lambda _m: None)
    assert git(["tag"], repo) == tags_before


def test_a_record_commit_is_checked_without_leaving_a_ref(tmp_path):
    repo = make_project(tmp_path, MICRO)
    refs_before = git(["for-each-ref"], repo)
    probe, who = preflight.check_record(repo)
    assert who.startswith("evoharness <retrain@localhost>") and git(["cat-file", "-t", probe], repo) == "commit"
    assert git(["for-each-ref"], repo) == refs_before and git(["status", "--porcelain"], repo) == ""
    empty = tmp_path / "empty"
    empty.mkdir()
    git(["init", "-q", "-b", "main"], empty)
    with pytest.raises(EvoError, match=r"has no git commit yet, and each retrain's record is a commit on top of the code it ran"):
        preflight.check_record(empty)


def test_the_origin_must_accept_the_push(tmp_path, git_server):
    repo = make_project(tmp_path, MICRO)
    probe, _ = preflight.check_record(repo)
    assert preflight.check_origin_push(repo, probe) is None  # no origin: the record stays here
    url = git_server.bare("preflight-origin")
    git(["remote", "add", "origin", url], repo)
    assert preflight.check_origin_push(repo, probe) == url
    assert git(["ls-remote", "--tags", "origin"], repo) == ""  # a dry run: nothing reached the origin
    git(["remote", "set-url", "origin", f"git://127.0.0.1:{_closed_port()}/gone.git"], repo)
    with pytest.raises(EvoError, match=r"^git origin git://127\.0\.0\.1:\d+/gone\.git refuses a push from .*: fix the origin's URL"):
        preflight.check_origin_push(repo, probe)


def test_the_dvc_remote_must_accept_a_write(tmp_path, webdav):
    repo = make_project(tmp_path, MICRO)
    assert remote.check_remote_writable(repo) == f"local ({tmp_path / 'remote'})"
    assert list((tmp_path / "remote").iterdir()) == []  # the probe file is gone
    (repo / ".dvc" / "config.local").unlink()
    dvc(["remote", "add", "-d", "storage", webdav.collection("preflight")], repo)
    dvc(["remote", "modify", "--local", "storage", "user", webdav.user], repo)
    dvc(["remote", "modify", "--local", "storage", "password", "wrong-password"], repo)
    with pytest.raises(EvoError) as e:
        remote.check_remote_writable(repo)
    assert str(e.value).startswith(f"DVC remote 'storage' (webdav://127.0.0.1:{webdav.port}/preflight) does not accept a write, read and delete from {repo}")
    assert "wrong-password" not in str(e.value)
    dvc(["remote", "modify", "--local", "storage", "password", webdav.password], repo)
    assert remote.check_remote_writable(repo) == f"storage (webdav://127.0.0.1:{webdav.port}/preflight)"
    assert list((webdav.root / "preflight").iterdir()) == []
    # A local remote that cannot exist (its parent is a file): one line, even for root.
    (tmp_path / "a-file").write_text("")
    dvc(["remote", "add", "-d", "--local", "broken", str(tmp_path / "a-file" / "remote")], repo)
    with pytest.raises(EvoError, match=r"DVC remote 'broken' \(.*a-file/remote\) does not accept a write"):
        remote.check_remote_writable(repo)


def test_an_s3_remote_is_probed_with_a_write_a_read_and_a_delete(tmp_path, s3):
    """dvc-s3 is installed and S3 remotes are checked like every other kind, against a real S3 server."""
    repo = make_project(tmp_path, MICRO)
    (repo / ".dvc" / "config.local").unlink()
    url = s3.bucket("preflight")
    s3.configure(repo, url)
    assert remote.check_remote_writable(repo) == f"storage ({url})"
    assert s3.objects("preflight") == []  # the probe object is gone
    # (moto's server takes any key pair; a refused one is the same error path as these two)
    dvc(["remote", "modify", "storage", "endpointurl", f"http://127.0.0.1:{_closed_port()}"], repo)
    with pytest.raises(EvoError) as e:
        remote.check_remote_writable(repo)
    assert str(e.value).startswith(f"DVC remote 'storage' ({url}) does not accept a write, read and delete from {repo}") and s3.secret not in str(e.value)
    dvc(["remote", "modify", "storage", "endpointurl", s3.endpoint], repo)
    dvc(["remote", "modify", "storage", "url", "s3://no-such-bucket/dvc"], repo)
    with pytest.raises(EvoError, match=r"^DVC remote 'storage' \(s3://no-such-bucket/dvc\) does not accept a write, read and delete .*"):
        remote.check_remote_writable(repo)
    # The whole path: outputs pushed to the S3 server and pulled back by hash into a fresh cache.
    dvc(["remote", "modify", "storage", "url", url], repo)
    (repo / "data").mkdir(exist_ok=True)
    (repo / "data" / "probe.txt").write_text("pushed to S3\n")
    dvc(["add", "data/probe.txt"], repo)
    dvc(["push", "data/probe.txt.dvc"], repo)
    assert any(k.startswith("dvc/files/md5/") for k in s3.objects("preflight"))
    import shutil

    shutil.rmtree(repo / ".dvc" / "cache")
    (repo / "data" / "probe.txt").unlink()
    dvc(["pull", "data/probe.txt.dvc"], repo)
    assert (repo / "data" / "probe.txt").read_text() == "pushed to S3\n"


def test_mlflow_must_accept_a_run_an_artifact_a_version_and_an_alias(mlflow_store, tmp_path):
    c = tracking.client(tmp_path)
    assert preflight.check_mlflow(tmp_path, "agent-x").endswith("(champion of agent-x: none yet)")
    exp = c.get_experiment_by_name(tracking.EXPERIMENT)
    assert c.search_runs([exp.experiment_id], "") == []  # the probe run is deleted
    assert c.search_model_versions("name='agent-x-preflight'") == [] and not c.get_registered_model("agent-x-preflight").aliases
    # An artifact store that cannot be written (its folder would be inside a file): refused before any stage.
    (tmp_path / "a-file").write_text("")
    c.create_experiment("evoharness-retrain-broken", artifact_location=(tmp_path / "a-file" / "artifacts").as_uri())
    c.rename_experiment(exp.experiment_id, "evoharness-retrain-old")
    c.rename_experiment(c.get_experiment_by_name("evoharness-retrain-broken").experiment_id, tracking.EXPERIMENT)
    with pytest.raises(EvoError, match=r"^MLflow store sqlite:///.* refused to store an artifact \(.*\); the promotion at the end of the run needs it"):
        preflight.check_mlflow(tmp_path, "agent-x")
    # A champion whose evidence cannot be read would stop the gate after the run: it stops the preflight instead.
    c.rename_experiment(c.get_experiment_by_name(tracking.EXPERIMENT).experiment_id, "evoharness-retrain-broken")
    c.rename_experiment(exp.experiment_id, tracking.EXPERIMENT)
    run = c.create_run(exp.experiment_id)
    c.create_registered_model("agent-y")
    mv = c.create_model_version("agent-y", source=f"{run.info.artifact_uri}/model", run_id=run.info.run_id,
                                tags={"eval.valid_seen.all": "0.5", "cond.hash": "x"})
    c.set_registered_model_alias("agent-y", "champion", mv.version)
    with pytest.raises(EvoError, match=r"champion agent-y version 1 has no readable promotion/evidence.json .*nothing moved"):
        preflight.check_mlflow(tmp_path, "agent-y")


def test_folders_the_run_writes_outside_the_project_are_made_or_refused(tmp_path):
    made = preflight.writable_dir(tmp_path / "new" / "prefect", "Prefect's home (PREFECT_HOME)")
    assert made.is_dir() and list(made.iterdir()) == []
    (tmp_path / "a-file").write_text("")
    with pytest.raises(EvoError, match=r"^Prefect's home \(PREFECT_HOME\) .*a-file/prefect cannot be created or written"):
        preflight.writable_dir(tmp_path / "a-file" / "prefect", "Prefect's home (PREFECT_HOME)")


def test_a_retrain_whose_origin_refuses_the_push_stops_before_its_first_stage(prefect_server, tmp_path, mlflow_template):
    import shutil

    repo = make_project(tmp_path, MICRO)
    shutil.copy(mlflow_template, repo / "mlflow.db")
    git(["remote", "add", "origin", f"git://127.0.0.1:{_closed_port()}/gone.git"], repo)
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    r = subprocess.run([sys.executable, "-m", "flows.cli", "run"], cwd=repo, env=dict(env, TOKENIZERS_PARALLELISM="false"),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith("error: git origin git://127.0.0.1:"), r.stderr[-2000:]
    assert not (repo / "data" / "games").exists() and not (repo / "dvc.lock").exists()  # no stage ran
    assert "preflight: DVC remote local" in r.stdout + r.stderr



def test_records_never_move_and_reproduce_refuses_a_moved_one(tmp_path, git_server, mlflow_template, monkeypatch):
    """A retry of a run's record reuses it; origin's record is never overwritten (nor is a local one by a fetch);
    reproduce refuses a record tag that names another commit than the MLflow run recorded."""
    import shutil

    from evoharness.ops import tracking
    from evoharness.ops.reproduce import reproduce

    repo = make_project(tmp_path, MICRO)
    git(["remote", "add", "origin", git_server.bare("records")], repo)
    git(["push", "-q", "origin", "HEAD:main"], repo)
    tag, rec = record_run(repo, "run-r", "retrain run-r", echo=lambda _m: None)
    again, rec2 = record_run(repo, "run-r", "retrain run-r (retried)", echo=lambda _m: None)
    assert (again, rec2) == (tag, rec) and git(["ls-remote", "origin", f"refs/tags/{tag}"], repo).split()[0] == rec
    # Someone moves the tag here to another commit: the push is refused, origin keeps its record.
    other = git(["commit-tree", f"{rec}^{{tree}}", "-p", rec, "-m", "forged"], repo, env=dict(os.environ, **record_identity(repo)[0]))
    git(["tag", "-f", tag, other], repo)
    with pytest.raises(EvoError, match=rf"already has the record {tag} naming commit {rec[:12]}, not {other[:12]}; records never move"):
        record_run(repo, "run-r", "retrain run-r", echo=lambda _m: None)
    assert git(["ls-remote", "origin", f"refs/tags/{tag}"], repo).split()[0] == rec
    # A fetch of the records never overwrites the local one either; reproduce compares it with what MLflow recorded.
    from evoharness.ops.records import _fetch_records

    _fetch_records(repo)
    assert git(["rev-parse", f"refs/tags/{tag}"], repo) == other
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    shutil.copy(mlflow_template, repo / "mlflow.db")
    c = tracking.client(repo)
    run = c.create_run(tracking.experiment_id(c, repo), tags={"git_commit": rec, "git_record_commit": rec})
    git(["tag", f"retrain/{run.info.run_id}", other], repo)
    with pytest.raises(EvoError, match=rf"names commit {other[:12]}, but MLflow run {run.info.run_id} recorded {rec[:12]}; the tag was moved"):
        reproduce(run.info.run_id, repo, echo=lambda _m: None, setup=False)


def test_a_params_file_missing_a_key_a_stage_reads_is_one_line_before_any_stage(tmp_path):
    """DVC stops a stage whose params key is missing, deep into a retrain (an older params.yaml lacks a newer key):
    the preflight names the key and the stage first."""
    import shutil

    import yaml

    from evoharness.core.errors import EvoError
    from evoharness.ops.preflight import check_stage_params
    from project import MICRO, ROOT

    shutil.copy(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(MICRO))
    check_stage_params(tmp_path)
    old = {k: v for k, v in MICRO.items() if k != "consolidator"}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(old))
    with pytest.raises(EvoError, match=r"no 'consolidator', which dvc.yaml's stage grpo reads"):
        check_stage_params(tmp_path)
