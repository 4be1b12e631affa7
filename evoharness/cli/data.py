"""The data commands: generate games (``games``), play one (``play``), the teacher's demos (``collect``), SFT pairs
(``pairs``) and the Great Expectations gate (``validate``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from evoharness.cli.app import PARAMS, app, episode_cfg, progress_bar, write_json
from evoharness.core.errors import EvoError


@app.command()
def games(
    out: Path = typer.Option(Path("data/games"), help="output root (official layout under it)"),
    params: str = PARAMS,
    seed: Optional[int] = typer.Option(None, help="override params seed"),
    metrics: Optional[Path] = typer.Option(None, help="also write kept/rejected counts here (DVC metrics)"),
    section: str = typer.Option("games", help="params section with the seed and counts: games, grpo_games (GRPO's own training games) "
                                "or panel (the evaluation panel)"),
    disjoint_from: Optional[list[Path]] = typer.Option(None, "--disjoint-from", help="another games root (repeatable): never generate a PDDL problem any of its games has"),
    seen_scenes_from: Optional[Path] = typer.Option(None, "--seen-scenes-from", help="a games root whose train scenes valid_seen draws from"),
):
    """Generate ALFWorld games for all six families (train, valid_seen, valid_unseen)."""
    from evoharness.agent.alfworld.families import FAMILIES
    from evoharness.agent.alfworld.generate import GenConfig, generate, panel_digest, problem_keys
    from evoharness.core.config import load_params

    p = load_params(params)
    g = p.games
    if section not in ("games", "grpo_games", "panel"):
        raise EvoError(f"--section: unknown section {section!r} (known: games, grpo_games, panel)")
    counts = dict(g.per_family if section == "games" else p.grpo_games.per_family if section == "grpo_games" else {})
    by_family = {split: dict(f) for split, f in p.panel.per_family.items()} if section == "panel" else None
    base_seed = {"games": p.seed, "grpo_games": p.grpo_games.seed, "panel": p.panel.seed}[section]
    avoid: set[str] = set()
    for other in disjoint_from or []:
        if other.resolve() == out.resolve():
            raise EvoError(f"--disjoint-from {other}: is the output root itself (it is regenerated)")
        avoid |= set(problem_keys(other))
    seen = None
    if seen_scenes_from is not None:
        try:
            trained = json.loads((seen_scenes_from / "summary.json").read_text())["splits"]["train"]
        except (OSError, ValueError, KeyError) as e:
            raise EvoError(f"--seen-scenes-from {seen_scenes_from}: no train split in its summary.json ({type(e).__name__})") from None
        seen = {fam: list(trained.get(label, {}).get("scenes", [])) for fam, label in FAMILIES.items()}
    cfg = GenConfig(
        seed=base_seed if seed is None else seed,
        per_family=counts,
        families=list(g.families),
        unseen_scenes=tuple(g.unseen_scenes),
        max_per_type=g.max_per_type,
        distractors=g.distractors,
        max_expert_steps=g.max_expert_steps,
        workers=p.workers,
        avoid=frozenset(avoid),
        counts=by_family,
        seen_scenes=seen,
    )
    total = sum(sum(f.values()) for f in by_family.values()) if by_family else sum(counts.values()) * len(g.families)
    bar = progress_bar(total, "games")
    state = {}

    def progress(split, fam, kept, n):
        key = (split, fam)
        bar.update(kept - state.get(key, 0))
        state[key] = kept

    with bar:  # closed (its line ended) before an error line is written
        summary = generate(out, cfg, progress)
    made = {split for split in summary["splits"]}
    if section == "panel":
        digest = panel_digest(out)
        summary["digest"] = digest
        if p.panel.digest and digest != p.panel.digest:
            raise EvoError(f"panel: the games generated in {out} have digest {digest}, but params panel.digest pins {p.panel.digest}: "
                           "the generator (or its settings) changed, so this would be another panel; restore them, or pin a new panel knowingly")
        typer.echo(f"panel digest {digest}" + ("" if p.panel.digest else " (not pinned: set params panel.digest to freeze it)"))
    if metrics:
        write_json(metrics, {**{split: {f: {k: v[k] for k in ("kept", "rejected", "shared_skipped") if k in v} for f, v in fams.items()}
                                     for split, fams in summary["splits"].items() if split in made},
                              **({"digest": summary["digest"]} if "digest" in summary else {})})
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
    from evoharness.agent.alfworld.games import Game, _read_game
    from evoharness.agent.envpool import EnvWorker
    from evoharness.agent.episode import run_episode
    from evoharness.agent.harness.experience import Experience
    from evoharness.agent.policies import make_policy, parse_policy
    from evoharness.core.config import load_params

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
        traj = run_episode(w, g, make_policy(spec), episode_cfg(p, mode), Experience.load_or_seed(bank), seed)
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
    mode: Optional[str] = typer.Option(None, help="the harness the teacher acts through (params episode.harness.mode): inline | always_on | env_only"),
    metrics: Optional[Path] = typer.Option(None, help="also write success and calls per family here (DVC metrics)"),
    react: bool = typer.Option(False, "--react", help="ReAct-SFT's demos: the teacher without the harness (env_only), params demos.react_n episodes"),
    params: str = PARAMS,
):
    """Collect teacher demos on the training games (bank consolidated between batches)."""
    from evoharness.agent.alfworld.games import list_games
    from evoharness.agent.collect import collect as run_collect
    from evoharness.agent.policies import PolicySpec
    from evoharness.core.config import load_params

    p = load_params(params)
    if react:
        if mode not in (None, "env_only"):
            raise EvoError(f"collect --react: the ReAct teacher acts without the harness (env_only), not {mode!r}")
        mode = "env_only"
    nd = p.demos.n if n is None else n
    if react and n is None:
        nd = p.demos.react_n or -(-p.demos.n * 5 // 4)
    if nd < 1:
        raise EvoError(f"collect: the number of demos must be at least 1 (got {nd} from {'--n' if n is not None else params + ': demos.n'}); nothing was written")
    spec = PolicySpec(kind="teacher", noise=p.demos.noise if noise is None else noise)
    with progress_bar(nd, "demos") as bar:
        s = run_collect(list_games(games_root, "train"), spec, episode_cfg(p, mode), nd, out, p.demos.batch_size, p.workers, p.seed, progress=lambda r: bar.update(1))
    if metrics:
        write_json(metrics, {"demos": s["demos"], "won": s["won"], "errored": s["errored"], "bank_entries": s["bank_entries"],
                              "by_family": {f: {"success": v["success"], "steps": v["steps"], "calls": v["calls"]} for f, v in s["by_family"].items()}})
    typer.echo(f"demos: {s['demos']}  won: {s['won']}  errored: {s['errored']}  bank: {s['bank_entries']} entries after {s['bank_updates']} updates")


@app.command()
def pairs(
    demos: Path = typer.Option(Path("data/demos/demos.jsonl")),
    out: Path = typer.Option(Path("data/pairs")),
    metrics: Optional[Path] = typer.Option(None),
    plots: Optional[Path] = typer.Option(None, help="CSV of token lengths per row (DVC plots)"),
    match_wins: Optional[Path] = typer.Option(None, "--match-wins", help="another demos file: keep as many successful episodes as it has"),
    params: str = PARAMS,
):
    """Build SFT pairs (Parquet, train/val by episode) from teacher demos."""
    from evoharness.agent.pairs import build_pairs, kept_episodes
    from evoharness.core.config import load_params

    p = load_params(params)
    s = build_pairs(demos, out, p.pairs.val_fraction, p.pairs.few_shot, p.pairs.imitate_detours,
                    kept_episodes(match_wins) if match_wins is not None else None)
    if metrics:
        write_json(metrics, {k: s[k] for k in ("episodes", "kept", "dropped", "rows", "verb_share", "tokens")})
    if plots:
        import pandas as pd

        frames = [pd.read_parquet(out / f"{sp}.parquet", columns=["split", "family", "kind", "prompt_tokens", "response_tokens"]) for sp in ("train", "val")]
        Path(plots).parent.mkdir(parents=True, exist_ok=True)
        pd.concat(frames).to_csv(plots, index=False)
    typer.echo(f"pairs: {s['rows']['train']} train / {s['rows']['val']} val rows from {s['kept']} of {s['episodes']} episodes (dropped: {s['dropped'] or 'none'})")


@app.command()
def validate(
    demos: Optional[Path] = typer.Option(Path("data/demos/demos.jsonl"), help="trajectories JSONL to validate"),
    pairs_dir: Optional[Path] = typer.Option(Path("data/pairs"), "--pairs", help="SFT pairs folder to validate"),
    report: Path = typer.Option(Path("data/validation"), help="report folder (JSON + GX data docs)"),
    quarantine: Path = typer.Option(Path("data/quarantine"), help="where failing files are moved"),
    metrics: Optional[Path] = typer.Option(None),
    react_demos: Optional[Path] = typer.Option(None, "--react-demos", help="the env_only teacher's demos (ReAct-SFT's data)"),
    react_pairs: Optional[Path] = typer.Option(None, "--react-pairs", help="ReAct-SFT's pairs folder"),
    params: str = PARAMS,
):
    """The Great Expectations gate on trajectories and SFT pairs; failing files are quarantined."""
    from evoharness.core.config import load_params
    from evoharness.ops.validation import gate

    p = load_params(params)
    more = {"react": (react_demos, react_pairs)} if react_demos or react_pairs else None
    res = gate(demos, pairs_dir, p.validate_.max_tokens, report, quarantine, metrics, more)
    for name, r in res.items():
        typer.echo(f"{name}: {r['rows']} rows, {r['expectations']} expectations, all passed")
