"""Environment benchmark: steps/s per worker and aggregate over 1 and 2 workers, load/reset time,
expert episodes per minute; with and without the text-generation speedups.

    .venv/bin/python bench/env_bench.py [--games data/games] [--split valid_unseen] [--per-family 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def play_expert(worker, game, seed=0, max_steps=60):
    t0 = time.perf_counter()
    step = worker.reset(game.path, seed)
    reset_s = time.perf_counter() - t0
    n = 0
    t1 = time.perf_counter()
    while not step.won and n < max_steps and step.expert_action:
        step = worker.step(step.expert_action)
        n += 1
    return reset_s, n, time.perf_counter() - t1, step.won


def measure(games, workers: int, speedups: bool) -> dict:
    from evoharness.agent.envpool import EnvPool

    with EnvPool(workers, speedups=speedups) as pool:
        pool.map(lambda w, g: w.reset(g.path, 0), games[:workers])  # spawn + import, not measured
        for w in pool.workers:
            w.game = None
        t0 = time.perf_counter()
        res = pool.map(play_expert, games)
        wall = time.perf_counter() - t0
    steps = sum(r[1] for r in res)
    step_time = sum(r[2] for r in res)
    return {
        "workers": workers,
        "speedups": speedups,
        "reset_s": statistics.mean(r[0] for r in res),
        "per_worker_steps_s": steps / step_time,
        "aggregate_steps_s": steps / wall,
        "episodes_min": 60 * len(res) / wall,
        "won": sum(r[3] for r in res),
        "episodes": len(res),
        "steps": steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--games", type=Path, default=None, help="games root (default: generate a fresh set)")
    ap.add_argument("--split", default="valid_unseen")
    ap.add_argument("--per-family", type=int, default=2)
    args = ap.parse_args()
    from evoharness.agent.alfworld.games import list_games

    root = args.games
    if root is None:
        from evoharness.agent.alfworld.generate import GenConfig, generate

        root = Path(tempfile.mkdtemp()) / "games"
        generate(root, GenConfig(seed=11, per_family={"train": 0, "valid_seen": 0, "valid_unseen": args.per_family}))
    games = list_games(root, args.split)
    rows = [measure(games, w, s) for s in (False, True) for w in (1, 2)]
    print(f"\nALFWorld engine on {len(games)} {args.split} games (expert actions), 2 cores")
    head = f"{'speedups':>8} {'workers':>7} {'reset s':>8} {'steps/s/worker':>15} {'steps/s total':>14} {'expert ep/min':>14} {'won':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{str(r['speedups']):>8} {r['workers']:>7} {r['reset_s']:>8.2f} {r['per_worker_steps_s']:>15.1f} {r['aggregate_steps_s']:>14.1f} {r['episodes_min']:>14.1f} {r['won']:>3}/{r['episodes']:<3}")
    base = next(r for r in rows if not r["speedups"] and r["workers"] == 1)
    best = next(r for r in rows if r["speedups"] and r["workers"] == 2)
    print(f"\nper-worker step rate, speedups vs plain engine: {next(r for r in rows if r['speedups'] and r['workers'] == 1)['per_worker_steps_s'] / base['per_worker_steps_s']:.1f}x")
    print(f"aggregate (2 workers, speedups) vs 12.5 steps/s per env reported by ALFWorld users: {best['aggregate_steps_s'] / 12.5:.1f}x")


if __name__ == "__main__":
    main()
