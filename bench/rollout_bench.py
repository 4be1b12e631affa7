"""Episode rollouts on CPU, as GRPO and evaluation play them: 16 episodes side by side (4 games x 4
seeds) on 16 engine workers, their turns decoded together in lockstep rounds, constrained. Sampled at
T = 1 (a GRPO batch) and greedy (evaluation), with the decoder's fast path (``fastdecode.Qwen3Step``
and the prompts' shared head encoded once) and without it (transformers' own forward every step).
A warm-up pass starts the workers first. The digest column is a hash of every episode's tokens: equal
digests mean both paths played the same episodes.

    .venv/bin/python bench/rollout_bench.py [--model data/models/sft-inline] [--games data/grpo_games] [--seed 5]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", type=Path, default=Path("data/models/sft-inline"))
    ap.add_argument("--games", type=Path, default=Path("data/grpo_games"))
    ap.add_argument("--split", default="train")
    ap.add_argument("--games-per-batch", type=int, default=4)
    ap.add_argument("--rollouts", type=int, default=4)
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--max-steps", type=int, default=50)
    args = ap.parse_args()

    import torch

    from evoharness.agent.alfworld.games import list_games
    from evoharness.agent.envpool import EnvPool
    from evoharness.agent.episode import EpisodeConfig, run_episode
    from evoharness.agent.harness.experience import Experience
    from evoharness.agent.harness.workspace import HarnessConfig
    from evoharness.agent.policies import batched
    from evoharness.agent.policies.hf import load
    from evoharness.agent.training.grpo_rollouts import RecordingPolicy

    torch.set_num_threads(2)
    tok, model, _ = load(str(args.model))
    games = [g for g in list_games(args.games, args.split) if not g.error]
    rng = random.Random(args.seed)
    picked = [rng.choice(games) for _ in range(args.games_per_batch)]
    bank = Experience.load_or_seed(None)
    cfg = EpisodeConfig(max_steps=args.max_steps, harness=HarnessConfig(charge_meta_actions=True))
    jobs = [(k, r) for k in range(len(picked)) for r in range(args.rollouts)]
    decode_s = [0.0]
    original = batched.BatchedGenerator._decode

    def timed(self, batch):
        t = time.perf_counter()
        try:
            return original(self, batch)
        finally:
            decode_s[0] += time.perf_counter() - t

    batched.BatchedGenerator._decode = timed
    rows = []
    with EnvPool(len(jobs)) as pool:

        def play_all(sample: bool, fast: bool):
            gen = batched.BatchedGenerator(model, tok, sample, 1.0, 32, True, fast=fast)

            def play(worker, job):
                k, r = job
                pol = RecordingPolicy(gen, 1000 + 10 * k + r)
                return run_episode(worker, picked[k], pol, cfg, bank, 1000 + 10 * k + r), pol.turns

            decode_s[0] = 0.0
            t0 = time.perf_counter()
            res = pool.map(play, jobs, around=gen.session)
            wall = time.perf_counter() - t0
            tokens = sum(len(s.completion_ids) for _, turns in res for s in turns)
            digest = hashlib.sha256(json.dumps([[s.completion_ids for s in turns] for _, turns in res]).encode()).hexdigest()[:12]
            won = sum(bool(t.outcome.get("won")) for t, _ in res)
            return dict(wall=wall, decode=decode_s[0], tokens=tokens, turns=sum(len(x) for _, x in res), won=won, rounds=gen.batches, digest=digest)

        play_all(False, True)  # warm-up: worker processes start, games load
        for sample in (True, False):
            for fast in (False, True):
                r = play_all(sample, fast)
                rows.append((("sampled T=1" if sample else "greedy"), "fast" if fast else "transformers", r))
    print(f"\nRollouts: {len(jobs)} episodes ({len(picked)} games x {args.rollouts}), {args.max_steps} steps, constrained, 2 cores")
    print(f"{'decoding':<12} {'path':<13} {'wall s':>7} {'decode s':>9} {'tokens/s':>9} {'turns':>6} {'won':>4} {'speedup':>8}  digest")
    base = {}
    for mode, path, r in rows:
        base.setdefault(mode, r["wall"])
        print(f"{mode:<12} {path:<13} {r['wall']:>7.1f} {r['decode']:>9.1f} {r['tokens'] / r['decode']:>9.0f} {r['turns']:>6} "
              f"{r['won']:>4} {base[mode] / r['wall']:>7.2f}x  {r['digest']}")


if __name__ == "__main__":
    main()
