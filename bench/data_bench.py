"""Validation throughput on a synthetic set of at least 100k turns, and the no-op `dvc repro` time.

    .venv/bin/python bench/data_bench.py [--turns 100000] [--repo .]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def synth_demos(path: Path, n_turns: int, seed: int = 0) -> int:
    """Episodes shaped like teacher demos: 20 turns each, real prompt sizes (~360 words)."""
    from evoharness.agent.alfworld.families import FAMILIES
    from evoharness.agent.episode import TurnView, build_prompt, format_response

    rng = random.Random(seed)
    fams = list(FAMILIES)
    adm = tuple(f"go to cabinet {i}" for i in range(1, 20)) + ("inventory", "look")
    kinds = ["env"] * 7 + ["track", "commit", "recall", "note"]
    n_eps = n_turns // 20
    with open(path, "w") as f:
        for e in range(n_eps):
            turns = []
            for t in range(20):
                kind = rng.choice(kinds)
                action = {"env": rng.choice(adm), "track": "track apple", "commit": "commit find apple", "recall": "recall where is the apple", "note": "note apple in fridge"}[kind]
                view = TurnView(("track", "commit", "recall", "note"), "put a clean apple in fridge.", "You arrive at cabinet 3. The cabinet 3 is closed.", adm, tuple(f"go to cabinet {i}" for i in range(10)), (("PLAN", "[ ] find apple"), ("HINTS", "none"), ("RESULT", "none")))
                turns.append({"t": t, "prompt": build_prompt(view), "response": format_response("I look for the apple.", action), "action": action,
                              "kind": kind, "valid": True, "observation": "You arrive.", "cost": 1})
            calls = {v: sum(x["kind"] == v for x in turns) for v in ("track", "commit", "recall", "note")}
            rec = {"episode_id": f"train/g{e}#s0", "fingerprint": str(e), "game_id": f"train/g{e}", "split": "train", "family": rng.choice(fams),
                   "policy": "teacher", "harness": {}, "seed": 0, "max_steps": 50, "task": "x", "target": {}, "turns": turns,
                   "outcome": {"won": True, "steps": 14, "turns": 20, "calls": calls, "invalid": 0, "repeats": 0},
                   "reward": {"success": 1.0, "efficiency": 0.72, "diversity": 1.0, "repeats": 0.0, "invalid": 0.0, "update": 0, "total": 11.72},
                   "notes": [], "recalled": [], "found_in": "fridge 1", "error": None, "bank_updates": 0}
            f.write(json.dumps(rec) + "\n")
    return n_eps * 20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=100_000)
    ap.add_argument("--repo", type=Path, default=Path("."))
    args = ap.parse_args()
    from evoharness.agent.pairs import build_pairs
    from evoharness.ops.validation import gate

    tmp = Path(tempfile.mkdtemp())
    demos = tmp / "demos.jsonl"
    n = synth_demos(demos, args.turns)
    size_mb = demos.stat().st_size / 1e6
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import great_expectations"], check=True)
    t_import = time.perf_counter() - t0
    t0 = time.perf_counter()
    build_pairs(demos, tmp / "pairs", 0.1, 0)
    t_pairs = time.perf_counter() - t0
    t0 = time.perf_counter()
    gate(demos, None, 1024, tmp / "r1", tmp / "q", None)
    t_traj = time.perf_counter() - t0  # includes the first (in-process) GX import
    t0 = time.perf_counter()
    gate(None, tmp / "pairs", 1024, tmp / "r2", tmp / "q", None)
    t_pairs_val = time.perf_counter() - t0
    rows = [("build SFT pairs", n, t_pairs), ("validate trajectories (incl. GX import)", n, t_traj), ("validate SFT pairs", n, t_pairs_val)]
    print(f"\nValidation on {n:,} synthetic turns ({size_mb:.0f} MB of JSONL), 2 cores; GX import alone {t_import:.1f} s")
    print(f"{'step':<42} {'turns':>9} {'seconds':>8} {'turns/s':>9}")
    for name, k, t in rows:
        print(f"{name:<42} {k:>9,} {t:>8.1f} {k / t:>9,.0f}")
    print(f"gate total (trajectories + pairs): {t_traj + t_pairs_val:.1f} s for {n:,} turns (target: 100k turns in <= 30 s)")
    repo = args.repo.resolve()
    if (repo / "dvc.lock").exists():
        from evoharness.ops.vcs import dvc

        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            out = dvc(["repro"], repo)
            times.append(time.perf_counter() - t0)
        print(f"no-op `dvc repro` on {repo.name}: {min(times):.2f} s best of 3 (up to date: {'up to date' in out})")


if __name__ == "__main__":
    main()
