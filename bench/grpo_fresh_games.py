"""GRPO from the main job's SFT model on another set of training games, evaluated on the main job's
valid_seen as the evaluate stage does, at each update count in STOPS (the run resumes for the next).

    evoharness games --out /tmp/g2/games --params P --seed 4242   # P: params.yaml with games.per_family.train 64
    .venv/bin/python bench/grpo_fresh_games.py /tmp/g2/games fresh384 24,48 [seed]

Models and episodes go under bench/results/grpo_dose/<tag> (not committed); RESULT lines are printed.
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

def main():
    from evoharness.alfworld.games import list_games
    from evoharness.compare import eval_setup, per_family
    from evoharness.config import load_params
    from evoharness.envpool import EnvPool
    from evoharness.evaluate import evaluate
    from evoharness.harness.experience import Experience
    from evoharness.training.grpo import train_grpo
    from evoharness.training.profiles import load_profile
    groot, tag, stops = Path(sys.argv[1]), sys.argv[2], [int(x) for x in sys.argv[3].split(",")]
    p, prof = load_params("params.yaml"), load_profile("tiny-cpu", "params.yaml")
    seed = int(sys.argv[4]) if len(sys.argv) > 4 else p.seed  # GRPO's seed: its game draws and rollouts
    prof = prof.model_copy(update={"grpo": prof.grpo.model_copy(update={"save_steps": stops[0]})})
    root = Path("bench/results/grpo_dose") / tag
    print("train games:", len([g for g in list_games(groot, "train") if not g.error]), flush=True)
    for s in stops:
        out = root / f"s{s}"; t0 = time.time()
        if not (out / "config.json").exists():
            train_grpo(groot, Path("data/models/sft-inline"), Path("data/demos/experience.json"), out, prof,
                       p.episode.reward.model_copy(update={"updates": max(stops)}), seed, p.workers, s, root / "ck", root / f"curve{s}.jsonl")
        t1 = time.time()
        cfg, spec = eval_setup(p, prof, out, "inline")
        with EnvPool(prof.episode_workers) as pool:
            games = per_family(list_games(Path("data/games"), "valid_seen"), prof.eval_games_per_family)
            r = evaluate(games, spec, cfg, list(p.eval.seeds), root / f"eval{s}", prof.episode_workers, Experience.load(out / "experience.json"), pool=pool)
        a = r["summary"]["all"]
        print(f"RESULT {tag} updates={s} valid_seen {a['wins']}/{a['episodes']} train={t1-t0:.0f}s eval={time.time()-t1:.0f}s", flush=True)

if __name__ == "__main__":
    main()
