"""The ``evoharness`` command: the library's commands (``evoharness.cli``) and, above both the library
and the flows, the ones that start Prefect flows: ``run`` (the retrain) and ``deploy``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from evoharness.cli import PARAMS, app
from evoharness.cli import main as _main


@app.command()
def run(
    params: str = PARAMS,
    pool: Optional[str] = typer.Option(None, help="work pool for the stages params' pool.stages names (the model stages) via its "
                                       "train-stage deployment; default: in-process"),
):
    """The main job: the `retrain` Prefect flow end to end (data, GX gate, SFT, GRPO, evaluation,
    promotion), tracked in MLflow; DVC reuses every stage whose inputs did not change."""
    # Ephemeral mode starts a local server (migrating a fresh database first): on 2 busy cores that
    # can take longer than Prefect's 20 s default. Set before Prefect reads its settings.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # no internet here; its failures are noise
    from evoharness.ops.preflight import check_git, writable_dir
    from evoharness.ops.report import print_results
    from evoharness.ops.vcs import repo_root
    from flows.common import check_prefect

    check_git()
    root = repo_root(Path.cwd())
    if Path(params).resolve() != (root / "params.yaml").resolve():  # before any server starts (the flow's preflight says the same)
        from evoharness.core.errors import EvoError

        raise EvoError(f"--params {params}: the stages read {root / 'params.yaml'} (dvc.yaml) and the git record commits it; "
                       "put these settings in params.yaml (DVC reruns the stages they change)")
    api = check_prefect(required=bool(pool))  # a pool's workers reach the same server: ephemeral mode cannot dispatch
    home = os.environ.get("PREFECT_HOME", "~/.prefect")
    if api is None:  # ephemeral mode keeps its database there: a fresh HOME has none yet, an unwritable one is refused here
        writable_dir(Path(home), "Prefect's home (PREFECT_HOME)")
    typer.echo(f"Prefect: {api or f'ephemeral mode (a local server for this run, database in {home})'}")
    from flows.retrain import retrain

    res = retrain(root=str(root), params="params.yaml", pool=pool)
    print_results(root, res, api, echo=typer.echo)


@app.command()
def deploy():
    """Register prefect.yaml's deployments: work pools, the retrain crons (a re-deploy keeps which are active)."""
    from evoharness.ops.vcs import repo_root
    from flows.deploy import deploy as run_deploy

    run_deploy(repo_root(Path.cwd()), echo=typer.echo)


def _drain_prefect() -> None:
    """Flush the events a failed flow left queued now, so that Prefect's exit-time drain ("Still processing
    items...") does not print after the error line."""
    import sys

    for module, name in (("prefect.events.worker", "EventsWorker"), ("prefect.logging.handlers", "APILogWorker")):
        if module in sys.modules:
            try:
                getattr(sys.modules[module], name).drain_all(timeout=30, at_exit=False)
            except Exception:  # noqa: BLE001 - best effort: the error line is what matters
                pass


def main() -> None:
    _main(before_exit=_drain_prefect)


if __name__ == "__main__":
    main()
