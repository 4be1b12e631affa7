"""Multi-GPU launch for the h200 profile: ``accelerate launch`` with DeepSpeed ZeRO-3 (files in
configs/), bf16, gradient checkpointing. The local profile runs in-process."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from evoharness.errors import EvoError
from evoharness.training.profiles import Profile

ACCELERATE_CONFIG = "configs/accelerate_h200.yaml"


def under_launcher() -> bool:
    return "LOCAL_RANK" in os.environ or "ACCELERATE_PROCESS_ID" in os.environ


def launch_argv(profile: Profile, cli_args: list[str], root: Path) -> list[str] | None:
    """The argv that re-runs this CLI command under accelerate, or None to run in-process."""
    if profile.launcher != "accelerate" or under_launcher():
        return None
    cfg = root / ACCELERATE_CONFIG
    ds = root / profile.deepspeed_config
    for f in (cfg, ds):
        if not f.exists():
            raise EvoError(f"profile {profile.name}: {f} does not exist")
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg), "--num_processes", str(profile.num_processes),
            "-m", "evoharness.cli", *cli_args]


def resolved_deepspeed(profile: Profile, root: Path, micro_batch: int, grad_accum: int, world_size: int = 1, hidden_size: int = 4096) -> dict:
    """The DeepSpeed config with its "auto" fields filled as the HF Trainer fills them (the bucket
    sizes follow the model's hidden size: 4096 for Qwen3-8B)."""
    from types import SimpleNamespace

    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    path = root / profile.deepspeed_config
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise EvoError(f"DeepSpeed config {path}: {e}") from None
    args = TrainingArguments(output_dir="/tmp/evoharness-ds-check", per_device_train_batch_size=micro_batch, gradient_accumulation_steps=grad_accum,
                             bf16=False, use_cpu=True, report_to=[], max_grad_norm=1.0)
    hf = HfTrainerDeepSpeedConfig(raw)
    hf.trainer_config_process(args)
    hf.trainer_config_finalize(args, model=SimpleNamespace(config=SimpleNamespace(hidden_size=hidden_size)), num_training_steps=100)
    cfg = hf.config
    cfg["train_batch_size"] = micro_batch * grad_accum * world_size
    return cfg


def validate_deepspeed(profile: Profile, root: Path, micro_batch: int, grad_accum: int, hidden_size: int = 4096):
    """Parse the resolved config with DeepSpeed's own parser (on CPU, world size 1)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = resolved_deepspeed(profile, root, micro_batch, grad_accum, 1, hidden_size)
    return DeepSpeedConfig(cfg)
