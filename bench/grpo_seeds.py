"""GRPO's gain over its SFT model, over k training seeds: the claim the README makes, with its interval.

Trains GRPO ``k`` times from one SFT model (``--sft``, default the main job's), each with its own seed and
otherwise the main job's recipe (params.yaml, the tiny-cpu profile), evaluates the SFT model once and every
GRPO model on the evaluation panel (``--games``, default ``data/panel``: 140 valid_seen and 134
valid_unseen games) as the evaluate stage does, and reports per split:

- per seed: GRPO's success, its gain over SFT in points, and McNemar's exact one-sided p (paired by game);
- over seeds: the mean gain with its 95 % t-interval, mean ± t(0.975, k−1)·sd/√k.

Everything it reads a figure from is written under ``--out``: ``outcomes.jsonl`` (one compact line per
episode: model, split, game, won), ``results.json`` and ``results.md``, rewritten after every model's evaluation
over the seeds done so far. Commit that folder; the models and episode logs go under ``--out``/work (not
committed). A run stopped part-way resumes: what ``outcomes.jsonl`` already holds is not evaluated again, on the
processor kind named in ``run.json`` only (CPU training reproduces per kind: another kind's SFT model differs).
``--main-job-model data/models/grpo-inline`` counts the main job's GRPO model as the seed dvc.lock says it was
trained with (params ``seed``), instead of training that seed again.

    .venv/bin/python bench/grpo_seeds.py --seeds 0,1,2,3,4 --main-job-model data/models/grpo-inline \
        --out bench/results/grpo_seeds

Choosing a recipe happens on the dev panel (``--games data/games``: the valid splits of the demos' games, 60 + 60,
disjoint from the evaluation panel), with the recipe's changes given as ``--set`` and at least 3 seeds, beside the
current recipe's models on the same panel (``--reuse``):

    .venv/bin/python bench/grpo_seeds.py --games data/games --seeds 0,1,2 --set '{"learning_rate": 0.0002}' \
        --out bench/results/grpo_tune_lr2e-4

One seed costs GRPO's stage time (about 12 minutes for 48 updates on Zen 4) plus about 5 minutes of
evaluation on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# t(0.975, df) for df = 1..30: the interval's multiplier (no SciPy needed to re-derive a figure)
T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t_interval(xs: list[float]) -> tuple[float, float, float]:
    """(mean, sd, half-width of the 95 % t-interval) of per-seed values."""
    k = len(xs)
    mean = sum(xs) / k
    if k < 2:
        return mean, float("nan"), float("nan")
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (k - 1))
    return mean, sd, T975[min(k - 1, len(T975)) - 1] * sd / math.sqrt(k)


def summarize(outcomes: dict[tuple[str, str], dict[str, int]], seeds: list[int], splits: list[str]) -> dict:
    """The figures, from the per-episode outcomes only (so anyone can re-derive them from outcomes.jsonl)."""
    from evoharness.ops.evidence import mcnemar_worse

    res: dict = {"seeds": seeds, "splits": {}}
    for split in splits:
        sft = outcomes[("sft", split)]
        rows, gains = [], []
        for s in seeds:
            g = outcomes[(f"grpo-s{s}", split)]
            keys = sft.keys() & g.keys()
            gain = 100 * (sum(g[k] for k in keys) - sum(sft[k] for k in keys)) / len(keys)
            b, c, p = mcnemar_worse(sft, g)  # "SFT worse than GRPO": GRPO better
            rows.append({"seed": s, "success": round(100 * sum(g.values()) / len(g), 2), "gain": round(gain, 2),
                         "only_grpo_won": b, "only_sft_won": c, "mcnemar_p": round(p, 4)})
            gains.append(gain)
        mean, sd, half = t_interval(gains)
        one = len(gains) < 2  # one seed so far: no spread, no interval
        res["splits"][split] = {"games": len(sft), "sft_success": round(100 * sum(sft.values()) / len(sft), 2), "per_seed": rows,
                                "mean_gain": round(mean, 2), "sd": None if one else round(sd, 2),
                                "ci95": None if one else [round(mean - half, 2), round(mean + half, 2)]}
    return res


def table(res: dict) -> str:
    lines = ["| split | games | SFT % | GRPO % per seed | gain per seed (points) | McNemar p per seed | mean gain [95 % t-interval] |",
             "|---|---|---|---|---|---|---|"]
    for split, r in res["splits"].items():
        per = r["per_seed"]
        lines.append(f"| {split} | {r['games']} | {r['sft_success']:.1f} | " + ", ".join(f"{x['success']:.1f}" for x in per)
                     + " | " + ", ".join(f"{x['gain']:+.1f}" for x in per) + " | " + ", ".join(f"{x['mcnemar_p']:.3f}" for x in per)
                     + f" | **{r['mean_gain']:+.1f}** " + (f"[{r['ci95'][0]:+.1f}, {r['ci95'][1]:+.1f}]" if r["ci95"] else "(one seed)") + " |")
    return "\n".join(lines)


def load_outcomes(path: Path) -> dict[tuple[str, str], dict[str, int]]:
    outcomes: dict[tuple[str, str], dict[str, int]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                outcomes.setdefault((r["model"], r["split"]), {})[r["episode"]] = r["won"]
    return outcomes


def write_results(out: Path, outcomes: dict[tuple[str, str], dict[str, int]], splits: list[str], games_root: Path,
                  overrides: dict | None = None) -> dict | None:
    """outcomes.jsonl with every episode so far; results.json and results.md over the seeds evaluated so far."""
    out.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"model": m, "split": sp, "episode": eid, "won": won}, separators=(",", ":"))
             for (m, sp), o in sorted(outcomes.items()) for eid, won in sorted(o.items())]
    atomic_write(out / "outcomes.jsonl", "\n".join(lines) + "\n")
    done = sorted(int(m[len("grpo-s"):]) for m in {m for m, _ in outcomes} if m.startswith("grpo-s")
                  and all((m, sp) in outcomes for sp in splits))
    if not done or not all(("sft", sp) in outcomes for sp in splits):
        return None
    res = summarize(outcomes, done, splits)
    res["games_root"] = str(games_root)
    res["machine"] = json.loads((out / "run.json").read_text())["machine"]  # the processor kind every model here was trained on
    res["grpo_overrides"] = overrides or {}  # the recipe: params.yaml's tiny-cpu grpo with these keys changed
    atomic_write(out / "results.json", json.dumps(res, indent=2) + "\n")
    atomic_write(out / "results.md", table(res) + "\n")
    return res


def check_machine(out: Path, resuming: bool, overrides: dict) -> str:
    """The processor kind of this run, recorded in ``--out``/run.json; a folder holding another kind's outcomes (or
    outcomes of an unrecorded kind) is not resumed here, nor one made for another recipe."""
    from evoharness.core.environment import machine

    here, f = machine(), out / "run.json"
    before = json.loads(f.read_text()) if f.is_file() else None
    if resuming and (before or {}).get("machine") != here:
        raise SystemExit(f"error: --out {out}: its outcomes come from {(before or {}).get('machine', 'an unrecorded processor kind')}, "
                         f"this machine is {here}; CPU training reproduces per processor kind, so give another --out")
    if resuming and (before or {}).get("grpo_overrides", {}) != overrides:
        raise SystemExit(f"error: --out {out}: its models were trained with --set {json.dumps(before.get('grpo_overrides', {}))}, "
                         f"not {json.dumps(overrides)}; give another --out")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(f, json.dumps({"machine": here, "grpo_overrides": overrides}, indent=2) + "\n")
    return here


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def recipe_params(overrides: str, work: Path) -> Path | None:
    """params.yaml with the tiny-cpu profile's grpo keys overridden (None: no override, GRPO reads params.yaml); an
    unknown key or a value the profile refuses stops the bench before anything trains."""
    import yaml

    from evoharness.agent.training.profiles import load_profile

    over = json.loads(overrides)
    if not over:
        return None
    p = yaml.safe_load(Path(ROOT, "params.yaml").read_text())
    unknown = sorted(set(over) - set(p["profiles"]["tiny-cpu"]["grpo"]))
    if unknown:
        raise SystemExit(f"error: --set: {unknown} are not grpo keys of the tiny-cpu profile")
    p["profiles"]["tiny-cpu"]["grpo"].update(over)
    work.mkdir(parents=True, exist_ok=True)
    path = work / "params.yaml"
    atomic_write(path, yaml.safe_dump(p, sort_keys=False))
    load_profile("tiny-cpu", str(path))  # validates
    return path


def main_job_seed(model: Path, root: Path = ROOT) -> int:
    """The seed the main job trained ``model`` with, read from dvc.lock's grpo stage (fails closed)."""
    import yaml

    lock = yaml.safe_load(Path(root, "dvc.lock").read_text()) if Path(root, "dvc.lock").is_file() else {}
    stage = (lock.get("stages") or {}).get("grpo") or {}
    outs = {o["path"] for o in stage.get("outs") or []}
    seed = (stage.get("params") or {}).get("params.yaml", {}).get("seed")
    if str(model).rstrip("/") not in outs or seed is None:
        raise SystemExit(f"error: --main-job-model {model}: dvc.lock's grpo stage does not name it with a seed")
    # the folder must still be what dvc.lock recorded (DVC re-hashes it): a model changed since is not that seed
    r = subprocess.run([sys.executable, "-m", "dvc", "status", "--json", "grpo"], cwd=root, capture_output=True, text=True)
    changed = [] if r.returncode != 0 else [x.get("changed outs") for x in json.loads(r.stdout or "{}").get("grpo", []) if isinstance(x, dict)]
    if r.returncode != 0 or any(changed):
        raise SystemExit(f"error: --main-job-model {model}: its outputs differ from dvc.lock's grpo stage "
                         f"({(r.stdout or r.stderr).strip()[:300]})")
    return int(seed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--sft", type=Path, default=Path("data/models/sft-inline"))
    ap.add_argument("--main-job-model", type=Path, default=None,
                    help="use the main job's GRPO model (e.g. data/models/grpo-inline) for the seed dvc.lock says it was trained with")
    ap.add_argument("--games", type=Path, default=Path("data/panel"), help="the evaluation panel (a games root with valid splits)")
    ap.add_argument("--splits", default="valid_seen,valid_unseen")
    ap.add_argument("--out", type=Path, default=Path("bench/results/grpo_seeds/run"))
    ap.add_argument("--set", default="{}", help="the recipe to try: tiny-cpu grpo keys to override, as JSON (e.g. "
                    "'{\"learning_rate\": 0.0002}'); written to --out/work/params.yaml, which GRPO trains with, and named in results.json")
    ap.add_argument("--reuse", default="", help="seed=model folder pairs, comma-separated: models of this recipe already "
                    "trained (e.g. the evaluation-panel run's, to evaluate them on the dev panel)")
    args = ap.parse_args()
    from evoharness.agent.alfworld.games import list_games
    from evoharness.agent.compare import eval_setup
    from evoharness.core.config import load_params
    from evoharness.agent.envpool import EnvPool
    from evoharness.agent.evaluate import evaluate
    from evoharness.agent.harness.experience import Experience
    from evoharness.agent.training.profiles import load_profile
    from grpo_gain import this_run

    seeds = [int(s) for s in args.seeds.split(",")]
    splits = args.splits.split(",")
    work = args.out / "work"
    if not Path(args.sft, "config.json").is_file():
        raise SystemExit(f"error: --sft {args.sft}: no trained model there (run `dvc repro sft_inline`)")
    reuse = {main_job_seed(args.main_job_model): args.main_job_model} if args.main_job_model else {}
    reuse.update({int(k): Path(v) for k, v in (x.split("=", 1) for x in args.reuse.split(",") if x)})
    recipe = recipe_params(args.set, work)
    # Resumable: an --out folder's outcomes.jsonl is kept, and a (model, split) already in it is not evaluated again,
    # on the processor kind that made it only: CPU training reproduces its hashes per kind (the base and SFT models
    # another kind trains differ), so another kind's outcomes are not this SFT model's or these seeds'.
    outcomes = load_outcomes(args.out / "outcomes.jsonl")
    check_machine(args.out, bool(outcomes), json.loads(args.set))
    params_file = str(recipe or "params.yaml")  # the recipe's models are evaluated as it decodes (max_new_tokens)
    p, prof = load_params(params_file), load_profile("tiny-cpu", params_file)
    games = {split: list_games(args.games, split) for split in splits}

    def evaluate_model(pool, label: str, path: Path, bank: Path) -> None:
        for split in splits:
            if (label, split) in outcomes:
                continue
            t = time.time()
            cfg, spec = eval_setup(p, prof, path, "inline")
            b = Experience.load(bank)
            d = work / "eval" / label / split
            evaluate(games[split], spec, cfg, list(p.eval.seeds), d, prof.episode_workers, b, pool=pool)
            o = outcomes[(label, split)] = this_run(d / "episodes.jsonl", games[split], list(p.eval.seeds), spec, cfg, b)
            print(f"{label} {split}: {sum(o.values())}/{len(o)} ({time.time() - t:.0f} s)", flush=True)
            write_results(args.out, outcomes, splits, args.games, json.loads(args.set))

    with EnvPool(prof.episode_workers) as pool:
        evaluate_model(pool, "sft", args.sft, Path("data/demos/experience.json"))
        for s in seeds:
            if all((f"grpo-s{s}", sp) in outcomes for sp in splits):
                continue
            out = reuse.get(s)
            if out is None:
                out = work / f"grpo-s{s}" / "model"
                if not (out / "config.json").is_file():
                    t = time.time()
                    r = subprocess.run([sys.executable, "-m", "evoharness.cli", "grpo", "--games", "data/grpo_games", "--sft", str(args.sft),
                                        "--bank", "data/demos/experience.json", "--out", str(out), "--curve", str(out.parent / "curve.jsonl"),
                                        "--checkpoints", str(out.parent / "checkpoints"), "--metrics", str(out.parent / "metrics.json"),
                                        "--seed", str(s), *(["--params", str(recipe)] if recipe else [])], cwd=ROOT, env=dict(os.environ))
                    if r.returncode != 0:
                        raise SystemExit(f"error: GRPO seed {s} failed (exit {r.returncode})")
                    print(f"grpo seed {s}: trained in {time.time() - t:.0f} s", flush=True)
            evaluate_model(pool, f"grpo-s{s}", out, out / "experience.json")
    res = write_results(args.out, outcomes, splits, args.games, json.loads(args.set))
    if res:
        print("\n" + table(res))


def rederive(folder: Path) -> dict:
    """The figures again, from a committed ``outcomes.jsonl`` alone."""
    outcomes: dict[tuple[str, str], dict[str, int]] = {}
    for line in (Path(folder) / "outcomes.jsonl").read_text().splitlines():
        r = json.loads(line)
        outcomes.setdefault((r["model"], r["split"]), {})[r["episode"]] = r["won"]
    saved = json.loads((Path(folder) / "results.json").read_text())
    return summarize(outcomes, saved["seeds"], list(saved["splits"]))


if __name__ == "__main__":
    main()
