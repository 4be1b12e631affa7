"""Training throughput on CPU: SFT tokens/s, GRPO episodes/minute and decoding replies/s (one at a
time against batched across episode threads) on the tiny profile.

    .venv/bin/python bench/train_bench.py [--games data/games] [--pairs data/pairs] [--demos data/demos/demos.jsonl]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--games", type=Path, default=Path("data/games"))
    ap.add_argument("--pairs", type=Path, default=Path("data/pairs"))
    ap.add_argument("--demos", type=Path, default=Path("data/demos/demos.jsonl"))
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--sft-steps", type=int, default=20)
    ap.add_argument("--grpo-steps", type=int, default=2)
    ap.add_argument("--decode-prompts", type=int, default=64)
    args = ap.parse_args()
    from evoharness.agent.reward import RewardConfig
    from evoharness.agent.training.grpo import train_grpo
    from evoharness.agent.training.profiles import load_profile
    from evoharness.agent.training.sft import train_sft
    from evoharness.agent.training.tiny import make_tiny_base

    prof = load_profile("tiny-cpu", args.params)
    tmp = Path(tempfile.mkdtemp())
    info = make_tiny_base(args.demos, tmp / "base", prof.base.model_dump(), 0)
    rows = []
    for mode in ("inline", "env_only"):
        t0 = time.perf_counter()
        m = train_sft(args.pairs, tmp / "base", tmp / f"sft-{mode}", prof, mode, 0, max_steps=args.sft_steps, timing=tmp / f"t-{mode}.json")
        t = json.loads((tmp / f"t-{mode}.json").read_text())
        rows.append((f"SFT {mode} ({m['steps']} steps x {prof.sft.batch_size} rows)", f"{t['tokens_per_s']:,.0f} tokens/s", time.perf_counter() - t0))
    g = prof.grpo
    t0 = time.perf_counter()
    r = train_grpo(args.games, tmp / "sft-inline", None, tmp / "grpo", prof, RewardConfig(updates=args.grpo_steps), 0, 2, args.grpo_steps, timing=tmp / "t-grpo.json")
    t = json.loads((tmp / "t-grpo.json").read_text())
    rows.append((f"GRPO ({r['steps']} updates x {g.games_per_step} games x {g.rollouts} rollouts)", f"{t['episodes_per_min']:.1f} episodes/min", time.perf_counter() - t0))
    rows += decode_rows(tmp / "sft-inline", args.pairs, args.decode_prompts, prof.grpo.max_new_tokens)
    print(f"\nTiny profile on CPU (2 cores): {info['parameters']:,} parameters, vocabulary {info['vocab_size']}")
    print(f"{'run':<52} {'throughput':>22} {'wall s':>8}")
    for name, thr, wall in rows:
        print(f"{name:<52} {thr:>22} {wall:>8.1f}")


def decode_rows(model_dir: Path, pairs: Path, n: int, max_new: int) -> list[tuple]:
    """Greedy constrained replies to ``n`` real prompts: one at a time, then from 16 threads at once."""
    import threading

    import pandas as pd

    from evoharness.agent.episode import TurnView
    from evoharness.agent.harness.workspace import META_VERBS
    from evoharness.agent.policies.batched import BatchedGenerator
    from evoharness.agent.policies.hf import Sampler, load

    df = pd.read_parquet(pairs / "train.parquet").head(n)
    jobs = []
    for p in df.prompt:
        adm = tuple(p.split("ADMISSIBLE COMMANDS: ")[1].split("\n")[0].split(" | "))
        jobs.append((p, TurnView(verbs=META_VERBS, objective="", observation="", admissible=adm, last_actions=())))
    tok, model, lock = load(str(model_dir))
    one = Sampler(model, tok, False, 1.0, max_new, lock, constrained=True)
    t0 = time.perf_counter()
    for p, v in jobs:
        one(p, view=v)
    t_one = time.perf_counter() - t0
    b = BatchedGenerator(model, tok, False, 1.0, max_new, constrained=True)
    todo = list(range(len(jobs)))
    lk = threading.Lock()

    def worker():
        while True:
            with lk:
                if not todo:
                    return
                i = todo.pop()
            b(jobs[i][0], view=jobs[i][1])

    threads = [threading.Thread(target=worker) for _ in range(16)]
    t0 = time.perf_counter()
    [t.start() for t in threads]
    [t.join() for t in threads]
    t_b = time.perf_counter() - t0
    return [(f"decode one at a time ({len(jobs)} replies)", f"{len(jobs) / t_one:.1f} replies/s", t_one),
            (f"decode batched, 16 threads ({b.rows / max(b.batches, 1):.1f} rows/batch)", f"{len(jobs) / t_b:.1f} replies/s ({t_one / t_b:.1f}x)", t_b)]


if __name__ == "__main__":
    main()
