"""The operations commands: lineage of an artifact, reproduce a retrain, clear stale DVC locks, the DVC remote, and
the promotion decisions."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from evoharness.cli.app import PARAMS, app
from evoharness.core.errors import EvoError


@app.command()
def lineage(target: str = typer.Argument(..., help="an output path (data/pairs) or its DVC md5 hash")):
    """Which stage, params and inputs produced an artifact."""
    from evoharness.ops.lineage import lineage as run_lineage

    run_lineage(target, Path.cwd(), echo=typer.echo)


@app.command()
def reproduce(
    ref: str = typer.Argument(..., help="a retrain's MLflow run id (its git record retrain/<id>), a git ref or commit, or a DVC output hash"),
    keep: bool = typer.Option(False, help="keep the scratch worktree"),
    setup: bool = typer.Option(True, "--setup/--no-setup", help="build the record's environment when this one differs from its "
                               "constraints.txt (else refuse)"),
    stage: list[str] = typer.Option(None, "--stage", help="re-run only this recorded stage (repeatable); default: every stage"),
):
    """Re-run every stage of a recorded run on its recorded inputs and compare every output's hash."""
    from evoharness.ops.reproduce import METRIC_TOLERANCE
    from evoharness.ops.reproduce import reproduce as run_reproduce

    rows = run_reproduce(ref, Path.cwd(), echo=typer.echo, keep=keep, setup=setup, stages=stage or None)
    bad = [r for r in rows if not r["match"] and (r.get("metric_diff") is None or r["metric_diff"] > METRIC_TOLERANCE)]
    if bad:
        raise EvoError(f"{len(bad)} of {len(rows)} outputs did not reproduce: " + ", ".join(f"{r['stage']}:{r['path']}" for r in bad))
    same = sum(r["match"] for r in rows)
    typer.echo(f"{same} of {len(rows)} outputs reproduced with identical hashes" + ("" if same == len(rows) else
               f"; the other metrics agree within {METRIC_TOLERANCE}"))


@app.command()
def unlock():
    """Clear DVC lock entries left by processes that died (live ones are kept)."""
    from evoharness.ops.vcs import repo_root
    from evoharness.ops.vcs import unlock as run_unlock

    pids = run_unlock(repo_root())
    typer.echo(f"cleared lock entries of dead processes: {pids or 'none'}")


@app.command()
def remote(url: Optional[str] = typer.Option(None, help="set the default remote's URL (local path, s3://, gs://, ssh://)")):
    """Show or set the default DVC remote (a local folder unless configured)."""
    from evoharness.ops.remote import ensure_remote
    from evoharness.ops.vcs import dvc, repo_root

    root = repo_root()
    name = ensure_remote(root, url)
    from evoharness.core.secrets import redact

    typer.echo(f"default remote: {name} -> {redact(dvc(['remote', 'list'], root).strip())}")


@app.command()
def promotions(
    model: Optional[str] = typer.Option(None, help="registered model name prefix (default: promotion.model_name)"),
    params: str = PARAMS,
    limit: int = typer.Option(20, help="newest decisions shown"),
):
    """Every promotion decision (newest first) with its checks' outcome and reasons."""
    import yaml

    from evoharness.core.config import load_params
    from evoharness.core.secrets import redact
    from evoharness.ops import promotion, tracking

    if limit < 1:
        raise EvoError(f"promotions: --limit must be at least 1 (got {limit})")
    load_params(params)  # a params file that is not one: one line
    raw = (yaml.safe_load(Path(params).read_text()) or {}).get("promotion", {}) if Path(params).exists() else {}
    prefix = model or raw.get("model_name", "evoharness-agent")
    promotion.check_model_name(prefix)
    rows = promotion.promotions(tracking.client(Path.cwd()), prefix)
    if not rows:
        typer.echo(f"no registered versions of {prefix}* in {redact(tracking.tracking_uri(Path.cwd()))}")
        return
    typer.echo(f"{'model':<32} {'ver':>4} {'decision':<9} {'seen':>6} {'unseen':>6} {'aliases':<20} reasons")
    for r in rows[:limit]:
        typer.echo(f"{r['model']:<32} {r['version']:>4} {r['decision']:<9} {r['seen']:>6} {r['unseen']:>6} {r['aliases']:<20} {r['reasons']}")
