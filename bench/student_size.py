"""Does a larger tiny student leave GRPO more room on unseen layouts? Trains the main job's model
chain (base model, SFT-inline, cost-aware GRPO) with other base sizes, on the main job's demos, pairs
and games, through the same CLI commands the DVC stages run, and evaluates SFT-inline and GRPO as the
evaluate stage does (greedy, constrained, 10 games per family, the eval caps).

    .venv/bin/python bench/student_size.py --tag L4H128 --base '{"layers": 4, "hidden_size": 128, "intermediate_size": 384}'
                                           [--splits valid_seen] [--out bench/results/student_size]
    .venv/bin/python bench/student_size.py --tag seed1 --base '{}' --seed 1 --models sft-inline   # the same recipe, another seed

Prints one ``RESULT`` line per model and split and each stage's seconds; the models, a params copy
and the episodes go under ``--out/<tag>`` (not committed). Nothing under data/ is written.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def stage(name: str, cmd: list[str], log: Path) -> float:
    t0 = time.time()
    with open(log, "a") as f:
        r = subprocess.run([sys.executable, "-m", "evoharness.cli", *cmd], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=False)
    if r.returncode:
        raise SystemExit(f"error: {name} failed (exit {r.returncode}); see {log}")
    print(f"STAGE {name} {time.time() - t0:.0f}s", flush=True)
    return time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tag", required=True)
    ap.add_argument("--base", required=True, help="tiny-cpu base keys to override, as JSON")
    ap.add_argument("--sft", default="{}", help="tiny-cpu sft keys to override, as JSON")
    ap.add_argument("--splits", default="valid_seen")
    ap.add_argument("--out", type=Path, default=Path("bench/results/student_size"))
    ap.add_argument("--seed", type=int, default=None, help="params seed for the base model's init and SFT (the games, demos and pairs stay the main job's)")
    ap.add_argument("--models", default="sft-inline,grpo", help="train and evaluate these: sft-inline, or sft-inline,grpo")
    args = ap.parse_args()
    models = [x.strip() for x in args.models.split(",") if x.strip()]
    if models not in (["sft-inline"], ["sft-inline", "grpo"]):
        raise SystemExit(f"error: --models: want sft-inline or sft-inline,grpo, got {args.models!r}")
    root = (ROOT / args.out / args.tag).resolve()
    root.mkdir(parents=True, exist_ok=True)
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    prof = raw["profiles"]["tiny-cpu"]
    prof["base"].update(json.loads(args.base))
    prof["sft"].update(json.loads(args.sft))
    if args.seed is not None:
        raw["seed"] = args.seed
    params = root / "params.yaml"
    params.write_text(yaml.safe_dump(raw, sort_keys=False))
    log = root / "stages.log"
    m = root / "models"
    steps = [("base_model", ["base-model", "--out", str(m / "base"), "--demos", "data/demos/demos.jsonl", "--params", str(params)]),
             ("sft_inline", ["sft", "--pairs", "data/pairs", "--base", str(m / "base"), "--mode", "inline", "--out", str(m / "sft-inline"),
                             "--checkpoints", str(root / "ck-sft"), "--params", str(params)]),
             ("grpo", ["grpo", "--games", "data/grpo_games", "--sft", str(m / "sft-inline"), "--bank", "data/demos/experience.json", "--out",
                       str(m / "grpo"), "--curve", str(root / "grpo_curve.jsonl"), "--checkpoints", str(root / "ck-grpo"), "--params", str(params)])]
    for name, cmd in steps[:2 + ("grpo" in models)]:
        out = Path(cmd[cmd.index("--out") + 1])
        if (out / "config.json").exists():
            print(f"STAGE {name} reused {out}", flush=True)
            continue
        stage(name, cmd, log)

    from evoharness.agent.alfworld.games import list_games
    from evoharness.agent.compare import eval_setup, per_family
    from evoharness.core.config import load_params
    from evoharness.agent.envpool import EnvPool
    from evoharness.agent.evaluate import evaluate
    from evoharness.agent.harness.experience import Experience
    from evoharness.agent.training.profiles import load_profile

    p, profile = load_params(str(params)), load_profile("tiny-cpu", str(params))
    with EnvPool(profile.episode_workers) as pool:
        for label in models:
            cfg, spec = eval_setup(p, profile, m / label, "inline")
            own = m / label / "experience.json"
            bank = Experience.load(own if own.exists() else ROOT / "data/demos/experience.json")
            for split in args.splits.split(","):
                t0 = time.time()
                games = per_family(list_games(ROOT / "data/games", split), profile.eval_games_per_family)
                r = evaluate(games, spec, cfg, list(p.eval.seeds), root / "eval" / label / split, profile.episode_workers, bank, pool=pool)
                a = r["summary"]["all"]
                print(f"RESULT {args.tag} {label} {split} {a['wins']}/{a['episodes']} ({a['success']:.1%}) eval={time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
