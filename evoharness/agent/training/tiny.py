"""The tiny CPU profile's base model: a word-level tokenizer built from the ALFWorld vocabulary and a
seeded Qwen3-architecture model made from a config, saved as a normal Hugging Face checkpoint."""

from __future__ import annotations

import json
import re
from pathlib import Path

from evoharness.agent import tokens
from evoharness.core.errors import EvoError

SPECIAL = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def vocabulary(texts: list[str]) -> list[str]:
    """Every word of the games' world (alfworld's object and receptacle names, the grammar, the
    prompt's fixed text, meta-actions, numbers) plus every word of the given texts."""
    words: set[str] = set()
    for t in corpus(texts):
        words.update(tokens.words(t))
    return sorted(words)


def build_tokenizer(vocab: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    table = {tok: i for i, tok in enumerate(SPECIAL + [w for w in vocab if w not in SPECIAL])}
    tk = Tokenizer(models.WordLevel(vocab=table, unk_token="<unk>"))
    # The pattern describes the tokens; everything between them (whitespace) is dropped.
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(tokens.PATTERN), behavior="removed", invert=True)
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>", bos_token=None, eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# Qwen2/Qwen3's pre-tokenizer split (their tokenizer.json): letters with one leading non-letter, single
# digits, punctuation runs, whitespace. With it ``<action>`` cannot become one token, as in Qwen3.
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
              r"\s+(?!\S)|\s+")


def build_bpe_tokenizer(texts: list[str], vocab_size: int = 2048):
    """A byte-level BPE tokenizer shaped like Qwen3's, trained on ``texts``: Qwen's split, byte-level
    decoding (whitespace kept, so a reply decodes to exactly its text), ``<think>`` and ``</think>`` as
    added tokens, and ``<action>`` / ``</action>`` left to BPE, so each takes several tokens as in Qwen3.
    The toy GPU profile's base uses it, so that its code path meets a real model's tokenizer."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tk.train_from_iterator(texts, trainer)
    tk.add_tokens([AddedToken("<think>", special=False, normalized=False), AddedToken("</think>", special=False, normalized=False)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token=None, pad_token="<pad>", bos_token=None, eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def corpus(texts: list[str]) -> list[str]:
    """The text a tiny tokenizer is built from: the world's fixed text (the prompt's, the grammar's, every
    object and receptacle name, numbers, the chat template's role names) and ``texts``."""
    import alfworld.gen.constants as c

    from evoharness.agent.alfworld.scenes import grammar_text
    from evoharness.agent.episode import VERB_HELP, system_text
    from evoharness.agent.harness.workspace import META_VERBS

    names = [o.lower() for o in c.OBJECTS] + [r.lower() for r in c.RECEPTACLES] + ["sinkbasin", "bathtubbasin"]
    return [system_text(META_VERBS), " ".join(VERB_HELP.values()), grammar_text(), " ".join(names), " ".join(str(i) for i in range(100)),
            "system user assistant", *texts]


def build_model(vocab_size: int, cfg: dict, seed: int):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["kv_heads"],
        head_dim=cfg["hidden_size"] // cfg["heads"],
        max_position_embeddings=cfg["max_length"],
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=3,
        bos_token_id=None,
        use_cache=True,
    )
    return Qwen3ForCausalLM(config)


