"""Hardware profiles: one code path, two configs. A wrong field fails at load, naming it."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from evoharness.errors import EvoError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BaseModelSpec(_Strict):
    """``tiny``: built from this config and seeded; ``pretrained``: a local path or hub id, never
    downloaded at test time (``HF_HUB_OFFLINE`` is honoured)."""

    kind: Literal["tiny", "pretrained"]
    path: str = ""
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


class GRPOSpec(_Strict):
    games_per_step: int = Field(16, ge=1)
    rollouts: int = Field(8, ge=2, description="rollouts of the same game in a group")
    turns_per_rollout: int = Field(4, ge=1, description="turns sampled from each rollout as training rows")
    steps: int = Field(150, ge=1)
    learning_rate: float = Field(1e-6, gt=0)
    beta: float = Field(0.01, ge=0, description="KL coefficient")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="advantage scaling (TRL): 'group' divides by the group's reward std, which in a group that all "
        "failed blows the small diversity/spam differences up to the size of a win; 'none' (Dr. GRPO) keeps a win worth 10")
    temperature: float = Field(1.0, gt=0)
    max_new_tokens: int = Field(512, ge=8)
    max_steps_per_episode: int = Field(70, ge=1)
    charge_meta_actions: bool = True
    use_vllm: bool = Field(False, description="generate rollouts with a vLLM server (`trl vllm-serve`) when vllm is installed")
    vllm_mode: Literal["server"] = Field("server", description="episodes call the generator turn by turn from worker threads, so a "
                                         "server (HTTP, no collectives); colocate's gathered generate would deadlock across ranks")
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
    eval_games_per_family: int = Field(10, ge=1)
    eval_max_steps: int = Field(0, ge=0, description="step budget of model episodes in the evaluate stage (0: episode.max_steps)")
    eval_max_turns: int = Field(0, ge=0, description="turn budget (env + uncharged meta-actions) of model episodes in the evaluate "
                                "stage (0: twice the step budget)")
    decoding: Literal["constrained", "free"] = Field("constrained", description="constrained: every response is well formed and its "
                                                     "action admissible or a meta-verb (policies/constrain.py); free: plain sampling")
    episode_workers: int = Field(8, ge=1, description="environment workers for the model's episodes in evaluate and GRPO; their turns "
                                 "are decoded together as one batch")

    @model_validator(mode="after")
    def _launch(self):
        if self.launcher == "accelerate" and not self.deepspeed_config:
            raise ValueError("launcher accelerate needs deepspeed_config (a file under configs/)")
        return self


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
