"""The evaluation commands: one policy on a split, the baselines stage, the evaluate stage (``compare``) and the
ablation table."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from evoharness.cli.app import PARAMS, app, episode_cfg, progress_bar, selected_profile, write_json
from evoharness.core.errors import EvoError


@app.command()
def evaluate(
    games_root: Path = typer.Option(Path("data/games"), "--games"),
    split: str = typer.Option("valid_seen", help="valid_seen | valid_unseen | train"),
    policy: str = typer.Option("teacher"),
    mode: Optional[str] = typer.Option(None),
    charge_meta_actions: Optional[bool] = typer.Option(None, "--charge-meta-actions/--free-meta-actions"),
    bank: Optional[Path] = typer.Option(None, help="experience bank JSON (frozen during evaluation)"),
    out: Optional[Path] = typer.Option(None, help="output folder (default data/eval/<policy>-<mode>-<split>)"),
    seeds: Optional[str] = typer.Option(None, help="comma-separated seeds (params eval.seeds)"),
    params: str = PARAMS,
):
    """Evaluate a policy on every game of a split, once per seed (resumable)."""
    from evoharness.agent.alfworld.games import list_games
    from evoharness.agent.evaluate import evaluate as run_eval
    from evoharness.agent.evaluate import format_table
    from evoharness.agent.harness.experience import Experience
    from evoharness.agent.policies import parse_policy
    from evoharness.core.config import load_params

    p = load_params(params)
    spec = parse_policy(policy)
    cfg = episode_cfg(p, mode, charge_meta_actions)
    try:
        seed_list = [int(s) for s in seeds.split(",")] if seeds else list(p.eval.seeds)
    except ValueError:
        raise EvoError(f"--seeds: expected comma-separated integers, got {seeds!r}") from None
    gs = list_games(games_root, split)
    label = f"{spec.kind}-{cfg.harness.mode}-{split}"
    out = out or Path("data/eval") / label
    with progress_bar(len(gs) * len(seed_list), label) as bar:
        r = run_eval(gs, spec, cfg, seed_list, out, p.workers, Experience.load_or_seed(bank), progress=lambda rec: bar.update(1))
    typer.echo(format_table(f"{label} ({r['played']} played, {r['reused']} reused)", r["summary"]))


@app.command()
def baselines(
    games_root: Path = typer.Option(Path("data/panel"), "--games", help="the evaluation panel (stage panel)"),
    bank: Path = typer.Option(Path("data/demos/experience.json")),
    out: Path = typer.Option(Path("data/baselines")),
    metrics: Optional[Path] = typer.Option(None),
    params: str = PARAMS,
):
    """Evaluate the teacher and the baselines on valid_seen and valid_unseen."""
    from evoharness.agent.baselines import baselines as run_baselines

    res = run_baselines(params, games_root, bank, out, echo=typer.echo)
    if metrics:
        write_json(metrics, {label: {f: {"success": v["success"], "steps": v["steps"]} for f, v in s.items()} for label, s in res.items()})


@app.command()
def compare(
    games_root: Path = typer.Option(Path("data/panel"), "--games", help="the evaluation panel (stage panel)"),
    models: Path = typer.Option(Path("data/models")),
    bank: Path = typer.Option(Path("data/demos/experience.json")),
    out: Path = typer.Option(Path("data/eval")),
    metrics: Optional[Path] = typer.Option(None),
    profile: Optional[str] = typer.Option(None),
    params: str = PARAMS,
):
    """Evaluate base (inline), SFT (env_only and inline) and GRPO on valid_seen and valid_unseen."""
    from evoharness.agent.compare import compare as run_compare

    res = run_compare(params, selected_profile(params, profile), games_root, models, bank, out, echo=typer.echo)
    if metrics:
        write_json(metrics, res)


@app.command("ablation-table")
def ablation_table(
    games_root: Path = typer.Option(Path("data/panel"), "--games", help="the evaluation panel (stage panel)"),
    main_eval: Path = typer.Option(Path("data/eval"), help="the main job's evaluations (ReAct-SFT, SFT-inline, cost-aware GRPO)"),
    bank: Path = typer.Option(Path("data/demos/experience.json")),
    out: Path = typer.Option(Path("data/ablation/eval")),
    metrics: Optional[Path] = typer.Option(None),
    profile: Optional[str] = typer.Option(None),
    params: str = PARAMS,
):
    """The paper's ablation table: evaluate the ablation models beside the main job's, on the same games."""
    from evoharness.agent.ablation import ablation as run_ablation

    res = run_ablation(params, selected_profile(params, profile), games_root, main_eval, bank, out, echo=typer.echo)
    if metrics:
        write_json(metrics, res)


@app.command()
def ablation():
    """Run the ablation stages (ablation/dvc.yaml; they read the main job's outputs, so run it first)."""
    from evoharness.ops.vcs import dvc, repo_root

    root = repo_root()
    if not (root / "ablation" / "dvc.yaml").exists():
        raise EvoError(f"{root / 'ablation' / 'dvc.yaml'} does not exist")
    typer.echo(dvc(["repro", "ablation/dvc.yaml"], root).strip().splitlines()[-1])
    typer.echo((root / "data" / "ablation" / "eval" / "table.md").read_text())
