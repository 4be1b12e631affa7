"""Sampling evaluation beside greedy, as the field reports it: T = 1.0, top-p 0.9, avg@k over k seeds.

Evaluates each model (default: SFT-inline and GRPO of the main job) on the evaluation panel (``--games``,
default ``data/panel``) greedily (one seed, as the evaluate stage does) and by sampling with ``--seeds``
(default 0,1,2: avg@3), everything else as the evaluate stage (the profile's decoding constraint, step and
turn budgets, the model's own bank, frozen). Per model and split it reports the greedy success, and the
sampled success averaged over seeds with its 95 % t-interval across seeds (mean ± t(0.975, k−1)·sd/√k).

Writes ``outcomes.jsonl`` (one compact line per episode), ``results.json`` and ``results.md`` under
``--out``; the episode logs go under ``--out``/work (not committed).

    .venv/bin/python bench/sampling_eval.py --out bench/results/sampling_eval/main

About 4 minutes per model, split and seed on 2 cores for the tiny student on the panel.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def summarize(outcomes: dict[tuple[str, str, str], dict[str, int]], models: list[str], splits: list[str], seeds: list[int]) -> dict:
    """The figures from per-episode outcomes alone (keys: model, split, 'greedy' or 's<seed>')."""
    from grpo_seeds import t_interval

    res: dict = {"seeds": seeds, "models": {}}
    for m in models:
        res["models"][m] = {}
        for split in splits:
            g = outcomes[(m, split, "greedy")]
            per = [100 * sum(outcomes[(m, split, f"s{s}")].values()) / len(outcomes[(m, split, f"s{s}")]) for s in seeds]
            mean, sd, half = t_interval(per)
            res["models"][m][split] = {"games": len(g), "greedy": round(100 * sum(g.values()) / len(g), 2),
                                       "sampled_per_seed": [round(x, 2) for x in per], "avg": round(mean, 2),
                                       "ci95": [round(mean - half, 2), round(mean + half, 2)] if len(per) > 1 else None}
    return res


def table(res: dict) -> str:
    k = len(res["seeds"])
    lines = [f"| model | split | games | greedy % | sampled (T = 1.0, top-p 0.9) % per seed | avg@{k} [95 % t-interval] |", "|---|---|---|---|---|---|"]
    for m, splits in res["models"].items():
        for split, r in splits.items():
            ci = f" [{r['ci95'][0]:.1f}, {r['ci95'][1]:.1f}]" if r["ci95"] else ""
            lines.append(f"| {m} | {split} | {r['games']} | {r['greedy']:.1f} | " + ", ".join(f"{x:.1f}" for x in r["sampled_per_seed"])
                         + f" | **{r['avg']:.1f}**{ci} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=["sft-inline=data/models/sft-inline", "grpo=data/models/grpo"], help="LABEL=MODEL_DIR")
    ap.add_argument("--games", type=Path, default=Path("data/panel"))
    ap.add_argument("--splits", default="valid_seen,valid_unseen")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--out", type=Path, default=Path("bench/results/sampling_eval/run"))
    args = ap.parse_args()
    from evoharness.agent.alfworld.games import list_games
    from evoharness.agent.compare import eval_setup
    from evoharness.core.config import load_params
    from evoharness.agent.envpool import EnvPool
    from evoharness.agent.evaluate import evaluate
    from evoharness.agent.harness.experience import Experience
    from evoharness.agent.training.profiles import load_profile
    from grpo_gain import this_run

    seeds, splits = [int(s) for s in args.seeds.split(",")], args.splits.split(",")
    models = []
    for m in args.models:
        label, sep, path = m.partition("=")
        if not sep or not Path(path, "config.json").is_file():
            raise SystemExit(f"error: {m!r}: expected LABEL=MODEL_DIR with a trained model in MODEL_DIR")
        bank = Path(path, "experience.json") if Path(path, "experience.json").is_file() else Path("data/demos/experience.json")
        models.append((label, Path(path), bank))
    p, prof = load_params("params.yaml"), load_profile("tiny-cpu", "params.yaml")
    outcomes: dict[tuple[str, str, str], dict[str, int]] = {}
    lines = []
    with EnvPool(prof.episode_workers) as pool:
        for split in splits:
            games = list_games(args.games, split)
            for label, path, bank in models:
                b = Experience.load(bank)
                cfg, greedy = eval_setup(p, prof, path, "inline")
                sampled = greedy.model_copy(update={"sample": True, "temperature": args.temperature, "top_p": args.top_p})
                for how, spec, run_seeds in [("greedy", greedy, [0])] + [(f"s{s}", sampled, [s]) for s in seeds]:
                    t = time.time()
                    d = args.out / "work" / label / split / how
                    evaluate(games, spec, cfg, run_seeds, d, prof.episode_workers, b, pool=pool)
                    o = outcomes[(label, split, how)] = {k.rsplit("#", 1)[0]: v for k, v in this_run(d / "episodes.jsonl", games, run_seeds, spec, cfg, b).items()}
                    lines += [json.dumps({"model": label, "split": split, "run": how, "game": k, "won": v}, separators=(",", ":")) for k, v in sorted(o.items())]
                    print(f"{label} {split} {how}: {sum(o.values())}/{len(o)} ({time.time() - t:.0f} s)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "outcomes.jsonl").write_text("\n".join(lines) + "\n")
    res = summarize(outcomes, [m[0] for m in models], splits, seeds)
    res.update(games_root=str(args.games), temperature=args.temperature, top_p=args.top_p)
    (args.out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    md = table(res)
    (args.out / "results.md").write_text(md + "\n")
    print("\n" + md)


if __name__ == "__main__":
    main()