def make_tiny_base(demos: Path, out: Path, cfg: dict, seed: int, timing: Path | None = None, tokenizer: str = "word") -> dict:
    """Tokenizer + model from the demos' prompts and responses and the world's vocabulary. ``tokenizer``:
    ``word`` (one token per word, the tags included) or ``byte-bpe`` (``build_bpe_tokenizer``: like
    Qwen3's, the action tags split).

    ``out`` holds only what the seed and inputs determine, so a re-run gives the same bytes (and DVC
    the same hash); wall-clock figures go to ``timing``, outside the hashed output."""
    from evoharness.agent.rollout import read_jsonl

    records, _ = read_jsonl(demos)
    texts = [t["prompt"] + " " + t["response"] for r in records for t in r.get("turns", [])]
    if tokenizer == "word":
        tok = build_tokenizer(vocabulary(texts))
    elif tokenizer == "byte-bpe":
        tok = build_bpe_tokenizer(corpus(texts))
    else:
        raise EvoError(f"base model: unknown tokenizer {tokenizer!r} (word or byte-bpe)")
    model = build_model(len(tok), cfg, seed)
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out)
    pre = {}
    if cfg.get("pretrain_epochs", 0) > 0:
        prompts = [t["prompt"] for r in records for t in r.get("turns", [])]
        if not prompts:
            raise EvoError(f"base model: {demos} has no turns to pretrain on (pretrain_epochs is {cfg['pretrain_epochs']})")
        pre = pretrain(model, tok, prompts, cfg, seed)
    clock = {k: pre.pop(k) for k in ("seconds", "tokens_per_s") if k in pre}
    model.save_pretrained(out, safe_serialization=True)
    info = {"vocab_size": len(tok), "parameters": sum(p.numel() for p in model.parameters()), **cfg, "seed": seed, "pretrain": pre,
            **({"tokenizer": tokenizer} if tokenizer != "word" else {})}  # the word tokenizer's bases stay byte-identical
    (out / "base_info.json").write_text(json.dumps(info, indent=2, sort_keys=True))
    if timing:
        Path(timing).parent.mkdir(parents=True, exist_ok=True)
        Path(timing).write_text(json.dumps(clock))
    return {**info, "timing": clock}


def pretrain(model, tok, prompts: list[str], cfg: dict, seed: int) -> dict:
    """Language modelling on the games' text: the tiny base's stand-in for a pretrained model's
    pretraining. Only the prompts the policy reads (observations, admissible commands, histories,
    panels), never the teacher's replies, so SFT still learns every decision from its own loss.

    Without it a 2-layer model trained on replies alone does not learn to look back at its
    context: it answers with the most frequent object whatever the objective names. The prompts
    repeat names from one field in another (observation, commands, history, plan, hints), which
    teaches exactly that copying."""
    import math
    import random
    import time

    import torch

    from evoharness.agent.chat_format import render
    from evoharness.agent.training import shared_head

    torch.set_num_threads(max(1, int(cfg.get("threads", 2))))
    torch.manual_seed(seed)
    seqs = [tok(render(tok, p), add_special_tokens=False)["input_ids"][: cfg["max_length"]] for p in prompts]
    batch, lr = 16, float(cfg.get("pretrain_lr", 3e-3))
    steps = max(1, math.ceil(cfg["pretrain_epochs"] * len(seqs) / batch))
    warmup = max(1, steps // 10)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup))))
    rng = random.Random(seed)
    shared_head.install(model)  # the system text runs once per batch (shared_head's docstring)
    model.train()
    t0, losses, tokens, plan = time.time(), [], 0, []
    for step in range(steps):
        if not plan:
            plan = length_grouped([len(x) for x in seqs], batch, rng)
        rows = [seqs[i] for i in plan.pop()]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for j, r in enumerate(rows):
            ids[j, : len(r)] = torch.tensor(r)
            mask[j, : len(r)] = 1
        labels = ids.masked_fill(mask == 0, -100)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        tokens += int(mask.sum())
    model.eval()
    wall = time.time() - t0
    return {"prompts": len(prompts), "epochs": cfg["pretrain_epochs"], "steps": steps, "first_loss": round(losses[0], 4),
            "last_loss": round(sum(losses[-10:]) / len(losses[-10:]), 4), "tokens_per_s": round(tokens / max(wall, 1e-6), 1), "seconds": round(wall, 1)}


def length_grouped(lengths: list[int], batch: int, rng, mega: int = 50) -> list[list[int]]:
    """One pass over the rows as batches of similar length, as transformers' LengthGroupedSampler
    makes them: a random order cut into groups of ``mega`` batches, each group sorted by length and
    cut into batches, the batches in random order. Padding falls from about 16 % of a batch's
    tokens to about 1 %; every row is used once per pass."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    out = []
    for g in range(0, len(order), batch * mega):
        group = sorted(order[g : g + batch * mega], key=lambda i: -lengths[i])
        out += [group[k : k + batch] for k in range(0, len(group), batch)]
    rng.shuffle(out)
    return out


def roundtrip_ok(tok, text: str) -> bool:
    """Decoding the encoding gives back the same words (whitespace normalised)."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    back = tok.decode(ids, skip_special_tokens=True)
    norm = lambda s: re.sub(r"\s+", " ", " ".join(tokens.words(s))).strip()  # noqa: E731
    return norm(back) == norm(text)
