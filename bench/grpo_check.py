"""A GRPO check that can fail: does cost-aware GRPO raise the policy's success on the games it trains on?

A fixed set of training games where the SFT model wins some rollouts but not all (chosen by playing
each at temperature 1); several rollouts per game per update, every update on the same games, a
constant learning rate, 30 or more updates; success on those games at temperature 1 (the updates' own
rollouts, on-policy) averaged over windows of a few updates; beside a control run with learning rate 0
(the same seeds, so the same episodes until the weights move). It passes when GRPO's success rises by
at least 30 points from the first window to the last while the control's stays within its noise (two
standard errors of the difference of two window means).

    .venv/bin/python bench/grpo_check.py [--games data/games] [--sft data/models/sft-inline] [--bank data/demos/experience.json]
                                         [--n-games 4] [--rollouts 4] [--updates 40] [--window 5] [--lr 2e-4] [--target 0.25]
                                         [--out bench/results/grpo_check] [--fresh | --rerun]

Prints the table and the verdict; writes the curves (JSON) and a plot (PNG) under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def pick_games(games_root: Path, sft: Path, bank: Path, n: int, rollouts: int, profile, params, out: Path, target: float = 0.25) -> list[dict]:
    """Play every training game ``rollouts`` times at temperature 1 and keep the n games the SFT model
    wins some rollouts of but not all, whose win rate is closest to ``target`` (ties by id): games with
    a signal and room to rise 30 points. Why not one half: a rate from 4 rollouts is noisy, so games
    picked at 2/4 regress to the pool's mean (the lr-0 control won 62 % of them over 40 updates)."""
    from evoharness.agent.alfworld.games import list_games
    from evoharness.agent.evaluate import evaluate
    from evoharness.agent.harness.experience import Experience
    from evoharness.agent.policies import PolicySpec

    games = list_games(games_root, "train")
    spec = PolicySpec(kind="hf", path=str(sft), sample=True, temperature=1.0, max_new_tokens=profile.grpo.max_new_tokens,
                      constrained=profile.decoding == "constrained")
    cfg = params.episode.model_copy(update={"max_steps": profile.grpo.max_steps_per_episode,
                                            "harness": params.episode.harness.model_copy(update={"charge_meta_actions": profile.grpo.charge_meta_actions})})
    from evoharness.agent.rollout import read_jsonl

    sel = out / "selection" / "episodes.jsonl"
    recs, _ = read_jsonl(sel) if sel.exists() else ([], None)
    if len(recs) == len(games) * rollouts:  # a finished selection with these arguments is reused (--fresh to replay it)
        print(f"selection reused: {sel}", flush=True)
    else:
        evaluate(games, spec, cfg, list(range(rollouts)), out / "selection", profile.episode_workers, Experience.load(bank))
        recs, _ = read_jsonl(sel)
    wins: dict[str, list[int]] = {}
    for x in recs:
        wins.setdefault(x["game_id"], []).append(int(bool(x["outcome"]["won"])))
    return choose(wins, n, target)


def choose(wins: dict[str, list[int]], n: int, target: float) -> list[dict]:
    """The n games with some wins and some losses whose win rate is closest to ``target`` (ties by id)."""
    overall = sum(sum(w) for w in wins.values()) / max(1, sum(len(w) for w in wins.values()))
    rows = sorted(({"game": g, "wins": sum(w), "played": len(w)} for g, w in wins.items()), key=lambda d: (abs(d["wins"] / d["played"] - target), d["game"]))
    some = [d for d in rows if 0 < d["wins"] < d["played"]]
    if len(some) < n:
        raise SystemExit(f"error: only {len(some)} training games where the SFT model wins some rollouts but not all (need {n}); "
                         f"overall success {overall:.1%}")
    return some[:n]


