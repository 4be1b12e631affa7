"""Credentials in a URL (a DVC remote, the git origin, an endpoint) never reach a fingerprint, a Prefect
parameter, a log line or an MLflow tag: each boundary is tried with a real credential-bearing URL."""

from __future__ import annotations

import json
import os

import pytest

from evoharness.core.errors import EvoError
from evoharness.ops.vcs import dvc, git
from evoharness.core.secrets import redact
from project import commit, make_project, MICRO

SECRET = "s3cr3t-t0ken"


def test_redact():
    assert redact(f"https://evo:{SECRET}@git.example.com/x.git") == "https://evo:***@git.example.com/x.git"
    assert redact(f"webdav://u:{SECRET}@127.0.0.1:8080/store and s3://b/k?token={SECRET}&x=1") == "webdav://u:***@127.0.0.1:8080/store and s3://b/k?token=***&x=1"
    assert redact(f"https://evo:{SECRET}@{SECRET}@h/x.git") == "https://evo:***@h/x.git"  # a raw '@' in the password
    assert redact(f"https://ghp_{SECRET}{SECRET}{SECRET}@github.com/o/r.git") == "https://***@github.com/o/r.git"  # a token as the user


def test_git_urls_keep_their_user_and_lose_only_their_secret():
    """The worker must log in as the URL's user (a forge refuses its own), so that user is never stripped."""
    from evoharness.core.secrets import public_url

    for url in ("ssh://git@git.example.com/evoharness.git", "git@git.example.com:team/evoharness.git", "https://ci@git.example.com/x.git"):
        assert redact(url) == url and public_url(url) == url
    assert public_url(f"https://evo:{SECRET}@git.example.com/x.git") == "https://evo@git.example.com/x.git"
    assert public_url(f"https://ghp_{SECRET}{SECRET}{SECRET}@github.com/o/r.git") == "https://github.com/o/r.git"
    assert SECRET not in str(EvoError(f"remote https://u:{SECRET}@h/p is down"))  # no error line ever carries one


def test_the_job_spec_the_worker_receives_holds_no_credential(tmp_path, git_server):
    """The origin as teams often write it (a token in the URL): the Prefect parameter sent to the pool
    names the repository without it, and every refusal on the way is a line without it."""
    from evoharness.ops import dispatch

    repo = make_project(tmp_path, MICRO)
    url = git_server.bare("secret-origin")
    fake = f"https://evo:{SECRET}@git.example.com/evoharness.git"
    git(["config", f"url.{url}.insteadOf", fake], repo)  # git reaches the fake host through the daemon
    git(["remote", "add", "origin", fake], repo)
    with pytest.raises(EvoError) as e:
        dispatch.job_spec(repo, "sft_inline", "--pool h200")  # not pushed yet
    assert SECRET not in str(e.value) and "https://evo:***@git.example.com/evoharness.git" in str(e.value)
    git(["push", "-q", "origin", "main"], repo)
    dvc(["remote", "add", "-d", "storage", f"webdav://evo:{SECRET}@127.0.0.1:9/store"], repo)
    commit(repo, "-qam", "remote")
    git(["push", "-q", "origin", "main"], repo)
    spec = dispatch.job_spec(repo, "sft_inline", "--pool h200")
    assert spec["repo"] == "https://evo@git.example.com/evoharness.git" and SECRET not in json.dumps(spec)
    # The remote itself unreachable: the line names it, not its password.
    from evoharness.ops.vcs import check_remote

    (repo / ".dvc" / "config.local").unlink()  # the local default of make_project
    with pytest.raises(EvoError) as e:
        check_remote(repo)
    assert "webdav://evo:***@127.0.0.1:9/store" in str(e.value) and SECRET not in str(e.value)


def test_mlflow_params_and_tags_and_fingerprints_hold_no_credential(mlflow_store, tmp_path):
    from evoharness.ops import tracking
    from evoharness.agent.policies.chat import ChatPolicy

    c = tracking.client(tmp_path)
    run = c.create_run(tracking.experiment_id(c, tmp_path))
    tracking.log_params(c, run.info.run_id, {"remote": {"url": f"webdav://evo:{SECRET}@dav.example.com/store"}, "api_token": SECRET})
    tracking.set_tags(c, run.info.run_id, {"origin": f"https://evo:{SECRET}@git.example.com/x.git"})
    got = c.get_run(run.info.run_id).data
    assert SECRET not in json.dumps(got.params) and SECRET not in json.dumps(got.tags)
    assert got.params["remote.url"] == "webdav://evo:***@dav.example.com/store" and got.tags["origin"] == "https://evo:***@git.example.com/x.git"
    pol = ChatPolicy(f"https://evo:{SECRET}@llm.example.com/v1", "m", "NO_SUCH_KEY_VAR")
    assert SECRET not in pol.fingerprint() and "https://evo:***@llm.example.com/v1" in pol.fingerprint()


