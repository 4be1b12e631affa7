"""Environment workers: the real engine in worker processes behind reset(game) / step(action).

The engine is slow and not thread-safe, so each worker process owns one ``Engine``; the
parent talks to it over a pipe with a deadline per call. A worker that crashes or hangs is
killed and replaced, and the call raises ``EnvWorkerError`` so that the episode it served is
reported as errored, never dropped.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Callable, ContextManager, Iterable, TypeVar

from evoharness.agent.alfworld.engine import EnvStep
from evoharness.core.errors import EnvWorkerError, EvoError

T = TypeVar("T")
R = TypeVar("R")

# The parent runs threads, so it never forks itself: workers come from a fork server, a clean process that
# imported the engine's modules once (textworld alone takes about 1.6 s to import), so a pool of 16 starts in
# well under a second instead of about 18 s of imports on 2 cores.
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["evoharness.agent.alfworld.engine", "textworld", "textworld.envs.pddl", "alfworld.agents.environment.alfred_tw_env"])
_SERVER_LOCK = threading.Lock()

# The engine (TextWorld with ALFWorld's expert) can take a different course under another hash seed of its process:
# one env_only teacher episode in 400 went two ways in two runs of the same code (PYTHONHASHSEED 4 and 6 give the
# two). Workers run with the seed pinned: they fork from a server started with PYTHONHASHSEED=0.
HASH_SEED = "0"


_PINNED_PID: int | None = None  # the fork server this module started with the pinned seed


def _ensure_server() -> None:
    """Start the fork server (if it is not running) with the pinned hash seed in its environment. One started
    by other code in this process, without the pin, is one line here (its workers would fail every episode)."""
    global _PINNED_PID
    from multiprocessing import forkserver

    with _SERVER_LOCK:
        running = getattr(forkserver._forkserver, "_forkserver_pid", None)
        if running is not None and running != _PINNED_PID:
            raise EvoError(f"environment workers: this process's fork server (pid {running}) was started by other code, "
                           "without PYTHONHASHSEED=0; episodes would depend on its hash seed")
        saved = os.environ.get("PYTHONHASHSEED")
        os.environ["PYTHONHASHSEED"] = HASH_SEED
        try:
            forkserver.ensure_running()
            _PINNED_PID = getattr(forkserver._forkserver, "_forkserver_pid", None)
        finally:
            if saved is None:
                del os.environ["PYTHONHASHSEED"]
            else:
                os.environ["PYTHONHASHSEED"] = saved


def _worker_main(conn, expert: bool, speedups: bool = True) -> None:
    from evoharness.agent.alfworld.engine import Engine

    engine = Engine(expert=expert, speedups=speedups)
    seed = os.environ.get("PYTHONHASHSEED")  # the fork server's, which this process inherited
    while True:
        try:
            cmd, args = conn.recv()
        except (EOFError, KeyboardInterrupt):
            return
        if cmd == "close":
            return
        try:
            if cmd == "flags":
                result = {"PYTHONHASHSEED": seed, "hash_randomization": sys.flags.hash_randomization}
            elif seed != HASH_SEED:  # fail closed: an episode here might not replay the same
                raise EvoError(f"this environment worker's hash seed is not pinned (PYTHONHASHSEED={seed!r}, not {HASH_SEED}): "
                               "its episodes would depend on it")
            elif cmd == "reset":
                result = engine.reset(*args)
            elif cmd == "step":
                result = engine.step(*args)
            elif cmd == "crash":  # test hook: simulate the engine dying mid-episode
                os._exit(3)
            elif cmd == "hang":  # test hook: simulate a hung engine
                import time

                time.sleep(3600)
                result = None
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", result))
        except Exception as e:  # an engine error belongs to this game, not to the worker
            conn.send(("err", f"{type(e).__name__}: {e}".splitlines()[0][:500]))


class EnvWorker:
    """One engine in one process. ``reset`` loads the game only when it changed."""

    def __init__(self, step_timeout: float = 30.0, reset_timeout: float = 180.0, expert: bool = True, speedups: bool = True):
        self.speedups = speedups
        self.step_timeout = step_timeout
        self.reset_timeout = reset_timeout
        self.expert = expert
        self.proc: mp.Process | None = None
        self.conn = None
        self.restarts = 0
        self.game: str | None = None

    def _start(self) -> None:
        _ensure_server()
        parent, child = _CTX.Pipe()
        self.proc = _CTX.Process(target=_worker_main, args=(child, self.expert, self.speedups), daemon=True)
        self.proc.start()
        child.close()
        self.conn = parent

    def _kill(self) -> None:
        if self.proc is not None and self.proc.pid is not None:
            self.proc.kill()
            self.proc.join(5)
        self.proc, self.conn, self.game = None, None, None

    def _call(self, cmd: str, args: tuple, timeout: float, what: str):
        if self.proc is None or not self.proc.is_alive():
            died = self.proc is not None
            code = self.proc.exitcode if died else None
            pid = self.proc.pid if died else None
            if died:
                self.restarts += 1
            loaded = self.game
            self._start()
            if died and cmd != "reset":  # the engine died between calls: its game is gone with it
                self.game = None
                raise EnvWorkerError(f"environment worker {pid} died (exit code {code}) before {what} (game {loaded}); replaced")
        pid = self.proc.pid
        try:
            self.conn.send((cmd, args))
            if not self.conn.poll(timeout):
                self._kill()
                self.restarts += 1
                raise EnvWorkerError(f"environment worker {pid} hung for over {timeout:.0f}s on {what}; replaced")
            status, result = self.conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError):
            code = None
            if self.proc is not None:
                self.proc.join(2)
                code = self.proc.exitcode
            self._kill()
            self.restarts += 1
            raise EnvWorkerError(f"environment worker {pid} died (exit code {code}) on {what}; replaced") from None
        if status == "err":
            raise EvoError(f"{what}: {result}")
        return result

    def reset(self, gamefile: str, seed: int = 0) -> EnvStep:
        self.game = gamefile
        return self._call("reset", (gamefile, seed), self.reset_timeout, f"reset of {gamefile}")

    def step(self, action: str) -> EnvStep:
        return self._call("step", (action,), self.step_timeout, f"step {action!r} in {self.game}")

    def close(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send(("close", ()))
                self.proc.join(5)
            except (BrokenPipeError, OSError):
                pass
        self._kill()


class EnvPool:
    """N workers; ``map`` runs one job per worker at a time from the parent's threads."""

    def __init__(self, n_workers: int = 2, step_timeout: float = 30.0, reset_timeout: float = 180.0, expert: bool = True, speedups: bool = True):
        if n_workers < 1:
            raise EvoError(f"n_workers must be at least 1, got {n_workers}")
        self.workers = [EnvWorker(step_timeout, reset_timeout, expert, speedups) for _ in range(n_workers)]

    def __enter__(self) -> "EnvPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def map(self, fn: Callable[[EnvWorker, T], R], jobs: Iterable[T], on_result: Callable[[T, R], None] | None = None,
            around: Callable[[int], ContextManager] | None = None) -> list[R]:
        """Run ``fn(worker, job)`` for every job; results in job order. ``fn`` must not raise
        for per-job failures (it records them); anything it raises stops the batch.

        The jobs are dealt out in a fixed order: thread t plays jobs t, t+T, t+2T, ... on worker t, so
        which episodes run side by side never depends on timing. ``around(t)`` wraps thread t's whole
        run (a decoder's lockstep session, ``policies.batched``)."""
        jobs = list(jobs)
        _ensure_server()  # before any episode: an unpinned server stops the batch in one line
        lock = threading.Lock()
        n = min(len(self.workers), len(jobs))
        results: list = [None] * len(jobs)

        def run(t: int) -> None:
            w = self.workers[t]
            with around(t) if around is not None else nullcontext():
                for i in range(t, len(jobs), n):
                    results[i] = fn(w, jobs[i])
                    if on_result is not None:
                        with lock:
                            on_result(jobs[i], results[i])

        if n == 0:
            return []
        with ThreadPoolExecutor(max_workers=n) as ex:
            for f in [ex.submit(run, t) for t in range(n)]:
                f.result()
        return results

    @property
    def restarts(self) -> int:
        return sum(w.restarts for w in self.workers)

    def close(self) -> None:
        for w in self.workers:
            w.close()