def run(label: str, lr: float, ids: list[str], args, profile, params, out: Path) -> list[dict]:
    from evoharness.agent.training.grpo import train_grpo

    g = profile.grpo.model_copy(update={"games_per_step": len(ids), "rollouts": args.rollouts, "steps": args.updates, "learning_rate": lr,
                                        "temperature": 1.0, "scheduler": "constant", "save_steps": 10_000, "micro_batch": 0})
    prof = profile.model_copy(update={"grpo": g})
    curve = out / f"{label}.jsonl"
    done = [json.loads(x) for x in curve.read_text().splitlines() if x.strip()] if curve.exists() else []
    if len(done) == args.updates:  # a finished run with these arguments is reused (--fresh to run it again)
        print(f"{label}: reused {curve}", flush=True)
        return done
    t0 = time.time()
    train_grpo(args.games, args.sft, args.bank, out / label, prof, params.episode.reward.model_copy(update={"updates": args.updates}), params.seed,
               params.workers, args.updates, out / f"{label}-checkpoints", curve, None, order=ids * args.updates)
    rows = [json.loads(x) for x in curve.read_text().splitlines() if x.strip()]
    print(f"{label}: {len(rows)} updates in {time.time() - t0:.0f} s", flush=True)
    return rows


def verdict(wg: list[tuple[int, float, float]], wc: list[tuple[int, float, float]], need: float = 0.30) -> dict:
    """The pass rule on GRPO's and the control's windows: GRPO's last window at least ``need`` above its
    first, and the control's drift (last minus first) within two standard errors of that difference."""
    rise, drift = wg[-1][1] - wg[0][1], wc[-1][1] - wc[0][1]
    noise = 2 * math.sqrt(wc[0][2] ** 2 + wc[-1][2] ** 2)
    return {"rise": rise, "drift": drift, "noise": noise, "pass": rise >= need and abs(drift) <= noise}


def stale_parts(out: Path, inputs: dict, fresh: bool, rerun: bool) -> list[Path]:
    """The check's own files under ``out`` to remove before it runs (none when everything is reused);
    refuses in one line (SystemExit) to mix parts made from other inputs with these."""
    stamp = out / "inputs.json"
    own = [out / x for x in ("selection", "grpo", "control", "grpo-checkpoints", "control-checkpoints", "grpo.jsonl", "control.jsonl",
                             "result.json", "grpo_check.png", "inputs.json")]
    try:
        held = json.loads(stamp.read_text()) if stamp.exists() else None
    except json.JSONDecodeError:
        held = None  # unreadable: as good as unrecorded
    same = {part: isinstance(held, dict) and held.get(part) == inputs[part] for part in inputs}
    if fresh or rerun:
        if rerun and not same["selection"]:
            raise SystemExit(f"error: {out} holds no selection of these inputs (SFT weights, bank, games, params, rollouts) to keep; pass --fresh")
        return [x for x in own if x.exists() and not (rerun and x.name in ("selection", "inputs.json"))]
    if any(x.exists() for x in own) and not all(same.values()):
        part = "selection" if not same["selection"] else "runs"
        raise SystemExit(f"error: {out} holds a GRPO check whose {part} had other inputs (or unrecorded ones); pass "
                         f"{'--fresh' if part == 'selection' else '--rerun (keeps the selection) or --fresh'} to replace it, or another --out")
    return []


