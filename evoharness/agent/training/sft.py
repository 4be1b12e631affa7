"""SFT with TRL's SFTTrainer on the pairs: loss on the response only, evaluation on the val split,
checkpoints, resume after a kill, metrics to a JSON the DVC stage declares.

With LoRA (the GPU profile and tiny-dist), the adapter is saved under ``<out>/adapter`` and merged into
its base as a full checkpoint in ``<out>``: GRPO, evaluation and the registry load the same folder.
Under ``accelerate launch`` every process trains; only the main one merges and writes metrics."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from evoharness.agent.chat_format import render
from evoharness.agent.training.profiles import Profile
from evoharness.core.errors import EvoError


def load_rows(pairs_dir: Path, mode: str):
    from evoharness.agent.pairs import load_pairs, project_env_only

    df = load_pairs(pairs_dir)
    already = len(df) > 0 and bool((df["kind"] == "env").all()) and not df["prompt"].str.contains("track [query]", regex=False).any()
    if mode not in ("inline", "env_only"):
        raise EvoError(f"sft mode must be inline or env_only, got {mode!r}")
    if mode == "env_only" and not already:  # inline demos: re-prompted as env_only (an env_only teacher's pairs are used as they are)
        df = project_env_only(df)
    return df[df.split == "train"], df[df.split == "val"]


def to_dataset(df, tok):
    """Pre-rendered prompt text (the same ``render`` the HF policy uses) and the response + EOS."""
    from datasets import Dataset

    return Dataset.from_dict({
        "prompt": [render(tok, p) for p in df.prompt],
        "completion": [r + tok.eos_token for r in df.response],
    })


def file_digest(*paths: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        p = Path(p)
        h.update(p.name.encode())
        if p.is_file():
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()[:16]


KEEP_CONFIGS = 2


def checkpoint_key(**parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def keyed_checkpoints(ckpts: Path, **parts) -> Path:
    """The checkpoint folder of one configuration (inputs and settings, not the step budget):
    a killed run resumes from it, while changed inputs or settings start afresh instead of
    resuming someone else's state. The two most recent configurations are kept. Called by the
    main process only (the others use ``Path(ckpts) / checkpoint_key(**parts)``)."""
    key = checkpoint_key(**parts)
    ckpts = Path(ckpts)
    ckpts.mkdir(parents=True, exist_ok=True)
    here = ckpts / key
    here.mkdir(exist_ok=True)
    (here / "config-key.json").write_text(json.dumps(parts, sort_keys=True, default=str, indent=1))
    os.utime(here)
    others = sorted((d for d in ckpts.iterdir() if d.is_dir() and d != here and (d / "config-key.json").exists()),
                    key=lambda d: d.stat().st_mtime, reverse=True)
    for old in others[KEEP_CONFIGS - 1 :]:
        shutil.rmtree(old, ignore_errors=True)
    return here


def last_checkpoint(ckpt_dir: Path) -> str | None:
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(str(ckpt_dir)) if ckpt_dir.is_dir() else None


def train_sft(pairs_dir: Path, base_dir: Path, out_dir: Path, profile: Profile, mode: str = "inline", seed: int = 0, max_steps: int | None = None,
              checkpoints: Path | None = None, timing: Path | None = None, root: Path | None = None) -> dict:
    """Train and save the model to ``out_dir``. ``checkpoints`` (default ``out_dir/../<name>-checkpoints``)
    survives a kill: the next run resumes from its last checkpoint. Wall-clock figures go to
    ``timing``, outside any hashed output. Returns the metrics (the same on every process)."""
    import torch
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from evoharness.agent.training import distributed as dist
    from evoharness.agent.training import shared_head
    from evoharness.agent.training.checkpoint import check_checkpoint, load_for_training, resolve_checkpoint, run_loss, weights_digest

    s = profile.sft
    root = Path(root or Path.cwd())
    base_dir = check_checkpoint(resolve_checkpoint(base_dir, root), "base model")
    torch.set_num_threads(max(1, s.threads))
    out_dir = Path(out_dir)
    train_df, val_df = load_rows(Path(pairs_dir), mode)
    if len(train_df) == 0:
        raise EvoError(f"no training pairs in {pairs_dir}")
    ckroot = Path(checkpoints) if checkpoints else out_dir.parent / f"{out_dir.name}-checkpoints"
    key_parts = dict(sft=s.model_dump(), base=weights_digest(base_dir), mode=mode, seed=seed, processes=profile.num_processes,
                     pairs=file_digest(Path(pairs_dir) / "train.parquet", Path(pairs_dir) / "val.parquet"))
    ckpts = ckroot / checkpoint_key(**key_parts)
    cfg = dist.training_args(
        SFTConfig, profile, root,
        output_dir=str(ckpts),
        max_length=s.max_length,
        num_train_epochs=s.epochs,
        max_steps=max_steps if max_steps is not None else s.max_steps,
        per_device_train_batch_size=s.batch_size,
        per_device_eval_batch_size=s.batch_size,
        gradient_accumulation_steps=s.grad_accum,
        learning_rate=s.learning_rate,
        lr_scheduler_type=s.scheduler,
        warmup_steps=s.warmup_ratio,  # transformers 5: a float below 1 is a fraction of the steps
        logging_steps=5,
        eval_strategy="steps" if len(val_df) else "no",
        eval_steps=s.eval_steps,
        save_strategy="steps",
        save_steps=s.save_steps,
        save_total_limit=2,
        completion_only_loss=True,
        report_to=[],
        seed=seed,
        bf16=s.bf16,
        gradient_checkpointing=s.gradient_checkpointing,
        dataloader_num_workers=0,
        disable_tqdm=True,
        train_sampling_strategy="group_by_length" if s.group_by_length else "random",
    )
    if dist.is_main():
        keyed_checkpoints(ckroot, **key_parts)
    dist.wait_for_everyone()
    tok = AutoTokenizer.from_pretrained(base_dir)
    model, loaded_partitioned, peft_config = load_for_training(base_dir, profile.base.dtype, s.lora, s.lora_r, s.lora_alpha)
    if dist.single_process(profile) and not s.lora:
        shared_head.install(model)  # the rows' system text runs once per batch (shared_head's docstring)
    trainer = SFTTrainer(model=model, args=cfg, train_dataset=to_dataset(train_df, tok),
                         eval_dataset=to_dataset(val_df, tok) if len(val_df) else None, processing_class=tok, peft_config=peft_config)
    resume = last_checkpoint(ckpts)
    t0 = time.time()
    result = trainer.train(resume_from_checkpoint=resume)
    wall = time.time() - t0
    ev = trainer.evaluate() if len(val_df) else {}
    save_trained(trainer, tok, base_dir, out_dir, s.lora, profile.base.path if profile.base.kind == "pretrained" else "")
    ds = to_dataset(train_df, tok)
    n_tokens = int(sum(len(tok(p + c, add_special_tokens=False)["input_ids"]) for p, c in zip(ds["prompt"], ds["completion"])))
    rows_seen = int(result.global_step) * s.batch_size * s.grad_accum * profile.num_processes
    metrics = {
        "mode": mode,
        "train_rows": len(train_df),
        "val_rows": len(val_df),
        "steps": int(result.global_step),
        "train_loss": run_loss(trainer, result, resume is not None),
        "eval_loss": round(float(ev.get("eval_loss", float("nan"))), 4) if ev else None,
        "resumed_from": os.path.basename(resume) if resume else None,
        "epochs": s.epochs,
        "tokens_per_epoch": n_tokens,
        "lora": s.lora,
        "launch": dist.describe(trainer.accelerator, loaded_partitioned),
    }
    tokens_seen = rows_seen * n_tokens / max(len(train_df), 1)
    if timing and dist.is_main():
        Path(timing).parent.mkdir(parents=True, exist_ok=True)
        Path(timing).write_text(json.dumps({"seconds": round(wall, 1), "train_runtime": round(float(result.metrics.get("train_runtime", wall)), 1),
                                            "tokens_per_s": round(tokens_seen / max(float(result.metrics.get("train_runtime", wall)), 1e-6), 1)}))
    return metrics


def save_trained(trainer, tok, base_dir: Path, out_dir: Path, lora: bool, base_ref: str = "") -> None:
    """The trained model as a full checkpoint in ``out_dir``. Every process takes part in saving (under
    ZeRO-3 the weights are gathered); with LoRA the main process then merges the adapter into the
    base it was trained on. The folder holds nothing else from an earlier run, and nothing of this
    machine: the adapter names its base by ``base_ref`` (the profile's path, or the stage's input),
    never by this machine's absolute path."""
    from evoharness.agent.training import distributed as dist
    from evoharness.agent.training.checkpoint import ADAPTER, merge_lora

    out_dir = Path(out_dir)
    if dist.is_main() and out_dir.exists():
        shutil.rmtree(out_dir)
    dist.wait_for_everyone()
    if lora:
        trainer.save_model(str(out_dir / ADAPTER))
        if dist.is_main():
            merge_lora(base_dir, out_dir / ADAPTER, out_dir)
            cfg_path = out_dir / ADAPTER / "adapter_config.json"
            cfg = json.loads(cfg_path.read_text())
            cfg["base_model_name_or_path"] = base_ref or (str(base_dir) if not Path(base_dir).is_absolute() else Path(base_dir).name)
            cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    else:
        trainer.save_model(str(out_dir))
        if dist.is_main():
            tok.save_pretrained(str(out_dir))
    if dist.is_main():
        for junk in ("training_args.bin", f"{ADAPTER}/training_args.bin", f"{ADAPTER}/README.md", "README.md"):
            (out_dir / junk).unlink(missing_ok=True)  # not the model: a pickle of this run's arguments
    dist.wait_for_everyone()
