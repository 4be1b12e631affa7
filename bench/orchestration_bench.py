"""Orchestration overhead: the same pipeline run bare (`dvc repro` + `dvc push`) and as the
`retrain` flow (Prefect + DVC + MLflow, the README's main command), on two fresh copies of the
project with identical parameters; then a no-op retrain (nothing changed).

    .venv/bin/python bench/orchestration_bench.py [--size small|micro] [--prefect ephemeral|server]

`ephemeral` is what the main command does with no PREFECT_API_URL (Prefect starts a local server
for the run; its home, created and migrated once per machine, is prepared before timing and that
one-off cost printed on its own row); `server` uses a Prefect server started once by the bench,
as a scheduled deployment would. Targets: orchestrated at most 1.10x bare; no-op at most 30 s.
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from project import MICRO, make_project  # noqa: E402

SMALL = copy.deepcopy(MICRO)
SMALL["games"]["per_family"] = {"train": 2, "valid_seen": 2, "valid_unseen": 2}
SMALL["demos"] = {"n": 12, "noise": 0.2, "batch_size": 12}
SMALL["profiles"]["tiny-cpu"].update(
    base={"kind": "tiny", "hidden_size": 64, "intermediate_size": 128, "layers": 2, "heads": 4, "kv_heads": 2, "max_length": 1024},
    sft={"batch_size": 8, "epochs": 2, "save_steps": 20, "eval_steps": 20, "max_length": 1024},
    grpo={"games_per_step": 2, "rollouts": 2, "turns_per_rollout": 2, "steps": 2, "learning_rate": 0.0005, "max_new_tokens": 24,
          "max_steps_per_episode": 10, "save_steps": 1},
    eval_games_per_family=2, eval_max_steps=10)


def timed(cmd: list[str], cwd: Path, env: dict) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed in {cwd}:\n{(r.stderr or r.stdout)[-3000:]}")
    return time.perf_counter() - t0


def stage_seconds(repo: Path) -> float:
    """The stages' own time in the newest retrain (each child run's `stage_seconds`: the
    `dvc repro --single-item` call), so the flow's overhead is also measured within one run,
    free of the run-to-run noise of training on 2 cores."""
    from mlflow import MlflowClient

    from evoharness.ops import tracking

    c = MlflowClient(tracking_uri=f"sqlite:///{repo / tracking.DB_NAME}")  # the store the bench's runs used
    exp = c.get_experiment_by_name(tracking.EXPERIMENT)
    parent = c.search_runs([exp.experiment_id], "tags.kind = 'retrain'", order_by=["attributes.start_time DESC"], max_results=1)[0]
    children = c.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    return sum(r.data.metrics.get("stage_seconds", 0.0) for r in children)


def start_server(home: Path) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/api"
    env = dict(os.environ, PREFECT_HOME=str(home), PREFECT_API_URL=url, PREFECT_UI_ENABLED="false")
    proc = subprocess.Popen([str(Path(sys.executable).parent / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    for _ in range(240):
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return proc, url
        except OSError:
            time.sleep(0.5)
    raise SystemExit("Prefect server did not start")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=["small", "micro"], default="small")
    ap.add_argument("--prefect", choices=["ephemeral", "server"], default="ephemeral")
    args = ap.parse_args()
    params = SMALL if args.size == "small" else MICRO
    tmp = Path(tempfile.mkdtemp(prefix="orch-bench-"))
    # dvc.yaml's commands call `python`: the interpreter running the bench, venv activated or not.
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PREFECT_HOME=str(tmp / "prefect-home"),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("MLFLOW_TRACKING_URI", None)
    env.pop("PREFECT_API_URL", None)
    server = None
    if args.prefect == "server":
        server, url = start_server(tmp / "prefect-home")
        env["PREFECT_API_URL"] = url
    py = sys.executable
    t_home = None
    if args.prefect == "ephemeral":
        # A Prefect home is created and migrated once per machine (~/.prefect), not per retrain:
        # do it before timing, and report it on its own row.
        t_home = timed([py, "-c", "from prefect.client.orchestration import get_client\n"
                                  "with get_client(sync_client=True) as c: c.api_healthcheck()"], tmp, env)
    try:
        bare = make_project(tmp / "bare", params)
        orch = make_project(tmp / "orch", params)
        t_bare = timed([py, "-m", "dvc", "repro"], bare, env) + timed([py, "-m", "dvc", "push"], bare, env)
        t_orch = timed([py, "-m", "flows.cli", "run"], orch, env)
        t_stages = stage_seconds(orch)
        t_noop = min(timed([py, "-m", "flows.cli", "run"], orch, env) for _ in range(2))
        t_bare_noop = timed([py, "-m", "dvc", "repro"], bare, env)
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGTERM)
    rows = [
        ("bare: dvc repro + dvc push", t_bare, 1.0),
        (f"retrain flow (Prefect {args.prefect} + DVC + MLflow + gate)", t_orch, t_orch / t_bare),
        ("  its stages' own `dvc repro --single-item` time", t_stages, None),
        ("  flow vs its stages' own time (same run; push = overhead)", t_orch, t_orch / t_stages),
        ("bare no-op: dvc repro", t_bare_noop, None),
        (f"no-op retrain flow (best of 2, Prefect {args.prefect})", t_noop, None),
    ]
    if t_home is not None:
        rows.append(("once per machine: a fresh Prefect home's database migrated", t_home, None))
    print(f"\norchestration overhead, {args.size} parameters, 2 cores\n")
    print(f"| {'run':<58} | {'seconds':>8} | {'ratio':>7} |")
    print(f"|{'-' * 60}|{'-' * 10}|{'-' * 9}|")
    for name, t, ratio in rows:
        print(f"| {name:<58} | {t:8.1f} | {f'{ratio:.3f}x' if ratio else '':>7} |")
    print(f"\ntargets: orchestrated <= 1.10x bare ({'met' if t_orch / t_bare <= 1.10 else 'NOT met'}; "
          f"{'met' if t_orch / t_stages <= 1.10 else 'NOT met'} within the run); no-op <= 30 s ({'met' if t_noop <= 30 else 'NOT met'})")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
