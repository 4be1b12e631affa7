"""The library's command line (``python -m evoharness.cli``: the DVC stages' commands). Every
failure is one line: ``error: <what and where>``. The commands that start Prefect flows (``run``,
``deploy``) live above the library, in ``flows.cli``, which is what the ``evoharness`` command runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable, Optional

import typer

from evoharness import atomic
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
    metrics: Optional[Path] = typer.Option(None, help="also write kept/rejected counts here (DVC metrics)"),
    section: str = typer.Option("games", help="params section with the seed and counts: games, grpo_games (GRPO's own training games) "
                                "or panel (the evaluation panel)"),
    disjoint_from: Optional[list[Path]] = typer.Option(None, "--disjoint-from", help="another games root (repeatable): never generate a PDDL problem any of its games has"),
    seen_scenes_from: Optional[Path] = typer.Option(None, "--seen-scenes-from", help="a games root whose train scenes valid_seen draws from"),
):
    """Generate ALFWorld games for all six families (train, valid_seen, valid_unseen)."""
    from evoharness.alfworld.families import FAMILIES
    from evoharness.alfworld.generate import GenConfig, generate, panel_digest, problem_keys
    from evoharness.config import load_params

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
    bar = _bar(total, "games")
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
        _write_json(metrics, {**{split: {f: {k: v[k] for k in ("kept", "rejected", "shared_skipped") if k in v} for f, v in fams.items()}
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
    mode: Optional[str] = typer.Option(None, help="the harness the teacher acts through (params episode.harness.mode): inline | always_on | env_only"),
    metrics: Optional[Path] = typer.Option(None, help="also write success and calls per family here (DVC metrics)"),
    react: bool = typer.Option(False, "--react", help="ReAct-SFT's demos: the teacher without the harness (env_only), params demos.react_n episodes"),
    params: str = PARAMS,
):
    """Collect teacher demos on the training games (bank consolidated between batches)."""
    from evoharness.alfworld.games import list_games
    from evoharness.collect import collect as run_collect
    from evoharness.policies import PolicySpec

    from evoharness.config import load_params

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
    with _bar(nd, "demos") as bar:
        s = run_collect(list_games(games_root, "train"), spec, _episode_cfg(p, mode), nd, out, p.demos.batch_size, p.workers, p.seed, progress=lambda r: bar.update(1))
    if metrics:
        _write_json(metrics, {"demos": s["demos"], "won": s["won"], "errored": s["errored"], "bank_entries": s["bank_entries"],
                              "by_family": {f: {"success": v["success"], "steps": v["steps"], "calls": v["calls"]} for f, v in s["by_family"].items()}})
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
    with _bar(len(gs) * len(seed_list), label) as bar:
        r = run_eval(gs, spec, cfg, seed_list, out, p.workers, Experience.load_or_seed(bank), progress=lambda rec: bar.update(1))
    typer.echo(format_table(f"{label} ({r['played']} played, {r['reused']} reused)", r["summary"]))


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
    from evoharness.config import load_params
    from evoharness.data.pairs import build_pairs, kept_episodes

    p = load_params(params)
    s = build_pairs(demos, out, p.pairs.val_fraction, p.pairs.few_shot, p.pairs.imitate_detours,
                    kept_episodes(match_wins) if match_wins is not None else None)
    if metrics:
        _write_json(metrics, {k: s[k] for k in ("episodes", "kept", "dropped", "rows", "verb_share", "tokens")})
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
    from evoharness.config import load_params
    from evoharness.data.validation import gate

    p = load_params(params)
    more = {"react": (react_demos, react_pairs)} if react_demos or react_pairs else None
    res = gate(demos, pairs_dir, p.validate_.max_tokens, report, quarantine, metrics, more)
    for name, r in res.items():
        typer.echo(f"{name}: {r['rows']} rows, {r['expectations']} expectations, all passed")


@app.command()
def baselines(
    games_root: Path = typer.Option(Path("data/panel"), "--games", help="the evaluation panel (stage panel)"),
    bank: Path = typer.Option(Path("data/demos/experience.json")),
    out: Path = typer.Option(Path("data/baselines")),
    metrics: Optional[Path] = typer.Option(None),
    params: str = PARAMS,
):
    """Evaluate the teacher and the baselines on valid_seen and valid_unseen."""
    from evoharness.pipeline import baselines as run_baselines

    res = run_baselines(params, games_root, bank, out, echo=typer.echo)
    if metrics:
        _write_json(metrics, {label: {f: {"success": v["success"], "steps": v["steps"]} for f, v in s.items()} for label, s in res.items()})


@app.command()
def lineage(target: str = typer.Argument(..., help="an output path (data/pairs) or its DVC md5 hash")):
    """Which stage, params and inputs produced an artifact."""
    from evoharness.lineage import lineage as run_lineage

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
    from evoharness.reproduce import METRIC_TOLERANCE
    from evoharness.reproduce import reproduce as run_reproduce

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
    from evoharness.lineage import repo_root
    from evoharness.lineage import unlock as run_unlock

    pids = run_unlock(repo_root())
    typer.echo(f"cleared lock entries of dead processes: {pids or 'none'}")


@app.command()
def remote(url: Optional[str] = typer.Option(None, help="set the default remote's URL (local path, s3://, gs://, ssh://)")):
    """Show or set the default DVC remote (a local folder unless configured)."""
    from evoharness.lineage import dvc, ensure_remote, repo_root

    root = repo_root()
    name = ensure_remote(root, url)
    from evoharness.secrets import redact

    typer.echo(f"default remote: {name} -> {redact(dvc(['remote', 'list'], root).strip())}")


def _profile(params: str, name: Optional[str]):
    from evoharness.config import load_params
    from evoharness.training.profiles import load_profile

    return load_profile(name or load_params(params).profile, params)


def _relaunch(profile, argv: list[str], models: dict[str, Path]) -> bool:
    """Re-run this command under accelerate for a distributed profile; True if it did. The launch,
    the machine and the stage's input models are checked first (one line each), before any process
    starts."""
    import subprocess

    from evoharness.training.checkpoint import check_checkpoint, resolve_checkpoint
    from evoharness.training.distributed import launch_argv, launch_env

    cmd = launch_argv(profile, argv, Path.cwd())
    if cmd is None:
        return False
    for what, path in models.items():
        check_checkpoint(resolve_checkpoint(path), what)
    r = subprocess.run(cmd, env=launch_env(profile))
    if r.returncode:
        raise EvoError(f"accelerate launch of `{' '.join(argv[:1])}` on profile {profile.name} ({profile.num_processes} processes) exited with {r.returncode}")
    return True


def _main_echo(line: str) -> None:
    """One line from the stage, not one per launched process."""
    import os

    if os.environ.get("RANK", "0") == "0":
        typer.echo(line)


def _finish_process(metrics_path: Optional[Path], metrics: dict) -> None:
    """The main process writes the stage's metrics; every launched process then leaves the group."""
    from evoharness.training import distributed as dist

    if metrics_path and dist.is_main():
        _write_json(metrics_path, metrics)
    dist.finish()


