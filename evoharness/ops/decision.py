"""The promotion gate: every evaluated GRPO model becomes a registered model version (alias
``challenger``); the alias ``champion`` moves to it only if every check passes:

- seen and unseen success reach the profile's thresholds (an errored episode counts as a failure),
  and no more than ``max_errored`` of its episodes errored;
- it beats, on the same games, the model it was trained from and the base and random baselines
  (``must_beat``: more wins over both splits together);
- it is not worse, split by split, than the model it was trained from (``no_regression``): game by
  game, McNemar's exact one-sided test must not find it worse at ``alpha`` on either split, so a gain
  on one split cannot hide a loss on the other;
- it does not regress against the current champion: compared game by game on the same games under
  the same evaluation conditions, McNemar's exact test (one-sided) must not find it worse at ``alpha``,
  and a champion evaluated under other conditions is not compared at all (the check fails, naming the
  difference);
- it is not below the best champion so far (under these conditions) by more than ``tolerance``: a
  chain of promotions cannot drift down.

The gate fails closed: when it cannot read the champion, a metric is missing or not a number, or the
champion lacks its evaluation record, it raises one line and nothing moves. Its steps (register, tag,
describe, move the aliases) are idempotent and the version carries ``decision.state``: a retried gate
finds a ``pending`` version by its DVC hash and completes that decision instead of reporting one.

The decision, each check (value, threshold, result) and the conditions are version tags; the version's
description is the reviewer's page (markdown, rendered by the MLflow UI): the decision, the checks, the
per-family table beside the champion's, and the annealing plot.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from evoharness.agent.alfworld.families import FAMILIES
from evoharness.core.errors import EvoError
from evoharness.ops.evidence import (
    CONDITION_KEYS,
    SPLITS,
    Evidence,
    check_reference_conditions,
    condition_difference,
    conditions_hash,
    mcnemar_worse,
    paired_wins,
)


class Thresholds(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    min_seen: float = Field(ge=0, le=1, description="valid_seen success the candidate must reach")
    min_unseen: float = Field(ge=0, le=1, description="valid_unseen success the candidate must reach")
    tolerance: float = Field(0.02, ge=0, le=1, description="how far below the best champion so far either split may be")
    max_errored: float = Field(0.05, ge=0, le=1, description="the largest share of the candidate's episodes that may error")
    alpha: float = Field(0.05, gt=0, lt=1, description="McNemar's test against the champion: worse at this level is a regression")
    must_beat: list[str] = Field(default_factory=lambda: ["sft-inline", "base-inline", "random"],
                                 description="evaluations the candidate must beat on the same games (evaluate labels, or a baseline)")
    no_regression: list[str] = Field(default_factory=lambda: ["sft-inline"],
                                     description="evaluations the candidate must not be worse than on either split (McNemar at alpha, game by game)")


class PromotionParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model_name: str = Field("evoharness-agent", min_length=1, pattern=r"^[A-Za-z0-9._/ -]+$",
                            description="registered model name; the profile is appended")
    log_weights: dict[str, bool] = Field(default_factory=dict, description="per profile: copy the weights into MLflow (else config, tokenizer and the DVC pointer)")
    thresholds: dict[str, Thresholds]


def load_promotion(params_path: str | Path, profile: str) -> tuple[PromotionParams, Thresholds]:
    p = Path(params_path)
    try:
        raw = (yaml.safe_load(p.read_text()) or {}).get("promotion")
    except FileNotFoundError:
        raise EvoError(f"params file {p} does not exist") from None
    if raw is None:
        raise EvoError(f"{p}: no promotion section (thresholds per profile)")
    try:
        pp = PromotionParams(**raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"])
        raise EvoError(f"{p}: promotion.{loc}: {err['msg']} (got {err.get('input')!r})") from None
    if profile not in pp.thresholds:
        raise EvoError(f"{p}: promotion.thresholds has no entry for profile {profile!r} (known: {', '.join(pp.thresholds)})")
    return pp, pp.thresholds[profile]


def registered_name(pp: PromotionParams, profile: str) -> str:
    return f"{pp.model_name}-{profile}"


@dataclass
class Check:
    name: str
    value: float
    op: str
    threshold: float
    passed: bool
    detail: str = ""

    def line(self) -> str:
        return f"{self.name}: {self.value:.3f} {self.op} {self.threshold:.3f} -> {'pass' if self.passed else 'FAIL'}" + (f" ({self.detail})" if self.detail else "")


@dataclass
class Decision:
    promoted: bool
    checks: list[Check]
    reasons: list[str]
    champion_version: str | None = None
    version: str | None = None
    reused: bool = False
    extra: dict = field(default_factory=dict)

    @property
    def word(self) -> str:
        return "promoted" if self.promoted else "rejected"

    def as_dict(self) -> dict:
        return asdict(self) | {"decision": self.word}


def decide(cand: Evidence, champion: Evidence | None, refs: dict[str, Evidence], best: dict[str, float], t: Thresholds) -> Decision:
    """Every check of the module's docstring, on evidence already read (fail-closed reading is the
    caller's); ``best``: the best champion's success per split under these conditions (may be empty)."""
    check_reference_conditions(cand, refs)
    seen, unseen = cand.rate("valid_seen"), cand.rate("valid_unseen")
    checks = [Check("seen_success", seen, ">=", t.min_seen, seen >= t.min_seen - 1e-12),
              Check("unseen_success", unseen, ">=", t.min_unseen, unseen >= t.min_unseen - 1e-12)]
    err_rate = cand.errored / max(cand.episodes, 1)
    checks.append(Check("errored_episodes", err_rate, "<=", t.max_errored, err_rate <= t.max_errored + 1e-12, f"{cand.errored} of {cand.episodes}"))
    for label in t.must_beat:
        ref = refs.get(label)
        if ref is None:
            raise EvoError(f"promotion: no evaluation of {label!r} to compare the candidate with (promotion.thresholds.must_beat)")
        cw, rw, n = paired_wins(cand, ref)
        if n == 0:
            raise EvoError(f"promotion: the candidate and {label} share no evaluated games; evaluate them on the same games")
        checks.append(Check(f"beats_{label}", cw / n, ">", rw / n, cw > rw, f"{cw} vs {rw} wins of {n} games"))
    for label in t.no_regression:
        ref = refs.get(label)
        if ref is None:
            raise EvoError(f"promotion: no evaluation of {label!r} to compare the candidate with (promotion.thresholds.no_regression)")
        for split, short in (("valid_seen", "seen"), ("valid_unseen", "unseen")):
            if not (cand.outcomes.get(split, {}).keys() & ref.outcomes.get(split, {}).keys()):
                raise EvoError(f"promotion: the candidate and {label} share no evaluated {split} games; evaluate them on the same games")
            b, c, p = mcnemar_worse(cand.outcomes[split], ref.outcomes[split])
            checks.append(Check(f"{short}_vs_{label}", p, ">=", t.alpha, p >= t.alpha,
                                f"McNemar exact, one-sided: {label}-only wins {b}, candidate-only wins {c}"))
    if champion is not None:
        diff = condition_difference(cand.conditions, champion.conditions)
        if diff:
            checks.append(Check("same_conditions_as_champion", 0.0, "==", 1.0, False, f"champion evaluated under other conditions: {diff}"))
        else:
            for split, short in (("valid_seen", "seen"), ("valid_unseen", "unseen")):
                b, c, p = mcnemar_worse(cand.outcomes.get(split, {}), champion.outcomes.get(split, {}))
                checks.append(Check(f"{short}_vs_champion", p, ">=", t.alpha, p >= t.alpha,
                                    f"McNemar exact, one-sided: champion-only wins {b}, candidate-only wins {c}"))
    for split, short in (("valid_seen", "seen"), ("valid_unseen", "unseen")):
        if split in best:
            floor = best[split] - t.tolerance
            v = cand.rate(split)
            checks.append(Check(f"{short}_floor", v, ">=", floor, v >= floor - 1e-12, f"best champion so far {best[split]:.1%} minus {t.tolerance:.1%}"))
    failed = [c for c in checks if not c.passed]
    reasons = [_reason(c, t) for c in failed] or [
        "passes every check" + (" and does not regress against the champion" if champion is not None else "; there is no champion yet")]
    return Decision(promoted=not failed, checks=checks, reasons=reasons)


def _reason(c: Check, t: Thresholds) -> str:
    if c.name in ("seen_success", "unseen_success"):
        return f"{c.name.split('_')[0]} success {c.value:.1%} is below the threshold {c.threshold:.1%}"
    if c.name == "errored_episodes":
        return f"{c.detail} episodes errored ({c.value:.1%}), more than the limit {c.threshold:.1%}"
    if c.name.startswith("beats_"):
        return f"does not beat {c.name.removeprefix('beats_')} on the same games ({c.detail})"
    if "_vs_" in c.name:
        split, other = c.name.split("_vs_", 1)
        return f"{split} success regresses against {'the champion' if other == 'champion' else other} (p = {c.value:.3f} < {t.alpha}; {c.detail})"
    if c.name.endswith("_floor"):
        return f"{c.name.split('_')[0]} success {c.value:.1%} is below the floor {c.threshold:.1%} ({c.detail})"
    return c.detail or c.line()


def version_tags(decision: Decision, cand: Evidence) -> dict[str, str]:
    tags = {
        "decision": decision.word,
        "decision.reasons": "; ".join(decision.reasons),
        "decision.champion_before": decision.champion_version or "none",
        "errored": str(cand.errored),
    }
    for c in decision.checks:
        tags[f"check.{c.name}"] = c.line()
    for split in SPLITS:
        for fam, v in cand.summary.get(split, {}).items():
            if isinstance(v, dict) and "success" in v:
                tags[f"eval.{split}.{fam}"] = f"{v['success']:.4f}"
    for k in CONDITION_KEYS:
        tags[f"cond.{k}"] = str(cand.conditions.get(k))
    tags["cond.hash"] = conditions_hash(cand.conditions)
    return tags


def annealing_plot(curve: list[dict], path: Path) -> Path | None:
    """Calls per episode by verb and success against the GRPO update (the paper's annealing curve)."""
    if not curve:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    xs = [r.get("update", i) for i, r in enumerate(curve)]
    verbs = sorted({v for r in curve for v in (r.get("calls_per_episode") or {})})
    for v in verbs:
        a.plot(xs, [(r.get("calls_per_episode") or {}).get(v, 0.0) for r in curve], marker="o", label=v)
    a.set_xlabel("GRPO update")
    a.set_ylabel("calls per episode")
    a.set_title("harness calls (annealing)")
    a.legend()
    b.plot(xs, [r.get("success", 0.0) for r in curve], marker="o", label="success")
    b.plot(xs, [r.get("diversity_weight", 0.0) for r in curve], linestyle="--", label="λ_div")
    b.plot(xs, [r.get("invalid_rate", 0.0) for r in curve], linestyle=":", label="invalid rate")
    b.set_xlabel("GRPO update")
    b.set_ylim(-0.05, 1.05)
    b.legend()
    b.set_title("success, diversity weight, invalid rate")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def report(name: str, version: str | None, decision: Decision, cand: Evidence, champion: dict | None, plot: str | None) -> str:
    """The reviewer's page: the decision, every check with its value and threshold, the per-family
    table beside the champion's, the conditions, the annealing plot."""
    fams = list(FAMILIES.values()) + ["all"]
    lines = [f"# Promotion decision: {name} version {version or '?'} — **{decision.word.upper()}**", ""]
    lines += [f"- {r}" for r in decision.reasons]
    lines += ["", "| check | value | threshold | result | detail |", "|---|---|---|---|---|"]
    for c in decision.checks:
        lines.append(f"| {c.name} | {c.value:.3f} | {c.op} {c.threshold:.3f} | {'pass' if c.passed else '**FAIL**'} | {c.detail} |")
    lines += ["", f"Per-family success (%), candidate beside the champion (version {decision.champion_version or 'none'}); "
              f"{cand.errored} of the candidate's {cand.episodes} episodes errored (counted as failures):", ""]
    lines.append("| split | model | " + " | ".join(fams) + " |")
    lines.append("|---" * (len(fams) + 2) + "|")
    for split in SPLITS:
        for label, s in (("candidate", cand.summary), ("champion", champion)):
            if s is None:
                continue
            row = [f"{100 * s.get(split, {}).get(f, {}).get('success', float('nan')):.0f}" if f in s.get(split, {}) else "-" for f in fams]
            lines.append(f"| {split} | {label} | " + " | ".join(row) + " |")
    lines += ["", "Evaluation conditions: " + ", ".join(f"{k} `{cand.conditions.get(k)}`" for k in CONDITION_KEYS)]
    if plot:
        lines += ["", f"![annealing]({plot})"]
    return "\n".join(lines) + "\n"
