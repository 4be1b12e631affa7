"""The GPU check of the qwen3-8b-h200 profile on one H200, nothing downloaded: the Qwen3-8B
architecture from its config with random bf16 weights, LoRA (r64, all linear layers) SFT steps at
4,096 tokens with gradient checkpointing (tokens/s and MFU against the 989 TFLOP/s dense bf16
peak), and the rollout generation rate of the project's own batched decoder (the one GRPO uses with
generation: hf), constrained, on prompts of the episode's length. Prints a table; ``--out`` writes
it as JSON. Meant to finish within 8 minutes.

    python3 bench/h200_check.py [--out h200.json]           # on the GPU box
    .venv/bin/python bench/h200_check.py --tiny             # the same script at toy size on CPU

MFU counts the model FLOPs of LoRA training, the standard way: forward 2·N·T and the backward through the
activations 2·N·T for the N frozen dense weights (LoRA computes no weight gradients for them), plus causal
attention (forward 2·L·T²·d per sequence, its backward twice that). HFU adds what gradient checkpointing
recomputes (a second forward: 2·N·T and the attention's forward). Both are against 989e12 FLOP/s.

It needs torch, transformers, accelerate and peft only (the GPU image's packages): the project's decoder
(``policies.batched``) imports nothing else. Each figure is printed as soon as it is measured, so a crash
or a kill part-way still shows what ran. With vLLM installed it also measures vLLM's rollout rate on the
same model (saved to a temporary folder), under the same token-level constraint (``policies.vllm_engine``).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PEAK = 989e12
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
                tie_word_embeddings=False)
TINY = dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=32, max_position_embeddings=4096, tie_word_embeddings=False)  # head_dim: vLLM's CPU attention refuses 16


def make_model(cfg: dict, device: str, dtype):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**cfg, attn_implementation="sdpa")
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    return model


def lora_flops(n: int, tokens: int, layers: int, attn_dim: int) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one LoRA training step on one sequence of ``tokens``: the frozen
    dense weights (``n``) forward 2·N·T and backward through the activations 2·N·T; causal attention
    forward 2·L·T²·d, backward twice that; gradient checkpointing's recompute adds one forward of both."""
    dense_fwd = 2 * n * tokens
    attn_fwd = 2 * layers * tokens * tokens * attn_dim
    model = 2 * dense_fwd + 3 * attn_fwd
    return float(model), float(model + dense_fwd + attn_fwd)


