"""Helpers of the two-host tests (test_two_hosts, test_pool_faults): the orchestrator's commands in its own
HOME, a worker on the other host, the jobs' flow runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

POOL = "h200"


def orch_env(home: Path, **extra) -> dict:
    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)  # the project's own store, unless the test names a server
    env.update(HOME=str(home), TOKENIZERS_PARALLELISM="false", **extra)
    return env


def cli(repo: Path, home: Path, *args, timeout: int = 900, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=repo, env=orch_env(home, **env), capture_output=True, text=True, timeout=timeout)


def start_cli(repo: Path, home: Path, log: Path, *args, **env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=repo, env=orch_env(home, **env), stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def start_worker(worker, name: str, log: Path, prefix: list[str] | None = None, **env) -> subprocess.Popen:
    """A process worker of the pool on the worker host, one job at a time (``--limit 1``: a box runs one 8-GPU job)."""
    return worker.popen([*(prefix or []), str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool", POOL, "--type", "process",
                         "--name", name, "--limit", "1"], log, env=worker.env(**env))


def kill_user(user: str) -> None:
    """The worker's machine is gone: every process of that user, the job and its training included."""
    subprocess.run(["pkill", "-KILL", "-u", user], check=False)
    deadline = time.time() + 30
    while subprocess.run(["pgrep", "-u", user], capture_output=True).returncode == 0 and time.time() < deadline:
        time.sleep(0.2)


def job_runs(stage: str) -> list:
    """The stage's job flow runs, newest first."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as c:
        runs = [fr for fr in c.read_flow_runs(limit=200) if fr.name.startswith(f"{stage}@")]
    return sorted(runs, key=lambda fr: fr.created, reverse=True)


def wait_for(pred, timeout: float, what: str, proc=None, log: Path | None = None):
    deadline = time.time() + timeout
    while True:
        got = pred()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what}: the process ended first: {log.read_text()[-3000:] if log else ''}")
        if time.time() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s: {log.read_text()[-3000:] if log else ''}")
        time.sleep(0.5)


def _completion(content: str) -> bytes:
    return json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode()


def _send(handler: BaseHTTPRequestHandler, status: int, data: bytes) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class _Chat(BaseHTTPRequestHandler):
    """An OpenAI-compatible chat endpoint that always takes the first admissible command."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append((self.headers.get("Authorization"), body))
        prompt = body["messages"][0]["content"]
        first = prompt.split("ADMISSIBLE COMMANDS: ", 1)[1].split(" | ")[0]
        _send(self, 200, _completion(f"<think>first</think>\n<action>{first}</action>"))

    def log_message(self, *a):
        pass


class _Consolidator(BaseHTTPRequestHandler):
    """An OpenAI-compatible chat endpoint answering each call with the next of ``server.replies``: a string (the
    completion's content), a callable of the call's number returning one, or (status, raw body). While
    ``server.hold`` is set, a call numbered ``server.hold_from`` or later waits (a consolidator that hangs)."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv = self.server
        srv.seen.append((self.headers.get("Authorization"), body))
        n = len(srv.seen)
        while srv.hold.is_set() and n >= srv.hold_from:
            time.sleep(0.05)
        reply = srv.replies[min(n, len(srv.replies)) - 1]
        reply = reply(n) if callable(reply) else reply
        _send(self, *(reply if isinstance(reply, tuple) else (200, _completion(reply))))

    def log_message(self, *a):
        pass


def start_consolidator(replies: list) -> ThreadingHTTPServer:
    """A consolidator endpoint on loopback (``_Consolidator``); ``.seen``: (Authorization, body) per call."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Consolidator)
    srv.seen, srv.replies, srv.hold, srv.hold_from = [], list(replies), threading.Event(), 1
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def start_chat() -> ThreadingHTTPServer:
    """The chat endpoint on loopback, served by a thread of this process; ``.seen``: (Authorization, body) per call."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Chat)
    srv.seen = []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv
