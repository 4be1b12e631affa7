"""What a trained model gains over another on many fresh games: a paired evaluation beyond the main job's 60.

Generates ``--per-family`` fresh games per family for each split (valid_seen on the scenes of
``data/games``' train split, as the games stage places its valid_seen; valid_unseen on the profile's
unseen scenes), sharing no PDDL problem with ``data/games`` or ``data/grpo_games``, then evaluates every
model on them as the evaluate stage does (greedy, the profile's decoding, ``eval_max_steps`` and
``eval_max_turns``; each model with the bank given, by default the one in its folder or else the demos').
Prints one table: wins with 95 % Wilson intervals, and for each model after the first its paired
difference to the first (±1.96 paired standard errors), the games only it / only the first won, and
McNemar's exact one-sided p that it is better.

    .venv/bin/python bench/grpo_gain.py --per-family 40 --out bench/results/grpo_gain/run1 \\
        sft=data/models/sft-inline grpo=data/models/grpo [grpo72=PATH[:BANK]]

Generation takes about 2 minutes per 240 games and evaluation about 7.5 minutes per model and 240
games on 2 cores. The games and episodes go under ``--out`` (not committed).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def fresh_games(out: Path, split: str, per_family: int, seed: int) -> Path:
    from evoharness.agent.alfworld import generate as G
    from evoharness.core.config import load_params

    root = out / f"games-{split}"
    made = root / "made-with.json"  # reused only when made with the same seed and count
    want = {"seed": seed, "per_family": per_family}
    if (root / split).is_dir() and made.is_file() and json.loads(made.read_text()) == want:
        return root
    p = load_params("params.yaml")
    g = p.games
    seen: dict[str, set[int]] = {}
    for d in Path("data/games/train").iterdir():  # <type>-<object>-<...>-<receptacle>-<scene>
        seen.setdefault(d.name.split("-")[0], set()).add(int(d.name.rsplit("-", 1)[1]))
    if not seen:
        raise SystemExit("error: data/games/train holds no games: run `dvc repro games` first")
    # The games stage places valid_seen on the scenes its own train split drew; this one has no train split,
    # so it is given those of data/games (as the panel stage is).
    avoid = frozenset(G.problem_keys(Path("data/games"))) | frozenset(G.problem_keys(Path("data/grpo_games")))
    cfg = G.GenConfig(seed=seed, per_family={split: per_family}, families=list(g.families), unseen_scenes=tuple(g.unseen_scenes),
                      max_per_type=g.max_per_type, distractors=g.distractors, max_expert_steps=g.max_expert_steps,
                      workers=p.workers, avoid=avoid, seen_scenes={fam: sorted(s) for fam, s in seen.items()})
    G.generate(root, cfg)
    made.write_text(json.dumps(want))
    return root


def this_run(episodes: Path, games: list, seeds: list[int], spec, cfg, bank) -> dict[str, int]:
    """Won (1) or not (0) per episode of this model on these games, from its episodes file. The file also keeps
    the records of earlier evaluations in the same folder (another model under the same label, another bank),
    so only the episodes whose fingerprint this evaluation asked for are read (an errored one counts as lost, as in
    the gate); one missing stops the bench."""
    from evoharness.agent.episode import fingerprint
    from evoharness.agent.policies import make_policy

    policy = make_policy(spec)
    wanted = {fingerprint(g, s, policy, cfg, bank) for s in seeds for g in games}
    eps = [json.loads(x) for x in episodes.read_text().splitlines() if x.strip()]
    got = {e["episode_id"]: int(bool((e.get("outcome") or {}).get("won"))) for e in eps if e.get("fingerprint") in wanted}
    if len(got) != len(wanted):
        raise SystemExit(f"error: {episodes}: {len(got)} of this evaluation's {len(wanted)} episodes are there")
    return got


def paired(a: dict[str, int], b: dict[str, int]) -> tuple[int, int, float, float, float]:
    """On the games both played: (games only b won, games only a won, b − a in points, 1.96 paired standard
    errors in points, McNemar's exact one-sided p that b is better)."""
    from evoharness.ops.evidence import mcnemar_worse

    only_b, only_a, p = mcnemar_worse(a, b)  # "a worse than b" is "b better than a"
    n = len(a.keys() & b.keys())
    d = (only_b - only_a) / n
    se = math.sqrt(max((only_b + only_a) / n - d * d, 0.0) / n)
    return only_b, only_a, 100 * d, 196 * se, p


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="+", help="LABEL=MODEL_DIR[:BANK]; the first is the reference")
    ap.add_argument("--per-family", type=int, default=40)
    ap.add_argument("--splits", default="valid_seen,valid_unseen")
    ap.add_argument("--seed", type=int, default=777, help="the fresh games' generator seed")
    ap.add_argument("--out", type=Path, default=Path("bench/results/grpo_gain/run"))
    args = ap.parse_args()
    from evoharness.agent.alfworld.games import list_games
    from evoharness.agent.compare import eval_setup, per_family
    from evoharness.core.config import load_params
    from evoharness.agent.envpool import EnvPool
    from evoharness.agent.evaluate import evaluate, wilson
    from evoharness.agent.harness.experience import Experience
    from evoharness.agent.training.profiles import load_profile

    models = []
    for m in args.models:
        label, sep, rest = m.partition("=")
        path, _, bank = rest.partition(":")
        if not sep or not label or not Path(path, "config.json").is_file():
            raise SystemExit(f"error: {m!r}: expected LABEL=MODEL_DIR[:BANK] with a trained model in MODEL_DIR")
        bank = Path(bank) if bank else (Path(path, "experience.json") if Path(path, "experience.json").is_file() else Path("data/demos/experience.json"))
        if not bank.is_file():
            raise SystemExit(f"error: {m!r}: experience bank {bank} does not exist")
        models.append((label, Path(path), bank))
    p, prof = load_params("params.yaml"), load_profile("tiny-cpu", "params.yaml")
    outcomes: dict[tuple[str, str], dict[str, int]] = {}
    with EnvPool(prof.episode_workers) as pool:
        for split in args.splits.split(","):
            t = time.time()
            root = fresh_games(args.out, split, args.per_family, args.seed)
            games = per_family(list_games(root, split), args.per_family)
            print(f"{split}: {len(games)} fresh games under {root} ({time.time() - t:.0f} s)", flush=True)
            for label, path, bank in models:
                t = time.time()
                cfg, spec = eval_setup(p, prof, path, "inline")
                b = Experience.load(bank)
                evaluate(games, spec, cfg, list(p.eval.seeds), args.out / "eval" / label / split, prof.episode_workers, b, pool=pool)
                o = outcomes[(label, split)] = this_run(args.out / "eval" / label / split / "episodes.jsonl", games, list(p.eval.seeds), spec, cfg, b)
                print(f"{label} {split}: {sum(o.values())}/{len(o)} ({time.time() - t:.0f} s)", flush=True)
    ref = models[0][0]
    print(f"\n| model | split | wins | success % [95 % CI] | − {ref}, points [±1.96 paired SE] | only it / only {ref} won | McNemar p (better) |")
    print("|---|---|---|---|---|---|---|")
    for split in args.splits.split(","):
        for label, _, _ in models:
            o = outcomes[(label, split)]
            w, n = sum(o.values()), len(o)
            lo, hi = wilson(w, n)
            row = f"| {label} | {split} | {w}/{n} | {100 * w / n:.1f} [{100 * lo:.1f}, {100 * hi:.1f}] |"
            if label == ref:
                print(row + " – | – | – |")
                continue
            only_it, only_ref, d, ci, pval = paired(outcomes[(ref, split)], o)
            print(row + f" {d:+.1f} [{d - ci:+.1f}, {d + ci:+.1f}] | {only_it} / {only_ref} | {pval:.3f} |")


if __name__ == "__main__":
    main()
