"""The cost-aware GRPO reward (DESIGN.md section 1), paid at the end of an episode.

R = 10·won + λ_eff·1[won]·(T_max − |τ|)/T_max + λ_div(u)·R_div − λ_spam·min(repeats, 10) − λ_inv·invalid
λ_div(u) = λ_div_max · ½ · (1 + cos(π · min(u, U) / U))

``repeats`` counts spam: a meta-action identical to one made since the last env action, whose
answer cannot have changed. ``track egg`` after each fruitless visit is a search, not spam.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

from evoharness.agent.harness.workspace import META_VERBS


class RewardConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    success: float = 10.0
    eff: float = 1.0
    div_max: float = 1.0
    spam: float = 0.1
    inv: float = 0.1
    updates: int = 150  # U: policy updates over which the diversity weight anneals to 0


def diversity_weight(u: int, cfg: RewardConfig) -> float:
    U = max(cfg.updates, 1)
    return cfg.div_max * 0.5 * (1.0 + math.cos(math.pi * min(u, U) / U))


def components(won: bool, steps: int, t_max: int, calls: dict[str, int], repeats: int, invalid: int) -> dict[str, float]:
    """The unweighted parts of the reward; ``total`` combines them for a given update u."""
    return {
        "success": 1.0 if won else 0.0,
        "efficiency": (max(t_max - steps, 0) / t_max) if (won and t_max > 0) else 0.0,
        "diversity": sum(1 for v in META_VERBS if calls.get(v, 0) > 0) / len(META_VERBS),
        "repeats": float(min(repeats, 10)),
        "invalid": float(invalid),
    }


def total(comp: dict[str, float], u: int, cfg: RewardConfig) -> float:
    return (
        cfg.success * comp["success"]
        + cfg.eff * comp["efficiency"]
        + diversity_weight(u, cfg) * comp["diversity"]
        - cfg.spam * comp["repeats"]
        - cfg.inv * comp["invalid"]
    )