def sft_rate(model, tokens: int, steps: int, warmup: int, device: str) -> dict:
    """LoRA SFT steps of one 4,096-token sequence each, gradient checkpointing on."""
    import torch
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(model, LoraConfig(r=64, lora_alpha=128, target_modules="all-linear", task_type="CAUSAL_LM"))
    peft.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    peft.enable_input_require_grads()
    peft.train()
    opt = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad], lr=1e-5)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, tokens), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for i in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        loss = peft(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    c = model.config
    n = sum(p.numel() for n_, p in peft.named_parameters() if "lora_" not in n_ and "embed_tokens" not in n_)
    model_flops, hardware_flops = lora_flops(n, tokens, c.num_hidden_layers, c.num_attention_heads * c.head_dim)
    step = sum(times) / len(times)
    trainable = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    mem = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
    peft.gradient_checkpointing_disable()
    base = peft.unload()
    return {"tokens": tokens, "steps": steps, "step_s": round(step, 3), "tokens_per_s": round(tokens / step, 1),
            "mfu": model_flops / step / PEAK, "hfu": hardware_flops / step / PEAK, "params": n, "lora_params": trainable, "peak_mem_gib": round(mem, 1), "_model": base}


def prompt_text(words: int) -> str:
    obs = ("You arrive at cabinet 3. On the cabinet 3, you see a mug 2, a peppershaker 1, and a saltshaker 2. "
           "You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a cabinet 2, a countertop 1, "
           "a drawer 1, a fridge 1, a microwave 1, a sinkbasin 1, a stoveburner 1, and a toaster 1. ")
    cmds = " | ".join(f"go to cabinet {i}" for i in range(1, 30)) + " | take mug 2 from cabinet 3 | examine cabinet 3 | inventory | look"
    text = f"OBSERVATION: {obs}\nADMISSIBLE COMMANDS: {cmds}\nLAST ACTIONS: go to cabinet 3; track mug\nRESULT: none\n"
    while len(text.split()) < words:
        text += obs
    return text + "OBJECTIVE: put a clean mug in coffeemachine.\n"


def generation_rate(model, rows: int, prompt_words: int, new_tokens: int, device: str) -> dict:
    """Replies per second of ``policies.batched.BatchedGenerator`` from ``rows`` episode threads at once
    (sampled, constrained to the format and the admissible commands)."""
    from types import SimpleNamespace

    from evoharness.agent.policies.batched import BatchedGenerator
    from evoharness.agent.training.tiny import build_tokenizer

    text = prompt_text(prompt_words)
    from evoharness.agent import tokens as wl

    vocab = sorted(set(wl.words(text)) | {"<think>", "</think>", "<action>", "</action>", "track", "commit", "recall", "note", "I", "go"})
    tok = build_tokenizer(vocab)
    model.eval()
    gen = BatchedGenerator(model, tok, True, 1.0, new_tokens, constrained=True, max_batch=rows, wait_s=0.5)
    admissible = tuple(x.strip() for x in text.split("ADMISSIBLE COMMANDS: ")[1].split("\n")[0].split(" | "))
    view = SimpleNamespace(admissible=admissible, verbs=("track", "commit", "recall", "note"), last_actions=())
    prompt_len = len(tok(text, add_special_tokens=False)["input_ids"])
    out: list = [None] * rows

    def go(i):
        out[i] = gen(text, seed=i, view=view)

    for _ in range(2):  # the first round warms the kernels up
        threads = [threading.Thread(target=go, args=(i,)) for i in range(rows)]
        t0 = time.perf_counter()
        [t.start() for t in threads]
        [t.join() for t in threads]
        wall = time.perf_counter() - t0
    toks = sum(len(s.completion_ids) for s in out)
    return {"rows": rows, "prompt_tokens": prompt_len, "new_tokens": toks, "seconds": round(wall, 2), "replies_per_s": round(rows / wall, 2),
            "tokens_per_s": round(toks / wall, 1), "batches": gen.batches}


def vllm_rate(model, rows: int, prompt_words: int, new_tokens: int, device: str, dtype: str) -> dict | None:
    """Replies per second of ``policies.batched.VLLMGenerator`` on a vLLM engine over the same model (saved
    to a temporary folder with the toy tokenizer), ``rows`` episode threads at once; None without vLLM."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None
    import os
    import tempfile
    from types import SimpleNamespace

    from evoharness.agent import tokens as wl
    from evoharness.agent.policies.batched import VLLMGenerator
    from evoharness.agent.training.tiny import build_tokenizer

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    text = prompt_text(prompt_words)
    vocab = sorted(set(wl.words(text)) | {"<think>", "</think>", "<action>", "</action>", "track", "commit", "recall", "note", "I", "go"})
    tok = build_tokenizer(vocab)
    with tempfile.TemporaryDirectory(prefix="h200-check-vllm-") as d:
        model.config.vocab_size = model.get_input_embeddings().weight.shape[0]
        model.save_pretrained(d)
        tok.save_pretrained(d)
        t0 = time.perf_counter()
        from evoharness.agent.policies.vllm_engine import ConstraintLogitsProcessor

        llm = LLM(model=d, dtype=dtype, max_model_len=min(4096, model.config.max_position_embeddings), enforce_eager=device == "cpu",
                  gpu_memory_utilization=0.5 if device == "cuda" else 0.9, seed=0, logits_processors=[ConstraintLogitsProcessor],
                  logprobs_mode="processed_logprobs")
        up = time.perf_counter() - t0
        gen = VLLMGenerator(llm, tok, True, 1.0, new_tokens, constrained=True, max_batch=rows, wait_s=0.5)
        admissible = tuple(x.strip() for x in text.split("ADMISSIBLE COMMANDS: ")[1].split("\n")[0].split(" | "))
        view = SimpleNamespace(admissible=admissible, verbs=("track", "commit", "recall", "note"), last_actions=())
        out: list = [None] * rows

        def go(i):
            out[i] = gen(text, seed=i, view=view)

        for _ in range(2):
            threads = [threading.Thread(target=go, args=(i,)) for i in range(rows)]
            t1 = time.perf_counter()
            [t.start() for t in threads]
            [t.join() for t in threads]
            wall = time.perf_counter() - t1
        del llm
    toks = sum(len(s.completion_ids) for s in out)
    return {"rows": rows, "engine_up_s": round(up, 1), "seconds": round(wall, 2), "replies_per_s": round(rows / wall, 2), "tokens_per_s": round(toks / wall, 1)}


class Table:
    """Rows printed as they are measured (a crash part-way still shows what ran), kept for ``--out``."""

    def __init__(self, width: int = 30):
        self.width, self.rows = width, {}

    def add(self, key: str, value) -> None:
        self.rows[key] = value
        print(f"{key:<{self.width}}  {value}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="a toy model on CPU (checks the script, measures nothing)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rows", type=int, default=64, help="episode threads decoding at once")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    import torch

    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA GPU here; run on the GPU box, or --tiny on CPU")
    tokens = min(args.tokens, 256) if args.tiny else args.tokens
    t = Table()
    t.add("device", torch.cuda.get_device_name() if device == "cuda" else "CPU (toy size)")
    t.add("model", "toy Qwen3" if args.tiny else "Qwen3-8B architecture, random bf16")
    t0 = time.perf_counter()
    model = make_model(TINY if args.tiny else QWEN3_8B, device, torch.float32 if args.tiny else torch.bfloat16)
    t.add("built in s", f"{time.perf_counter() - t0:.1f}")
    sft = sft_rate(model, tokens, 2 if args.tiny else args.steps, 1 if args.tiny else 2, device)
    model = sft.pop("_model")
    for key, v in (("SFT tokens per step", sft["tokens"]), ("SFT step (s)", sft["step_s"]), ("SFT tokens/s", f"{sft['tokens_per_s']:,.0f}"),
                   ("SFT MFU (989 TFLOP/s bf16)", f"{100 * sft['mfu']:.2g}%"), ("SFT HFU (with recompute)", f"{100 * sft['hfu']:.2g}%"),
                   ("LoRA parameters", f"{sft['lora_params']:,}"), ("peak GPU memory (GiB)", sft["peak_mem_gib"])):
        t.add(key, v)
    rows, words, new = (8, 80, 16) if args.tiny else (args.rows, 700, 64)
    gen = generation_rate(model, rows, words, new, device)
    for key, v in (("rollout rows at once", gen["rows"]), ("rollout prompt tokens", gen["prompt_tokens"]),
                   ("rollout replies/s (hf)", gen["replies_per_s"]), ("rollout tokens/s (hf)", f"{gen['tokens_per_s']:,.0f}")):
        t.add(key, v)
    try:
        vl = vllm_rate(model, rows, words, new, device, "float32" if args.tiny else "bfloat16")
    except Exception as e:  # the other figures stand; the line says what vLLM refused
        vl = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    if vl is None:
        t.add("rollout (vLLM)", "not measured: vllm is not installed")
    elif "error" in vl:
        t.add("rollout (vLLM)", f"failed: {vl['error']}")
    else:
        t.add("vLLM engine up (s)", vl["engine_up_s"])
        t.add("rollout replies/s (vLLM)", vl["replies_per_s"])
        t.add("rollout tokens/s (vLLM)", f"{vl['tokens_per_s']:,.0f}")
    t.add("wall s", f"{time.perf_counter() - t0:.0f}")
    if args.out:
        args.out.write_text(json.dumps({"table": t.rows, "sft": sft, "generation": gen, "vllm": vl}, indent=2, default=str))


if __name__ == "__main__":
    main()
