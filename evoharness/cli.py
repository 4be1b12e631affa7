"""The ``evoharness`` command line. Every failure is one line: ``error: <what and where>``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from evoharness.errors import EvoError

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True, help="EvoHarness Ops: ALFWorld agents that learn when to use a BPE harness.")

PARAMS = typer.Option("params.yaml", "--params", help="params file (defaults apply when params.yaml is absent)")


def _bar(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="ep", file=sys.stderr, dynamic_ncols=True, disable=total == 0)


def _episode_cfg(params, mode: Optional[str], charge: Optional[bool] = None):
    cfg = params.episode
    h = cfg.harness
    if mode is not None:
        if mode not in ("env_only", "always_on", "inline"):
            raise EvoError(f"--mode: unknown mode {mode!r} (known: env_only, always_on, inline)")
        h = h.model_copy(update={"mode": mode})
    if charge is not None:
        h = h.model_copy(update={"charge_meta_actions": charge})
    return cfg.model_copy(update={"harness": h})


@app.command()
def games(
    out: Path = typer.Option(Path("data/games"), help="output root (official layout under it)"),
    params: str = PARAMS,
    seed: Optional[int] = typer.Option(None, help="override params seed"),
):
    """Generate ALFWorld games for all six families (train, valid_seen, valid_unseen)."""
    from evoharness.alfworld.generate import GenConfig, generate
    from evoharness.config import load_params

    p = load_params(params)
    g = p.games
    cfg = GenConfig(
        seed=p.seed if seed is None else seed,
        per_family=dict(g.per_family),
        families=list(g.families),
        unseen_scenes=tuple(g.unseen_scenes),
        max_per_type=g.max_per_type,
        distractors=g.distractors,
        max_expert_steps=g.max_expert_steps,
        workers=p.workers,
    )
    total = sum(g.per_family.values()) * len(g.families)
    bar = _bar(total, "games")
    state = {}

    def progress(split, fam, kept, n):
        key = (split, fam)
        bar.update(kept - state.get(key, 0))
        state[key] = kept

    summary = generate(out, cfg, progress)
    bar.close()
    for split, fams in summary["splits"].items():
        typer.echo(f"{split:<13} " + "  ".join(f"{f}:{v['kept']}" for f, v in fams.items()))


@app.command()
def play(
    game: str = typer.Argument(..., help="game id (<split>/<task>/<trial>) under --root, or a trial folder / game.tw-pddl path"),
    policy: str = typer.Option("teacher", help="teacher | random | hf:path=... | chat:base_url=...,model=..."),
    mode: Optional[str] = typer.Option(None, help="env_only | always_on | inline"),
    root: Path = typer.Option(Path("data/games")),
    seed: int = 0,
    bank: Optional[Path] = typer.Option(None, help="experience bank JSON"),
    params: str = PARAMS,
):
    """Play one game with a policy and print the transcript."""
    from evoharness.alfworld.games import Game, _read_game
    from evoharness.config import load_params
    from evoharness.envpool import EnvWorker
    from evoharness.episode import run_episode
    from evoharness.harness.experience import Experience
    from evoharness.policies import make_policy, parse_policy

    p = load_params(params)
    path = Path(game)
    if not path.exists():
        path = root / game
    if path.is_file():
        path = path.parent
    if not (path / "traj_data.json").exists():
        raise EvoError(f"game {game!r}: no traj_data.json at {path}")
    split = path.parent.parent.name
    g = _read_game(path, path.parent.parent.parent, split) or Game(str(path), str(path / "game.tw-pddl"), split, "unknown", f"{path}: not a playable game")
    spec = parse_policy(policy)
    w = EnvWorker()
    try:
        traj = run_episode(w, g, make_policy(spec), _episode_cfg(p, mode), Experience.load_or_seed(bank), seed)
    finally:
        w.close()
    typer.echo(f"TASK: {traj.task}")
    for t in traj.turns:
        mark = "" if t.valid else "  [invalid]"
        typer.echo(f"{t.t:>3} > {t.action}{mark}\n      {t.observation}")
    if traj.error:
        raise EvoError(f"episode errored: {traj.error}")
    o = traj.outcome
    typer.echo(f"won={o['won']} steps={o['steps']} turns={o['turns']} calls={o['calls']} invalid={o['invalid']} reward={traj.reward['total']:.3f}")


@app.command()
def collect(
    games_root: Path = typer.Option(Path("data/games"), "--games"),
    out: Path = typer.Option(Path("data/demos")),
    n: Optional[int] = typer.Option(None, help="number of demos (params demos.n)"),
    noise: Optional[float] = typer.Option(None, help="teacher noise (params demos.noise)"),
    params: str = PARAMS,
):
    """Collect teacher demos on the training games (bank consolidated between batches)."""
    from evoharness.alfworld.games import list_games
    from evoharness.collect import collect as run_collect
    from evoharness.policies import PolicySpec

    from evoharness.config import load_params

    p = load_params(params)
    nd = p.demos.n if n is None else n
    spec = PolicySpec(kind="teacher", noise=p.demos.noise if noise is None else noise)
    bar = _bar(nd, "demos")
    s = run_collect(list_games(games_root, "train"), spec, p.episode, nd, out, p.demos.batch_size, p.workers, p.seed, progress=lambda r: bar.update(1))
    bar.close()
    typer.echo(f"demos: {s['demos']}  won: {s['won']}  errored: {s['errored']}  bank: {s['bank_entries']} entries after {s['bank_updates']} updates")


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
    from evoharness.alfworld.games import list_games
    from evoharness.config import load_params
    from evoharness.evaluate import evaluate as run_eval
    from evoharness.evaluate import format_table
    from evoharness.harness.experience import Experience
    from evoharness.policies import parse_policy

    p = load_params(params)
    spec = parse_policy(policy)
    cfg = _episode_cfg(p, mode, charge_meta_actions)
    try:
        seed_list = [int(s) for s in seeds.split(",")] if seeds else list(p.eval.seeds)
    except ValueError:
        raise EvoError(f"--seeds: expected comma-separated integers, got {seeds!r}") from None
    gs = list_games(games_root, split)
    label = f"{spec.kind}-{cfg.harness.mode}-{split}"
    out = out or Path("data/eval") / label
    bar = _bar(len(gs) * len(seed_list), label)
    r = run_eval(gs, spec, cfg, seed_list, out, p.workers, Experience.load_or_seed(bank), progress=lambda rec: bar.update(1))
    bar.close()
    typer.echo(format_table(f"{label} ({r['played']} played, {r['reused']} reused)", r["summary"]))


@app.command()
def run(params: str = PARAMS, data: Path = typer.Option(Path("data"), help="data root")):
    """The main job: generate games, collect teacher demos, evaluate teacher and baselines."""
    from evoharness.pipeline import foundation

    foundation(params, data, echo=typer.echo)


def main() -> None:
    try:
        app()
    except EvoError as e:
        typer.echo(f"error: {e}", err=True)
        raise SystemExit(2)
    except KeyboardInterrupt:
        typer.echo("error: interrupted (finished episodes are saved; rerun to resume)", err=True)
        raise SystemExit(130)


if __name__ == "__main__":
    main()