def test_signed_urls_authorization_headers_and_secret_settings_are_redacted():
    from evoharness.core.secrets import redact
    from evoharness.ops.tracking import _secret

    cases = {
        "https://b.s3.amazonaws.com/k?X-Amz-Signature=abc123&X-Amz-Credential=AKIAX%2F2026&X-Amz-Security-Token=tok&part=1":
            "https://b.s3.amazonaws.com/k?X-Amz-Signature=***&X-Amz-Credential=***&X-Amz-Security-Token=***&part=1",
        "https://api.example.com/v1?apikey=zzz&client_secret=yyy&access_key=xxx": "https://api.example.com/v1?apikey=***&client_secret=***&access_key=***",
        'Authorization: Bearer eyJhbGciOiJIUzI1NiJ9.payload.sig': "Authorization: Bearer ***",
        "aws_secret_access_key=wJalrXUtnFEMI/K7MDENG client_secret: s3cr3tvalue pwd=hunter2": "aws_secret_access_key=*** client_secret: *** pwd=***",
        "max_tokens: 512, tokens: 5, key_count=3": "max_tokens: 512, tokens: 5, key_count=3",  # not secrets: left alone
    }
    for raw, want in cases.items():
        assert redact(raw) == want, raw
    assert all(_secret(k) for k in ("db_passwd", "pwd", "auth_header", "url_signature", "api_key"))
    assert not _secret("max_steps") and not _secret("group_size")


def test_a_tracking_servers_password_never_reaches_mlflows_printed_links(monkeypatch, capsys, tmp_path):
    """MLflow prints its tracking URI in "View run ... at" links: the client is given the URI without its
    userinfo (the credentials go to MLFLOW_TRACKING_USERNAME / PASSWORD), and the main job's summary names the
    server's UI without them."""
    from evoharness.ops import tracking
    from evoharness.ops.report import print_results

    monkeypatch.setattr(tracking, "check_tracking", lambda uri: None)  # no server needed to shape the URI
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    assert tracking.client_uri(f"https://evo:{SECRET}%40x@mlflow.example.com:8443/") == "https://mlflow.example.com:8443/"
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "evo" and os.environ["MLFLOW_TRACKING_PASSWORD"] == f"{SECRET}@x"
    assert tracking.client_uri("sqlite:////tmp/x/mlflow.db") == "sqlite:////tmp/x/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://evo:{SECRET}@mlflow.example.com:5000")
    res = {"summary": {}, "decision": {"model": "m", "version": "1", "decision": "promoted", "reasons": []}, "ran": [], "cached": [],
           "seconds": 1.0, "parent_run_id": "r1"}
    (tmp_path / "data" / "baselines").mkdir(parents=True)
    (tmp_path / "data" / "metrics").mkdir()
    (tmp_path / "data" / "baselines" / "summary.json").write_text("{}")
    (tmp_path / "data" / "metrics" / "demos.json").write_text('{"won": 1, "demos": 1}')
    (tmp_path / "data" / "metrics" / "pairs.json").write_text('{"rows": {"train": 1, "val": 1}}')
    print_results(tmp_path, res, None, echo=print)
    out = capsys.readouterr().out
    assert "MLflow run r1: http://mlflow.example.com:5000/#/experiments" in out and SECRET not in out


def test_no_process_the_orchestrator_starts_inherits_the_tracking_servers_credentials(monkeypatch, tmp_path):
    """client_uri puts a tracking server's password into this process's environment (MLflow reads it per request);
    the DVC stages (and the trainers under them), git and the pool's jobs this process starts never see it."""
    from evoharness.ops import tracking
    from evoharness.ops.vcs import TRACKING_CREDENTIALS, child_env

    monkeypatch.setattr(tracking, "check_tracking", lambda uri: None)
    for k in TRACKING_CREDENTIALS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"https://evo:{SECRET}@mlflow.example.com/")
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", SECRET + "-token")
    tracking.client_uri(os.environ["MLFLOW_TRACKING_URI"])
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == SECRET  # this process's own client still authenticates
    git(["init", "-q"], tmp_path)
    dvc(["init", "-q"], tmp_path)
    (tmp_path / "dvc.yaml").write_text("stages:\n  env:\n    cmd: python -c \"import json, os; json.dump(dict(os.environ), open('env.json', 'w'))\"\n"
                                       "    outs: [env.json]\n")
    dvc(["repro", "-q"], tmp_path)  # a real DVC stage, run as the flow runs every stage
    stage_env = json.loads((tmp_path / "env.json").read_text())
    git_env = git(["-c", "alias.envdump=!env", "envdump"], tmp_path)  # what a git command (and its hooks) sees
    for seen in (json.dumps(stage_env), git_env, json.dumps(child_env(PYTHONUNBUFFERED="1"))):
        assert SECRET not in seen and "MLFLOW_TRACKING_PASSWORD" not in seen and "MLFLOW_TRACKING_TOKEN" not in seen
    assert stage_env["MLFLOW_TRACKING_URI"] == "https://evo@mlflow.example.com/"  # the server's address, without the secret
    assert "PATH" in stage_env and child_env(PYTHONUNBUFFERED="1")["PYTHONUNBUFFERED"] == "1"
