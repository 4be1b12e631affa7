"""Typed, validated parameters (``params.yaml``). A wrong field fails at load, naming it."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from evoharness.agent.alfworld.families import DEFAULT_UNSEEN_SCENES, FAMILIES
from evoharness.agent.episode import EpisodeConfig
from evoharness.core.errors import EvoError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GamesParams(_Strict):
    per_family: dict[str, int] = Field(default_factory=lambda: {"train": 8, "valid_seen": 3, "valid_unseen": 3})
    families: list[str] = Field(default_factory=lambda: list(FAMILIES))
    unseen_scenes: list[int] = Field(default_factory=lambda: list(DEFAULT_UNSEEN_SCENES))
    max_per_type: int = Field(4, ge=1)
    distractors: int = Field(4, ge=0)
    max_expert_steps: int = Field(60, ge=5)

    @field_validator("per_family")
    @classmethod
    def _splits(cls, v: dict[str, int]) -> dict[str, int]:
        bad = set(v) - {"train", "valid_seen", "valid_unseen"}
        if bad:
            raise ValueError(f"unknown split(s) {sorted(bad)}")
        if any(n < 0 for n in v.values()):
            raise ValueError("counts must be >= 0")
        return v

    @field_validator("families")
    @classmethod
    def _families(cls, v: list[str]) -> list[str]:
        bad = [f for f in v if f not in FAMILIES]
        if bad:
            raise ValueError(f"unknown families {bad}")
        return v


class GrpoGamesParams(_Strict):
    """GRPO's own training games (the grpo_games stage): generated like `games` (its families and limits),
    from another seed, sharing no PDDL problem with any game of `games`."""
    seed: int = 1
    per_family: dict[str, int] = Field(default_factory=lambda: {"train": 64})

    @field_validator("per_family")
    @classmethod
    def _train_only(cls, v: dict[str, int]) -> dict[str, int]:
        if set(v) != {"train"} or v["train"] < 1:
            raise ValueError("only train games, at least 1 per family (GRPO is evaluated on the games stage's valid splits)")
        return v


OFFICIAL_PANEL = {  # ALFWorld's valid splits, games per task type
    "valid_seen": {"pick_and_place_simple": 35, "pick_clean_then_place_in_recep": 27, "pick_heat_then_place_in_recep": 16,
                   "pick_cool_then_place_in_recep": 25, "look_at_obj_in_light": 13, "pick_two_obj_and_place": 24},
    "valid_unseen": {"pick_and_place_simple": 24, "pick_clean_then_place_in_recep": 31, "pick_heat_then_place_in_recep": 23,
                     "pick_cool_then_place_in_recep": 21, "look_at_obj_in_light": 18, "pick_two_obj_and_place": 17},
}


class PanelParams(_Strict):
    """The evaluation panel the evaluate stage, the baselines and the gate use (stage ``panel``): generated once at the
    official splits' size and composition, from its own seed, sharing no PDDL problem with ``games`` (the dev panel and
    the demos' games) or ``grpo_games``; ``digest`` pins it (a generator that would make another panel fails the stage)."""
    seed: int = 2608
    per_family: dict[str, dict[str, int]] = Field(default_factory=lambda: {k: dict(v) for k, v in OFFICIAL_PANEL.items()})
    digest: str = Field("", description="sha256 of the panel's files (the panel stage prints it); empty: not pinned")

    @field_validator("per_family")
    @classmethod
    def _counts(cls, v: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
        if set(v) - {"valid_seen", "valid_unseen"}:
            raise ValueError(f"only valid_seen and valid_unseen (got {sorted(v)})")
        for split, fams in v.items():
            bad = [f for f in fams if f not in FAMILIES]
            if bad or any(not isinstance(n, int) or n < 0 for n in fams.values()):
                raise ValueError(f"{split}: families must be known ({bad}) and counts whole numbers >= 0")
        return v


class DemosParams(_Strict):
    n: int = Field(96, ge=1)
    react_n: int = Field(0, ge=0, description="episodes the env_only teacher plays for ReAct-SFT (collect --react); it wins a little "
                         "less often than the inline one, and pairs_react needs as many successful episodes as SFT-inline's. 0: 1.25 x n")
    noise: float = Field(0.3, ge=0.0, le=1.0)
    batch_size: int = Field(16, ge=1)


class PairsParams(_Strict):
    val_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    few_shot: int = Field(0, ge=0, description="exemplars per family added to every prompt (0: none)")
    imitate_detours: bool = Field(False, description="keep the teacher's random noise steps as SFT targets")


class ValidateParams(_Strict):
    max_tokens: int = Field(1024, ge=16, description="prompt + response length limit (the profile's max length)")


class EvalParams(_Strict):
    seeds: list[int] = Field(default_factory=lambda: [0])
    baselines: list[str] = Field(default_factory=lambda: ["teacher", "random"])
    bank: Literal["frozen", "evolve"] = Field("frozen", description="the Experience bank during evaluation: frozen (the reported "
                                              "figures), or evolved between windows of consolidator.window episodes (checkpointed, resumable)")


class ConsolidatorParams(_Strict):
    """Who edits the Experience bank between GRPO batches and between evolving evaluation's windows."""
    endpoint: str = Field("rules", description="rules; chat:base_url=...,model=...[,api_key_env=VAR] (any OpenAI-compatible server); "
                          "hf:path=<checkpoint> (a local model, the student)")
    window: int = Field(20, ge=1, description="evolving evaluation: episodes per consolidation")

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        if v == "rules":
            return v
        kind, _, rest = v.partition(":")  # the policy spec's shape (policies.spec parses it fully where it is used)
        opts = dict(item.partition("=")[::2] for item in filter(None, rest.split(",")))
        if kind not in ("chat", "hf"):
            raise ValueError(f"expected rules, chat:... or hf:... (got {kind!r})")
        if kind == "chat" and not (opts.get("base_url") and opts.get("model")) or kind == "hf" and not opts.get("path"):
            raise ValueError("chat needs base_url and model, hf needs path")
        return v


POOL_STAGES = ["base_model", "sft_inline", "sft_env_only", "grpo", "evaluate"]


class PoolParams(_Strict):
    """How a retrain given a work pool (``--pool``) runs its jobs there."""
    stages: list[str] = Field(default_factory=lambda: list(POOL_STAGES),
                              description="the stages that run on the pool (every stage that reads or makes a model)")
    silence_s: float = Field(90, ge=60, description="a job with no heartbeat for this long (the server answering) is cancelled; "
                             "three of prefect.yaml's 30-second heartbeats")
    fence_s: float = Field(600, ge=600, description="a job that has not reached the Prefect server for this long stops its stage; the "
                           "orchestrator declares it lost only this long (plus a margin) after the server is back")
    time_limit_s: dict[str, dict[str, float]] = Field(default_factory=dict, description="per profile, per stage (key 'default': every other "
                                                      "stage): a job running longer is killed and the retrain fails")
    stay_on_remote: list[str] = Field(default_factory=lambda: ["data/models"],
                                      description="outputs a pool retrain never pulls onto the scheduler (the weights): they stay on the DVC remote "
                                      "and the boxes, and the gate reads the evaluation, the config and the DVC hashes that bind them")

    @field_validator("time_limit_s")
    @classmethod
    def _limits(cls, v: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        for prof, limits in v.items():
            bad = [k for k, s in (limits or {}).items() if not isinstance(s, (int, float)) or s <= 0]
            if bad:
                raise ValueError(f"{prof}: time limits must be positive seconds ({bad})")
        return v

    def time_limit(self, profile: str, stage: str) -> float:
        limits = self.time_limit_s.get(profile) or {}
        return float(limits.get(stage) or limits.get("default") or 6 * 3600)


class Params(_Strict):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    seed: int = 0
    profile: str = "tiny-cpu"
    workers: int = Field(2, ge=1)
    games: GamesParams = GamesParams()
    grpo_games: GrpoGamesParams = GrpoGamesParams()
    panel: PanelParams = PanelParams()
    episode: EpisodeConfig = EpisodeConfig()
    demos: DemosParams = DemosParams()
    pairs: PairsParams = PairsParams()
    validate_: ValidateParams = Field(ValidateParams(), alias="validate")
    eval: EvalParams = EvalParams()
    consolidator: ConsolidatorParams = ConsolidatorParams()
    pool: PoolParams = PoolParams()


def _one_line(e: ValidationError, where: str) -> str:
    parts = []
    for err in e.errors()[:3]:
        loc = ".".join(str(x) for x in err["loc"])
        parts.append(f"{loc}: {err['msg']} (got {err.get('input')!r})"[:200])
    return f"{where}: " + "; ".join(parts)


def load_params(path: str | Path | None = "params.yaml") -> Params:
    """Load and validate params; a missing default file means defaults, a missing named file is an error."""
    if path is None:
        return Params()
    p = Path(path)
    if not p.exists():
        if str(path) == "params.yaml":
            return Params()
        raise EvoError(f"params file {p} does not exist")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except OSError as e:
        raise EvoError(f"params file {p}: cannot be read ({e.strerror or type(e).__name__})") from None
    except UnicodeDecodeError:
        raise EvoError(f"params file {p}: not UTF-8 text") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise EvoError(f"{p}{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(raw, dict):
        raise EvoError(f"{p}: expected a mapping at the top level, got {type(raw).__name__}")
    known = {f.alias or name for name, f in Params.model_fields.items()}
    unknown = [k for k in raw if k not in known and k not in _FOREIGN_OK]
    if unknown:
        raise EvoError(f"{p}: unknown top-level key(s) {unknown} (known: {sorted(known | _FOREIGN_OK)})")
    # Sections owned by later stages are validated by those stages, not here.
    raw = {k: v for k, v in raw.items() if k in known}
    try:
        return Params(**raw)
    except ValidationError as e:
        raise EvoError(_one_line(e, str(p))) from None


# Sections read by other parts of the pipeline (training profiles, tracking, promotion).
_FOREIGN_OK = {"profiles", "sft", "grpo", "promotion", "tracking", "remote"}