def windows(rows: list[dict], w: int, per_update: int) -> list[tuple[int, float, float]]:
    """(first update, mean success, its standard error) per window of w updates."""
    out = []
    for i in range(0, len(rows), w):
        chunk = rows[i : i + w]
        p = sum(r["success"] for r in chunk) / len(chunk)
        n = per_update * len(chunk)
        out.append((i, p, math.sqrt(max(p * (1 - p), 1e-9) / n)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--games", type=Path, default=Path("data/games"))
    ap.add_argument("--sft", type=Path, default=Path("data/models/sft-inline"))
    ap.add_argument("--bank", type=Path, default=Path("data/demos/experience.json"))
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--n-games", type=int, default=4)
    ap.add_argument("--rollouts", type=int, default=4)
    ap.add_argument("--updates", type=int, default=40)
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--out", type=Path, default=Path("bench/results/grpo_check"))
    ap.add_argument("--target", type=float, default=0.25, help="the SFT win rate (from the selection's rollouts) the chosen games are closest to")
    again = ap.add_mutually_exclusive_group()
    again.add_argument("--fresh", action="store_true", help="remove the check's own files under --out and run it all again")
    again.add_argument("--rerun", action="store_true", help="keep a selection of the same inputs, run GRPO and the control again")
    args = ap.parse_args()
    from evoharness.agent.training.checkpoint import weights_digest
    from evoharness.agent.training.sft import file_digest

    # What the check's finished parts depend on: reused only when these are the same (else refused,
    # unless --fresh, which removes the check's own files and nothing else under --out).
    inputs = {"selection": {"sft": weights_digest(args.sft), "bank": file_digest(args.bank), "games": str(args.games),
                            "params": file_digest(Path(args.params)), "rollouts": args.rollouts},
              "runs": {k: getattr(args, k) for k in ("n_games", "updates", "lr", "target")}}
    import shutil

    for x in stale_parts(args.out, inputs, args.fresh, args.rerun):
        shutil.rmtree(x) if x.is_dir() else x.unlink(missing_ok=True)
    stamp = args.out / "inputs.json"
    args.out.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps(inputs, indent=1))
    from evoharness.core.config import load_params
    from evoharness.agent.training.profiles import load_profile

    params = load_params(args.params)
    profile = load_profile("tiny-cpu", args.params)
    chosen = pick_games(args.games, args.sft, args.bank, args.n_games, args.rollouts, profile, params, args.out, args.target)
    ids = [d["game"] for d in chosen]
    print("games:", ", ".join(f"{d['game']} ({d['wins']}/{d['played']})" for d in chosen), flush=True)
    def finished(label: str) -> bool:
        curve = args.out / f"{label}.jsonl"
        return curve.exists() and sum(1 for x in curve.read_text().splitlines() if x.strip()) == args.updates

    reprint = finished("grpo") and finished("control") and (args.out / "result.json").exists()  # nothing re-runs: keep the record
    grpo = run("grpo", args.lr, ids, args, profile, params, args.out)
    control = run("control", 0.0, ids, args, profile, params, args.out)
    per = args.n_games * args.rollouts
    wg, wc = windows(grpo, args.window, per), windows(control, args.window, per)
    print(f"\nGRPO check: {args.n_games} games x {args.rollouts} rollouts per update, {args.updates} updates, lr {args.lr} constant; "
          f"success on those games at temperature 1, mean per window of {args.window} updates\n")
    print("| updates | GRPO | control (lr 0) |\n|---|---|---|")
    for (u, p, se), (_, q, se2) in zip(wg, wc):
        print(f"| {u}-{u + args.window - 1} | {100 * p:.1f} ± {196 * se:.1f} | {100 * q:.1f} ± {196 * se2:.1f} |")
    v = verdict(wg, wc)
    rise, drift, noise, ok = v["rise"], v["drift"], v["noise"], v["pass"]
    print(f"\nGRPO rises {100 * rise:+.1f} points (needs >= +30.0); the control moves {100 * drift:+.1f} (noise bound ±{100 * noise:.1f}): "
          f"{'PASS' if ok else 'FAIL'}")
    if reprint:
        print(f"(reused runs: {args.out / 'result.json'} and the plot are kept as they were written)")
        return
    (args.out / "result.json").write_text(json.dumps({"games": chosen, "grpo": wg, "control": wc, "rise": rise, "drift": drift, "noise": noise,
                                                      "pass": ok, "args": {k: str(v) for k, v in vars(args).items()}}, indent=1))
    plot(grpo, control, args, args.out / "grpo_check.png")


def plot(grpo: list[dict], control: list[dict], args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.4))
    for rows, label in ((grpo, f"GRPO (lr {args.lr})"), (control, "control (lr 0)")):
        ax.plot([r["update"] for r in rows], [r["success"] for r in rows], marker=".", label=label)
    ax.set_xlabel("update")
    ax.set_ylabel("success on the training games (T = 1)")
    ax.set_ylim(-0.05, 1.05)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
