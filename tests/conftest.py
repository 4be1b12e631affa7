"""Shared fixtures: one small generated game set per session, played on the real engine."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def games_root(tmp_path_factory) -> Path:
    """One game per family in each of train, valid_seen and valid_unseen (18 games)."""
    from evoharness.alfworld.generate import GenConfig, generate

    root = tmp_path_factory.mktemp("games")
    generate(root, GenConfig(seed=7, per_family={"train": 1, "valid_seen": 1, "valid_unseen": 1}))
    return root


@pytest.fixture()
def games_copy(games_root, tmp_path) -> Path:
    """A private copy that a test may corrupt."""
    dst = tmp_path / "games"
    shutil.copytree(games_root, dst)
    return dst


@pytest.fixture(scope="session")
def pool():
    from evoharness.envpool import EnvPool

    p = EnvPool(2)
    yield p
    p.close()


# ---- servers for the orchestration tests: one Prefect server per session, one migrated MLflow db ----

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory):
    """A real Prefect server (its own home and SQLite database) for the whole session; every
    process the tests start (flows, workers, the CLI) reaches it through PREFECT_API_URL."""
    import subprocess
    import sys
    import time
    import urllib.request

    home = tmp_path_factory.mktemp("prefect-home")
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    env = dict(os.environ, PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_API_URL=url,
               PREFECT_SERVER_LOGGING_LEVEL="WARNING", PREFECT_UI_ENABLED="false")
    prefect = Path(sys.executable).parent / "prefect"
    log = open(home / "server.log", "w")
    proc = subprocess.Popen([str(prefect), "server", "start", "--host", "127.0.0.1", "--port", str(port)], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 120
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"Prefect test server did not start: {(home / 'server.log').read_text()[-2000:]}")
        time.sleep(0.5)
    saved = {k: os.environ.get(k) for k in ("PREFECT_HOME", "PREFECT_API_URL")}
    os.environ.update(PREFECT_HOME=str(home), PREFECT_API_URL=url)
    yield url
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    import signal

    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(15)
    except Exception:
        os.killpg(proc.pid, signal.SIGKILL)
    log.close()


@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory) -> Path:
    """An MLflow SQLite store migrated once (the migrations take seconds); tests copy it."""
    from mlflow import MlflowClient

    db = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture()
def mlflow_store(mlflow_template, tmp_path, monkeypatch) -> str:
    db = tmp_path / "mlflow.db"
    shutil.copy(mlflow_template, db)
    uri = f"sqlite:///{db}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri
