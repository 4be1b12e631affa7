"""Shared fixtures: one small generated game set per session, played on the real engine."""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The suite runs as a newcomer would, on a fresh machine: an empty HOME (no ~/.gitconfig, no Prefect profile,
# no caches), no global or system git config and no git identity in the environment. Set before anything
# of the project is imported (``lineage.DEFAULT_REMOTE`` and the worker's home derive from HOME).
NEWCOMER_HOME = Path(tempfile.mkdtemp(prefix="evoharness-test-home-"))
atexit.register(shutil.rmtree, NEWCOMER_HOME, True)
(NEWCOMER_HOME / ".gitconfig-empty").write_text("")
os.environ.update(HOME=str(NEWCOMER_HOME), GIT_CONFIG_GLOBAL=str(NEWCOMER_HOME / ".gitconfig-empty"), GIT_CONFIG_NOSYSTEM="1")
for _var in ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL", "EMAIL", "PREFECT_PROFILE",
             "PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_URI", "XDG_CONFIG_HOME", "XDG_CACHE_HOME"):
    os.environ.pop(_var, None)


# scripts/test.sh runs two pytest-xdist workers, a whole file on one (``--dist loadfile``), the files in this order
# (``--no-loadscope-reorder``): the longest first, so that no long file starts last. test_two_hosts trains on the CPU
# while test_pool_faults, beside it, mostly waits (its stages sleep). Within a file, tests keep their order (some
# build on what an earlier one made). Each worker is a session: its own servers, HOME and worker host.
LONGEST_FIRST = ("test_two_hosts.py", "test_pool_faults.py", "test_distributed.py", "test_orchestration.py", "test_dvc.py",
                 "test_vllm.py", "test_training.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


# One secret for the session's credentials (the WebDAV remote's password, the MLflow server's), so that a test can
# grep every store for it (test_two_hosts' canary).
CANARY = "canary" + secrets.token_hex(10)


@pytest.fixture(scope="session")
def canary() -> str:
    return CANARY


@pytest.fixture(scope="session")
def games_root(tmp_path_factory) -> Path:
    """One game per family in each of train, valid_seen and valid_unseen (18 games)."""
    from evoharness.agent.alfworld.generate import GenConfig, generate

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
    from evoharness.agent.envpool import EnvPool

    p = EnvPool(2)
    yield p
    p.close()


# ---- servers for the orchestration tests: one Prefect server per session, one migrated MLflow db ----

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrefectServer:
    """A real Prefect server (its own home and SQLite database) on one port, which a test may stop and start
    again (a restart: same port, same database)."""

    def __init__(self, home: Path, port: int, auth: str):
        self.home, self.port, self.auth = home, port, auth
        self.url = f"http://127.0.0.1:{port}/api"
        self.proc = None

    def start(self, timeout: float = 120) -> None:
        import subprocess
        import sys
        import time
        import urllib.request

        env = dict(os.environ, PREFECT_HOME=str(self.home), PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_API_URL=self.url,
                   PREFECT_SERVER_LOGGING_LEVEL="WARNING", PREFECT_UI_ENABLED="false",
                   PREFECT_SERVER_API_AUTH_STRING=self.auth)  # every API call needs the credentials (only /health is open)
        prefect = Path(sys.executable).parent / "prefect"
        log = open(self.home / "server.log", "a")
        self.proc = subprocess.Popen([str(prefect), "server", "start", "--host", "127.0.0.1", "--port", str(self.port)], env=env,
                                     stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + timeout
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                self.proc.kill()
                raise RuntimeError(f"Prefect test server did not start: {(self.home / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(15)
        except ProcessLookupError:
            pass
        except Exception:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(15)


@pytest.fixture(scope="session")
def prefect_service(tmp_path_factory):
    """The session's Prefect server: every process the tests start (flows, workers, the CLI) reaches it
    through PREFECT_API_URL, with the server's basic-auth string (PREFECT_API_AUTH_STRING): it answers no
    API call without it, as a deployment reachable from other machines should."""
    server = PrefectServer(tmp_path_factory.mktemp("prefect-home"), _free_port(), f"evo-tests:{secrets.token_hex(12)}")
    server.start()
    saved = {k: os.environ.get(k) for k in ("PREFECT_HOME", "PREFECT_API_URL", "PREFECT_API_AUTH_STRING")}
    os.environ.update(PREFECT_HOME=str(server.home), PREFECT_API_URL=server.url, PREFECT_API_AUTH_STRING=server.auth)
    yield server
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


@pytest.fixture(scope="session")
def prefect_server(prefect_service) -> str:
    return prefect_service.url


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


# ---- two hosts on one machine: a git server and a DVC network remote on loopback, another user ----

def _wait_port(port: int, proc, what: str, log: Path, timeout: float = 60) -> None:
    import socket
    import time

    deadline = time.time() + timeout
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError(f"{what} did not start: {log.read_text()[-2000:] if log.exists() else ''}")
        time.sleep(0.2)


def _serve(cmd: list[str], port: int, what: str, log: Path, env: dict | None = None, timeout: float = 60):
    """Start a server for the session (its own process group) and wait until it accepts connections."""
    import subprocess

    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True, env=env)
    _wait_port(port, proc, what, log, timeout)
    return proc


def _stop(proc) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
    except Exception:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="session")
def hosts_dir():
    """A folder outside pytest's private tmp (which other users cannot enter) for the two hosts, the git
    server's repositories and the remote's storage; each host's own folder inside is closed to others."""
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="evoharness-hosts-"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


class WebDAV:
    """A real WebDAV server (wsgidav on cheroot) on loopback, with basic auth: the DVC network remote."""

    def __init__(self, root: Path, port: int, user: str, password: str):
        self.root, self.port, self.user, self.password = root, port, user, password

    def collection(self, name: str) -> str:
        """A fresh collection for one project's remote (WebDAV creates no parents: made here)."""
        (self.root / name).mkdir(parents=True, exist_ok=True)
        return f"webdav://127.0.0.1:{self.port}/{name}"


@pytest.fixture(scope="session")
def webdav(hosts_dir):
    import sys

    import yaml

    root = hosts_dir / "dav"
    root.mkdir()
    port = _free_port()
    user, password = "evo", CANARY
    cfg = hosts_dir / "dav.yaml"
    cfg.write_text(yaml.safe_dump({
        "host": "127.0.0.1", "port": port, "provider_mapping": {"/": str(root)}, "verbose": 1,
        "http_authenticator": {"domain_controller": None, "accept_basic": True, "accept_digest": False, "default_to_digest": False},
        "simple_dc": {"user_mapping": {"*": {user: {"password": password}}}},
    }))
    proc = _serve([str(Path(sys.executable).parent / "wsgidav"), "--config", str(cfg)], port, "WebDAV server", hosts_dir / "dav.log")
    yield WebDAV(root, port, user, password)
    _stop(proc)


class S3:
    """A real S3-compatible server (moto's standalone server) on loopback: the DVC remote of teams on S3.
    Its credentials are the server's own pair; ``remote`` configures a project the way a team would."""

    def __init__(self, port: int):
        self.port, self.endpoint = port, f"http://127.0.0.1:{port}"
        self.key_id, self.secret = "AKIAEVOHARNESSTEST01", "evoharness-test-secret-key"

    def bucket(self, name: str) -> str:
        import boto3

        s3 = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.key_id, aws_secret_access_key=self.secret,
                          region_name="us-east-1")
        s3.create_bucket(Bucket=name)
        return f"s3://{name}/dvc"

    def configure(self, repo: Path, url: str, name: str = "storage", run=None) -> None:
        """The remote in the committed config (URL, endpoint), its credentials only in config.local."""
        from evoharness.ops.vcs import dvc

        dvc(["remote", "add", "-d", "-f", name, url], repo)
        dvc(["remote", "modify", name, "endpointurl", self.endpoint], repo)
        dvc(["remote", "modify", "--local", name, "access_key_id", self.key_id], repo)
        dvc(["remote", "modify", "--local", name, "secret_access_key", self.secret], repo)

    def objects(self, bucket: str) -> list[str]:
        import boto3

        s3 = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=self.key_id, aws_secret_access_key=self.secret,
                          region_name="us-east-1")
        return [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]


@pytest.fixture(scope="session")
def s3(hosts_dir):
    import sys

    port = _free_port()
    proc = _serve([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)], port, "S3 server (moto)",
                  hosts_dir / "s3.log")
    yield S3(port)
    _stop(proc)


class MlflowServer:
    """A real MLflow tracking server (``mlflow server``: SQLite backend, artifacts proxied to a folder of its own)
    behind MLflow's basic-auth app: every API call needs its admin's password. ``uri`` holds the password as
    URL userinfo, the way a user would set MLFLOW_TRACKING_URI for a server of their team."""

    def __init__(self, port: int, user: str, password: str, base: Path):
        self.port, self.user, self.password, self.base = port, user, password, base
        self.url = f"http://127.0.0.1:{port}"
        self.uri = f"http://{user}:{password}@127.0.0.1:{port}"


@pytest.fixture(scope="session")
def mlflow_server(hosts_dir):
    import sys

    base = hosts_dir / "mlflow-server"
    base.mkdir()
    port, password = _free_port(), CANARY
    (base / "auth.ini").write_text(f"[mlflow]\ndefault_permission = READ\ndatabase_uri = sqlite:///{base / 'auth.db'}\n"
                                   f"admin_username = evo-admin\nadmin_password = {password}\n"
                                   "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n")
    env = dict(os.environ, MLFLOW_AUTH_CONFIG_PATH=str(base / "auth.ini"), MLFLOW_FLASK_SERVER_SECRET_KEY=secrets.token_hex(16))
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = _serve([str(Path(sys.executable).parent / "mlflow"), "server", "--app-name", "basic-auth", "--host", "127.0.0.1", "--port", str(port),
                   "--workers", "1", "--backend-store-uri", f"sqlite:///{base / 'mlflow.db'}", "--artifacts-destination", str(base / "artifacts"),
                   "--allowed-hosts", f"127.0.0.1:{port},localhost:{port}"],
                  port, "MLflow server", base / "server.log", env=env, timeout=180)
    yield MlflowServer(port, "evo-admin", password, base)
    _stop(proc)


