"""The Typer app every command group registers on, the ``--params`` option, the helpers the groups share (the
profile, the launcher's re-launch, progress bars) and ``main``: an ``EvoError`` is one line on stderr, exit code 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, Optional

import typer

from evoharness.core import atomic
from evoharness.core.errors import EvoError

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True, help="EvoHarness Ops: ALFWorld agents that learn when to use a BPE harness.")

PARAMS = typer.Option("params.yaml", "--params", help="params file (defaults apply when params.yaml is absent)")


def progress_bar(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="ep", file=sys.stderr, dynamic_ncols=True, disable=total == 0)


def episode_cfg(params, mode: Optional[str], charge: Optional[bool] = None):
    cfg = params.episode
    h = cfg.harness
    if mode is not None:
        if mode not in ("env_only", "always_on", "inline"):
            raise EvoError(f"--mode: unknown mode {mode!r} (known: env_only, always_on, inline)")
        h = h.model_copy(update={"mode": mode})
    if charge is not None:
        h = h.model_copy(update={"charge_meta_actions": charge})
    return cfg.model_copy(update={"harness": h})


def selected_profile(params: str, name: Optional[str]):
    from evoharness.agent.training.profiles import load_profile
    from evoharness.core.config import load_params

    return load_profile(name or load_params(params).profile, params)


def relaunch(profile, argv: list[str], models: dict[str, Path]) -> bool:
    """Re-run this command under accelerate for a distributed profile; True if it did. The launch,
    the machine and the stage's input models are checked first (one line each), before any process
    starts."""
    import subprocess

    from evoharness.agent.training.checkpoint import check_checkpoint, resolve_checkpoint
    from evoharness.agent.training.distributed import launch_argv, launch_env

    cmd = launch_argv(profile, argv, Path.cwd())
    if cmd is None:
        return False
    for what, path in models.items():
        check_checkpoint(resolve_checkpoint(path), what)
    r = subprocess.run(cmd, env=launch_env(profile))
    if r.returncode:
        raise EvoError(f"accelerate launch of `{' '.join(argv[:1])}` on profile {profile.name} ({profile.num_processes} processes) exited with {r.returncode}")
    return True


def main_echo(line: str) -> None:
    """One line from the stage, not one per launched process."""
    import os

    if os.environ.get("RANK", "0") == "0":
        typer.echo(line)


def finish_process(metrics_path: Optional[Path], metrics: dict) -> None:
    """The main process writes the stage's metrics; every launched process then leaves the group."""
    from evoharness.agent.training import distributed as dist

    if metrics_path and dist.is_main():
        write_json(metrics_path, metrics)
    dist.finish()


def write_json(path: Path, data) -> None:
    atomic.write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def main(before_exit: Optional[Callable[[], None]] = None) -> None:
    """Run the app; an ``EvoError`` ends it with one line on stderr, which is its last line: ``before_exit``
    (the flows' command drains Prefect's background services with it) runs before that line is written."""
    try:
        app()
    except EvoError as e:
        if before_exit:
            before_exit()
        typer.echo(f"error: {e}", err=True)
        raise SystemExit(2)
    except KeyboardInterrupt:
        if before_exit:
            before_exit()
        typer.echo("error: interrupted (finished episodes are saved; rerun to resume)", err=True)
        raise SystemExit(130)