@app.command("base-model")
def base_model(
    out: Path = typer.Option(Path("data/models/base")),
    demos: Path = typer.Option(Path("data/demos/demos.jsonl")),
    profile: Optional[str] = typer.Option(None, help="profile name (params profile)"),
    timing: Optional[Path] = typer.Option(None, help="wall-clock figures of pretraining (kept out of the hashed output)"),
    tokenizer: str = typer.Option("word", help="tiny: word (the tags are tokens) | byte-bpe (like Qwen3's: <action> takes "
                                  "several tokens; the toy GPU profile's base folder)"),
    heads: Optional[int] = typer.Option(None, help="tiny: attention heads instead of the profile's (tiny-dist's base: 3, so that "
                                        "head_dim is 32, which vLLM's CPU attention takes; it refuses 16 and 24)"),
    kv_heads: Optional[int] = typer.Option(None, help="tiny: key/value heads instead of the profile's"),
    params: str = PARAMS,
):
    """Make the profile's base model: tiny (built from a config, seeded) or a pretrained path."""
    from evoharness.config import load_params

    prof = _profile(params, profile)
    seed = load_params(params).seed
    if prof.base.kind == "tiny":
        from evoharness.training.tiny import make_tiny_base

        cfg = prof.base.model_dump()
        cfg.update({k: v for k, v in (("heads", heads), ("kv_heads", kv_heads)) if v is not None})
        if cfg["hidden_size"] % cfg["heads"] or cfg["heads"] % cfg["kv_heads"]:
            raise EvoError(f"base model: hidden_size {cfg['hidden_size']}, heads {cfg['heads']} and kv_heads {cfg['kv_heads']} do not "
                           "divide (hidden_size by heads, heads by kv_heads)")
        info = make_tiny_base(demos, out, cfg, seed, timing, tokenizer)
        typer.echo(f"tiny base: {info['parameters']:,} parameters, vocabulary {info['vocab_size']}")
        return
    from evoharness.training.checkpoint import check_checkpoint, write_pointer
    from evoharness.training.profiles import resolve_model_path

    src = resolve_model_path(prof.base.path)
    if not src.is_dir():
        raise EvoError(f"profile {prof.name}: base model {prof.base.path} ({src}) does not exist on this machine; put the checkpoint there "
                       f"(e.g. `hf download Qwen/Qwen3-8B --local-dir {prof.base.path}`) or set profiles.{prof.name}.base.path")
    check_checkpoint(src, f"profile {prof.name}: base model")
    doc = write_pointer(out, src, prof.base.path)
    typer.echo(f"base: {prof.base.path} ({src}, weights {doc['weights']}); pointer in {out}")