class GitServer:
    """``git daemon`` on loopback: the origin both hosts clone from (and the orchestrator pushes to)."""

    def __init__(self, base: Path, port: int):
        self.base, self.port = base, port

    def bare(self, name: str) -> str:
        import subprocess

        path = self.base / f"{name}.git"
        subprocess.run(["git", "init", "-q", "--bare", "-b", "main", str(path)], check=True)
        return f"git://127.0.0.1:{self.port}/{name}.git"


@pytest.fixture(scope="session")
def git_server(hosts_dir):

    base = hosts_dir / "git"
    base.mkdir()
    port = _free_port()
    proc = _serve(["git", "daemon", "--reuseaddr", f"--base-path={base}", "--export-all", "--enable=receive-pack", "--listen=127.0.0.1",
                   f"--port={port}", str(base)], port, "git daemon", hosts_dir / "git-daemon.log")
    yield GitServer(base, port)
    _stop(proc)


# One worker host per pytest-xdist worker (scripts/test.sh runs two): a test that kills the worker host's processes
# kills that user's, never the other worker's jobs.
WORKER_USER = "evo-gpu" + (f"-{os.environ['PYTEST_XDIST_WORKER']}" if os.environ.get("PYTEST_XDIST_WORKER") else "")

# The worker host: another user, in its own mount namespace where the orchestrator's folders are empty
# and, of the folder that holds this machine's Python (root's home, closed to others), only the Python
# itself is there: the installed software, nothing of the other host's files.
_WORKER_SH = r"""set -e
if [ -n "$EVO_PY_HIDE" ]; then
  mount --bind "$EVO_PY_PREFIX" "$EVO_PY_STASH"
  mount -t tmpfs -o mode=755 tmpfs "$EVO_PY_HIDE"
  mkdir -p "$EVO_PY_PREFIX"
  mount --bind "$EVO_PY_STASH" "$EVO_PY_PREFIX"
fi
for d in $EVO_MASK; do mount --bind "$EVO_EMPTY" "$d"; done
exec runuser -p -u "$EVO_USER" -- "$@"
"""


