"""Training throughput of the tiny profile: the shared-head forward and length-grouped batches
against the plain forward on randomly drawn batches, for the base model's pretraining and for SFT.

    python bench/shared_head_bench.py [--steps 60] [--models data/models] [--pairs data/pairs] [--demos data/demos/demos.jsonl]

Both paths train the same model from the same start on the same data for the same number of steps;
the table gives their wall time and their losses (they differ only by the batches drawn). Needs the
main job's base model, demos and pairs (``evoharness run``)."""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _random_batches(lengths, batch, rng, mega=50):
    order = list(range(len(lengths)))
    rng.shuffle(order)
    return [order[k : k + batch] for k in range(0, len(order), batch)][::-1]


def pretrain_run(base: Path, demos: Path, steps: int, plain: bool) -> dict:
    from transformers import AutoTokenizer

    from evoharness.agent.rollout import read_jsonl
    from evoharness.agent.training import shared_head, tiny

    info = json.loads((base / "base_info.json").read_text())
    cfg = {k: info[k] for k in ("hidden_size", "intermediate_size", "layers", "heads", "kv_heads", "max_length")}
    records, _ = read_jsonl(demos)
    prompts = [t["prompt"] for r in records for t in r.get("turns", [])]
    cfg["pretrain_epochs"] = steps * 16 / len(prompts)
    tok = AutoTokenizer.from_pretrained(base)
    model = tiny.build_model(len(tok), cfg, 0)
    saved = shared_head.install, tiny.length_grouped
    if plain:
        shared_head.install, tiny.length_grouped = (lambda m: False), _random_batches
    try:
        r = tiny.pretrain(model, tok, prompts, cfg, 0)
    finally:
        shared_head.install, tiny.length_grouped = saved
    return {"seconds": r["seconds"], "loss": r["last_loss"]}


def sft_run(pairs: Path, base: Path, steps: int, plain: bool) -> dict:
    from evoharness.agent.training import shared_head
    from evoharness.agent.training.profiles import load_profile
    from evoharness.agent.training.sft import train_sft

    prof = load_profile("tiny-cpu", ROOT / "params.yaml")
    prof = prof.model_copy(update={"sft": prof.sft.model_copy(update={"group_by_length": not plain, "eval_steps": 10**6})})
    saved = shared_head.install
    if plain:
        shared_head.install = lambda m: False
    d = Path(tempfile.mkdtemp())
    try:
        m = train_sft(pairs, base, d / "out", prof, "inline", 0, max_steps=steps, checkpoints=d / "ck", timing=d / "t.json", root=ROOT)
        t = json.loads((d / "t.json").read_text())
    finally:
        shared_head.install = saved
        shutil.rmtree(d, ignore_errors=True)
    return {"seconds": t["train_runtime"], "loss": m["train_loss"], "eval_loss": m["eval_loss"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--models", default="data/models")
    ap.add_argument("--pairs", default="data/pairs")
    ap.add_argument("--demos", default="data/demos/demos.jsonl")
    a = ap.parse_args()
    base = ROOT / a.models / "base"
    rows = []
    for name, fn in (("pretraining", lambda plain: pretrain_run(base, ROOT / a.demos, a.steps, plain)),
                     ("SFT (inline)", lambda plain: sft_run(ROOT / a.pairs, base, a.steps, plain))):
        plain, fast = fn(True), fn(False)
        rows.append((name, plain, fast))
    print(f"\n{a.steps} steps of 16 rows, {time.strftime('%Y-%m-%d')}\n")
    print("| stage | plain forward, random batches | shared head, length-grouped batches | speedup | loss plain / shared |")
    print("|---|---|---|---|---|")
    for name, p, f in rows:
        print(f"| {name} | {p['seconds']:.1f} s | {f['seconds']:.1f} s | {p['seconds'] / f['seconds']:.2f}x | {p['loss']:.4f} / {f['loss']:.4f} |")


if __name__ == "__main__":
    random.seed(0)
    main()