@app.command()
def sft(
    pairs_dir: Path = typer.Option(Path("data/pairs"), "--pairs"),
    base: Path = typer.Option(Path("data/models/base")),
    out: Path = typer.Option(Path("data/models/sft-inline")),
    mode: str = typer.Option("inline", help="inline (pairs as collected) | env_only (the same demos without the harness)"),
    metrics: Optional[Path] = typer.Option(None),
    checkpoints: Optional[Path] = typer.Option(None, help="checkpoint folder kept across kills (default: beside --out)"),
    timing: Optional[Path] = typer.Option(None, help="wall-clock figures (kept out of hashed outputs)"),
    profile: Optional[str] = typer.Option(None),
    max_steps: Optional[int] = typer.Option(None),
    params: str = PARAMS,
):
    """Supervised fine-tuning with TRL SFTTrainer (loss on the response only; resumes from checkpoints)."""
    import sys as _sys

    from evoharness.config import load_params
    from evoharness.training.sft import train_sft

    prof = _profile(params, profile)
    if _relaunch(prof, _sys.argv[1:], {"sft: base model": base}):
        return
    m = train_sft(pairs_dir, base, out, prof, mode, load_params(params).seed, max_steps, checkpoints, timing)
    _finish_process(metrics, m)
    _main_echo(f"sft ({mode}): {m['steps']} steps, train loss {m['train_loss']}, eval loss {m['eval_loss']}, {m['launch']}")


