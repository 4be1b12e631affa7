"""How much GRPO moves the greedy valid_seen success of the main job's SFT model, by updates.

Trains cost-aware GRPO from ``data/models/sft-inline`` (the main job's GRPO settings, with the
learning rate and any other ``grpo`` keys overridden), stops at each count in ``--stops`` (the run
resumes from its checkpoint for the next count, so one run gives every point), and evaluates each
model as the main job's evaluate stage does: greedy, constrained, 10 games per family, at most
``eval_max_steps`` steps and ``eval_max_turns`` turns, with the bank GRPO evolved. The diversity
weight anneals over the last count (or ``--anneal``), so every point is on the same run.

    .venv/bin/python bench/grpo_dose.py --lr 1e-4 --stops 12,24 --tag lr1e-4 [--set '{"temperature": 0.5}'] [--splits valid_seen,valid_unseen]
                                        [--train-games ROOT] [--seed N]

``--train-games``: another games root to train on, e.g. extra games made with
``evoharness games --out /tmp/g2/games --params P --seed 4242`` (P: params.yaml with more train games per family).

Prints one ``RESULT`` line per count and split; the models and episodes go under
``bench/results/grpo_dose/<tag>`` (not committed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--stops", required=True, help="update counts, comma-separated, ascending")
    ap.add_argument("--tag", required=True)
    ap.add_argument("--set", default="{}", help="other grpo keys to override, as JSON")
    ap.add_argument("--splits", default="valid_seen")
    ap.add_argument("--out", type=Path, default=Path("bench/results/grpo_dose"))
    ap.add_argument("--train-games", type=Path, default=Path("data/games"),
                    help="the games root GRPO trains on (its train split); evaluation is always on data/games")
    ap.add_argument("--seed", type=int, default=None, help="GRPO's seed: its game draws and rollouts (default: params seed)")
    ap.add_argument("--anneal", type=int, default=None,
                    help="updates over which the diversity weight anneals (default: the last stop); with the same value and "
                         "--set '{\"save_steps\": N}' a later run of the same tag resumes an earlier run's checkpoint at N")
    args = ap.parse_args()
    from evoharness.agent.alfworld.games import list_games
    from evoharness.agent.compare import eval_setup, per_family
    from evoharness.core.config import load_params
    from evoharness.agent.envpool import EnvPool
    from evoharness.agent.evaluate import evaluate
    from evoharness.agent.harness.experience import Experience
    from evoharness.agent.training.grpo import train_grpo
    from evoharness.agent.training.profiles import load_profile

    try:
        stops = [int(x) for x in args.stops.split(",")]
    except ValueError:
        raise SystemExit(f"error: --stops {args.stops!r} must be update counts separated by commas") from None
    from evoharness.core.errors import EvoError

    try:
        found = list_games(args.train_games, "train")
    except EvoError as e:
        raise SystemExit(f"error: --train-games: {e}") from None
    if not found:
        raise SystemExit(f"error: --train-games {args.train_games}: no training games there (a games root holds train/)")
    if stops != sorted(set(stops)) or stops[0] < 1:
        raise SystemExit(f"error: --stops {args.stops!r} must be positive update counts in ascending order (each resumes the last)")
    p, prof = load_params("params.yaml"), load_profile("tiny-cpu", "params.yaml")
    g = prof.grpo.model_copy(update={"learning_rate": args.lr, "save_steps": stops[0], **json.loads(args.set)})
    prof = prof.model_copy(update={"grpo": g})
    root = args.out / args.tag
    for s in stops:
        out = root / f"s{s}"
        t0 = time.time()
        if not (out / "config.json").exists():
            train_grpo(args.train_games, Path("data/models/sft-inline"), Path("data/demos/experience.json"), out, prof,
                       p.episode.reward.model_copy(update={"updates": args.anneal or max(stops)}), p.seed if args.seed is None else args.seed, p.workers, s, root / "ck", root / f"curve{s}.jsonl")
        t1 = time.time()
        cfg, spec = eval_setup(p, prof, out, "inline")  # as the evaluate stage sets it up
        with EnvPool(prof.episode_workers) as pool:
            for split in args.splits.split(","):
                games = per_family(list_games(Path("data/games"), split), prof.eval_games_per_family)
                r = evaluate(games, spec, cfg, list(p.eval.seeds), root / f"eval{s}" / split, prof.episode_workers,
                             Experience.load(out / "experience.json"), pool=pool)
                a = r["summary"]["all"]
                print(f"RESULT {args.tag} lr={args.lr} updates={s} {split} success={a['success']:.3f} ({a['wins']}/{a['episodes']}) "
                      f"train={t1 - t0:.0f}s eval={time.time() - t1:.0f}s", flush=True)


if __name__ == "__main__":
    main()