class WorkerHost:
    def __init__(self, user: str, home: Path, base: Path, mask: list[Path]):
        import sys

        self.user, self.home, self.mask = user, home, mask
        self.empty = base / "empty"
        self.empty.mkdir(exist_ok=True)
        prefix = Path(sys.base_prefix).resolve()
        hide = next((a for a in reversed(prefix.parents) if a != Path("/") and not (a.stat().st_mode & 0o001)), None)
        self.py = {"EVO_PY_PREFIX": str(prefix), "EVO_PY_HIDE": str(hide or ""), "EVO_PY_STASH": str(base / "py-stash")}
        (base / "py-stash").mkdir(exist_ok=True)

    def env(self, **extra) -> dict:
        import sys

        env = {k: v for k, v in os.environ.items() if k.startswith(("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "LANG", "LC_"))}
        env.update(HOME=str(self.home), USER=self.user, PREFECT_HOME=str(self.home / ".prefect"), TOKENIZERS_PARALLELISM="false",
                   PREFECT_SERVER_ANALYTICS_ENABLED="false", PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}", **extra)
        return env

    def argv(self, cmd: list[str]) -> list[str]:
        return ["unshare", "-m", "--propagation", "private", "sh", "-c", _WORKER_SH, "worker-host", *cmd]

    def _wrap_env(self, env: dict | None) -> dict:
        return {**(env or self.env()), **self.py, "EVO_USER": self.user, "EVO_EMPTY": str(self.empty), "EVO_MASK": " ".join(map(str, self.mask))}

    def run(self, cmd: list[str], env: dict | None = None, cwd: Path | None = None, **kw):
        import subprocess

        return subprocess.run(self.argv(cmd), env=self._wrap_env(env), cwd=cwd or self.home, **kw)

    def popen(self, cmd: list[str], log: Path, env: dict | None = None):
        import subprocess

        return subprocess.Popen(self.argv(cmd), env=self._wrap_env(env), cwd=self.home, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                start_new_session=True)


@pytest.fixture(scope="session")
def worker_host(hosts_dir):
    """Another user for the worker host, its home (0700) its own, the orchestrator's folders invisible
    to it (``hosts_dir/orch``, ``hosts_dir/orch-home``). Needs root (CI runs as root)."""
    import pwd
    import subprocess
    import sys

    if os.geteuid() != 0:
        pytest.fail("the two-host tests create a second user and a mount namespace for the worker, and need root (CI runs as root)")
    try:
        pwd.getpwnam(WORKER_USER)
    except KeyError:
        subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", WORKER_USER], check=True)
    home = hosts_dir / "gpu-home"
    home.mkdir(mode=0o700)
    shutil.chown(home, WORKER_USER, WORKER_USER)
    mask = [hosts_dir / "orch", hosts_dir / "orch-home"]
    for d in mask:
        d.mkdir(mode=0o700, exist_ok=True)
    host = WorkerHost(WORKER_USER, home, hosts_dir, mask)
    r = host.run([sys.executable, "-c", "import evoharness, prefect, dvc"], capture_output=True, text=True)
    if r.returncode:
        pytest.fail(f"the worker host cannot run this project's Python ({sys.executable}): {r.stderr[-800:]}")
    return host