@app.command()
def grpo(
    games_root: Path = typer.Option(Path("data/games"), "--games"),
    sft_dir: Path = typer.Option(Path("data/models/sft-inline"), "--sft"),
    bank: Optional[Path] = typer.Option(Path("data/demos/experience.json")),
    out: Path = typer.Option(Path("data/models/grpo")),
    metrics: Optional[Path] = typer.Option(None),
    curve: Optional[Path] = typer.Option(None, help="per-update curve JSONL (DVC plot)"),
    checkpoints: Optional[Path] = typer.Option(None),
    timing: Optional[Path] = typer.Option(None),
    profile: Optional[str] = typer.Option(None),
    steps: Optional[int] = typer.Option(None),
    mode: str = typer.Option("inline", help="the harness the rollouts act through: inline | env_only (plain GRPO)"),
    without: str = typer.Option("", help="harness modules switched off, comma-separated: belief, progress, experience (ablations)"),
    reward: str = typer.Option("cost-aware", help="cost-aware (the paper's composite reward) | success (10 for a win, nothing else)"),
    seed: Optional[int] = typer.Option(None, help="override params seed (bench/grpo_seeds.py trains one model per seed)"),
    params: str = PARAMS,
):
    """Cost-aware GRPO with TRL GRPOTrainer: groups of rollouts of one game on the real engine."""
    import sys as _sys

    from evoharness.config import load_params
    from evoharness.harness.workspace import HarnessConfig

    prof = _profile(params, profile)
    if _relaunch(prof, _sys.argv[1:], {"grpo: SFT model": sft_dir}):
        return
    from evoharness.training.grpo import train_grpo

    p = load_params(params)
    off = [w.strip() for w in without.split(",") if w.strip()]
    bad = [w for w in off if w not in ("belief", "progress", "experience")]
    if bad or mode not in ("inline", "env_only") or reward not in ("cost-aware", "success"):
        raise EvoError(f"grpo: --mode {mode!r}, --without {without!r}, --reward {reward!r}: expected inline|env_only, belief/progress/experience, cost-aware|success")
    harness = HarnessConfig(mode=mode, **{w: False for w in off})
    rc = p.episode.reward.model_copy(update={"updates": steps or prof.grpo.steps})
    if reward == "success":
        rc = rc.model_copy(update={"eff": 0.0, "div_max": 0.0, "spam": 0.0, "inv": 0.0})
    r = train_grpo(games_root, sft_dir, bank if mode != "env_only" else None, out, prof, rc, p.seed if seed is None else seed, p.workers, steps,
                   checkpoints, curve, timing,
                   harness=harness, consolidator=p.consolidator.endpoint)
    _finish_process(metrics, r)
    last = r["last"] or {}
    _main_echo(f"grpo: {r['steps']} updates, {r['episodes']} episodes; last step success {last.get('success')} calls {last.get('calls_per_episode')}")


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
    from evoharness.compare import compare as run_compare

    res = run_compare(params, _profile(params, profile), games_root, models, bank, out, echo=typer.echo)
    if metrics:
        _write_json(metrics, res)


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
    from evoharness.ablation import ablation as run_ablation

    res = run_ablation(params, _profile(params, profile), games_root, main_eval, bank, out, echo=typer.echo)
    if metrics:
        _write_json(metrics, res)


@app.command()
def ablation():
    """Run the ablation stages (ablation/dvc.yaml; they read the main job's outputs, so run it first)."""
    from evoharness.lineage import dvc, repo_root

    root = repo_root()
    if not (root / "ablation" / "dvc.yaml").exists():
        raise EvoError(f"{root / 'ablation' / 'dvc.yaml'} does not exist")
    typer.echo(dvc(["repro", "ablation/dvc.yaml"], root).strip().splitlines()[-1])
    typer.echo((root / "data" / "ablation" / "eval" / "table.md").read_text())


def _write_json(path: Path, data) -> None:
    atomic.write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


@app.command()
def promotions(
    model: Optional[str] = typer.Option(None, help="registered model name prefix (default: promotion.model_name)"),
    params: str = PARAMS,
    limit: int = typer.Option(20, help="newest decisions shown"),
):
    """Every promotion decision (newest first) with its checks' outcome and reasons."""
    import yaml

    from evoharness import promotion, tracking
    from evoharness.config import load_params
    from evoharness.secrets import redact

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


if __name__ == "__main__":
    main()
