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

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from evoharness import atomic
from evoharness.alfworld.families import FAMILIES
from evoharness.errors import EvoError

CANDIDATE = "grpo-inline"  # the evaluate stage's label for the model the gate decides on
SPLITS = ("valid_seen", "valid_unseen")
EVIDENCE = "promotion/evidence.json"  # per-game outcomes and conditions, an artifact of the version's run
CONDITION_KEYS = ("games", "splits", "seeds", "max_steps", "max_turns", "mode", "charge_meta_actions", "decoding", "sampling", "max_new_tokens")


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


# ---- evidence: what one model's evaluation says, game by game ------------------------------------------

@dataclass
class Evidence:
    """One model's evaluation: per split its summary (per family and all) and the outcome of every
    episode (1 won, 0 not; an errored episode is 0), and the conditions it was evaluated under."""

    label: str
    summary: dict
    outcomes: dict[str, dict[str, int]]
    errored: int
    conditions: dict

    def rate(self, split: str) -> float:
        try:
            v = float(self.summary[split]["all"]["success"])
        except (KeyError, TypeError, ValueError):
            raise EvoError(f"promotion: {self.label} has no {split} success in its evaluation; re-run the evaluate stage") from None
        if not math.isfinite(v) or not 0 <= v <= 1:
            raise EvoError(f"promotion: {self.label}'s {split} success is {v!r}, not a rate; re-run the evaluate stage")
        return v

    @property
    def episodes(self) -> int:
        return sum(len(o) for o in self.outcomes.values())

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Evidence":
        return cls(d["label"], d["summary"], {s: dict(o) for s, o in d["outcomes"].items()}, int(d["errored"]), dict(d["conditions"]))


def evidence_from_dirs(label: str, split_dirs: dict[str, Path], games_md5: str) -> Evidence:
    """Read an evaluation (``<dir>/results.json`` and ``episodes.jsonl`` per split), failing closed."""
    from evoharness.rollout import read_jsonl

    summary, outcomes, errored, conds = {}, {}, 0, []
    for split, d in split_dirs.items():
        try:
            res = json.loads((Path(d) / "results.json").read_text())
        except (OSError, ValueError) as e:
            raise EvoError(f"promotion: cannot read {label}'s {split} evaluation ({Path(d) / 'results.json'}: {type(e).__name__})") from None
        records, bad = read_jsonl(Path(d) / "episodes.jsonl")
        if bad or not records:
            raise EvoError(f"promotion: {Path(d) / 'episodes.jsonl'} has {len(bad)} unreadable line(s) and {len(records)} episodes")
        # evaluate() keeps the records of earlier evaluations in the same folder after its own: evidence mixed
        # with another model's episodes is refused, never read game by game
        played = res.get("games", 0) * len(res.get("seeds") or [])
        keys = {(r.get("game_id"), r.get("seed")) for r in records}
        if len(records) != played or len(keys) != len(records):
            raise EvoError(f"promotion: {Path(d) / 'episodes.jsonl'} holds {len(records)} episodes ({len(keys)} distinct game and seed pairs) "
                           f"where {Path(d) / 'results.json'} played {played}: episodes of another evaluation are in that folder")
        summary[split] = res.get("summary") or {}
        outcomes[split] = {f"{r['game_id']}#s{r['seed']}": int(bool(r.get("outcome", {}).get("won")) and not r.get("error")) for r in records}
        # the summary the thresholds read and the episodes the paired tests read must be one evaluation
        wins = sum(outcomes[split].values())
        total = (summary[split].get("all") or {}) if isinstance(summary[split], dict) else {}
        claimed = (total.get("wins"), total.get("episodes"), total.get("success"))
        if claimed != (wins, len(records), round(wins / len(records), 4)):
            raise EvoError(f"promotion: {Path(d) / 'results.json'} says {claimed[0]} wins of {claimed[1]} (success {claimed[2]}) but "
                           f"{Path(d) / 'episodes.jsonl'} holds {wins} wins of {len(records)}: the evidence contradicts itself; re-run the evaluation")
        errored += sum(bool(r.get("error")) for r in records)
        conds.append(conditions_of(res, records, games_md5))
    merged = dict(conds[0])
    merged["splits"] = ",".join(sorted(split_dirs))
    for c in conds[1:]:
        for k in CONDITION_KEYS:
            if k not in ("splits", "games") and c.get(k) != merged.get(k):
                raise EvoError(f"promotion: {label} was evaluated under different {k} on its splits ({merged.get(k)} / {c.get(k)})")
    merged["games"] = hashlib.sha256("|".join(c["games"] for c in conds).encode()).hexdigest()[:16]
    return Evidence(label, summary, outcomes, errored, merged)


def conditions_of(result: dict, records: list[dict], games_md5: str) -> dict:
    """The conditions an evaluation ran under, from its results.json: which games (their DVC hash and
    the ids played), seeds, budgets, harness mode, charged or free meta-actions, decoding."""
    cfg = result.get("episode_config") or {}
    h = cfg.get("harness") or {}
    fp = str(result.get("policy_fingerprint", ""))
    parts = fp.split(":")  # hf:v3:<weights>:<sample>:<temperature>:<max_new_tokens>:<decoding>[:<backend>]
    ids = sorted({r["game_id"] for r in records})
    return {
        "games": hashlib.sha256((games_md5 + "|" + "|".join(ids)).encode()).hexdigest()[:16],
        "splits": ",".join(result.get("split") or []),
        "seeds": ",".join(str(s) for s in result.get("seeds") or []),
        "max_steps": str(cfg.get("max_steps")),
        "max_turns": str(cfg.get("max_turns")),
        "mode": str(h.get("mode")) + ("+evolve" if result.get("bank_mode") == "evolve" else ""),  # an evolving bank is another condition
        "charge_meta_actions": str(h.get("charge_meta_actions")).lower(),
        "decoding": parts[6] if len(parts) > 6 else "n/a",
        "sampling": f"{parts[3]}:{parts[4]}" if len(parts) > 4 else "n/a",
        "max_new_tokens": parts[5] if len(parts) > 5 else "n/a",
    }


def condition_difference(a: dict, b: dict) -> str | None:
    diffs = [f"{k} {b.get(k)} (champion) vs {a.get(k)}" for k in CONDITION_KEYS if str(a.get(k)) != str(b.get(k))]
    return "; ".join(diffs) if diffs else None


def conditions_hash(c: dict) -> str:
    return hashlib.sha256(json.dumps({k: str(c.get(k)) for k in CONDITION_KEYS}, sort_keys=True).encode()).hexdigest()[:12]


def mcnemar_worse(cand: dict[str, int], champ: dict[str, int]) -> tuple[int, int, float]:
    """On the games both played: b = champion won and candidate lost, c = the reverse; the exact
    one-sided p-value that the candidate is worse, P(X >= b) with X ~ Binomial(b + c, 1/2)."""
    keys = cand.keys() & champ.keys()
    b = sum(1 for k in keys if champ[k] and not cand[k])
    c = sum(1 for k in keys if cand[k] and not champ[k])
    n = b + c
    p = sum(math.comb(n, i) for i in range(b, n + 1)) / 2**n if n else 1.0
    return b, c, p


def paired_wins(cand: Evidence, ref: Evidence) -> tuple[int, int, int]:
    """(candidate wins, reference wins, games) over both splits, on the games both played."""
    cw = rw = n = 0
    for split in SPLITS:
        a, b = cand.outcomes.get(split, {}), ref.outcomes.get(split, {})
        keys = a.keys() & b.keys()
        cw += sum(a[k] for k in keys)
        rw += sum(b[k] for k in keys)
        n += len(keys)
    return cw, rw, n


# ---- the decision ------------------------------------------------------------------------------------

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


# What a reference evaluation (a baseline the candidate must beat or not regress against) shares with the
# candidate: the games and seeds (every game and seed the candidate played, the reference played too), the harness
# mode and meta-action charging, decoding where both are models; and a step and turn budget at least the
# candidate's (the baselines stage plays the episode budget, the evaluate stage the profile's eval budget: more
# steps can only help the reference, so a candidate that beats it under less still beats it).
REF_EQUAL_KEYS = ("splits", "seeds", "mode", "charge_meta_actions")
REF_BUDGET_KEYS = ("max_steps", "max_turns")
DECODING_KEYS = ("decoding", "sampling", "max_new_tokens")


def _budget(c: dict, key: str) -> float:
    try:
        steps = float(c.get("max_steps"))
        v = float(c.get(key))
    except (TypeError, ValueError):
        return float("nan")
    return (v or 2 * steps) if key == "max_turns" else v  # max_turns 0: twice max_steps (EpisodeConfig)


def check_reference_conditions(cand: Evidence, refs: dict[str, Evidence]) -> None:
    """A reference evaluated under conditions that favour the candidate compares nothing: refused in one line."""
    for label, ref in refs.items():
        keys = list(REF_EQUAL_KEYS)
        if all(ref.conditions.get(k, "n/a") != "n/a" for k in DECODING_KEYS):
            keys += DECODING_KEYS
        diffs = [f"{k} {ref.conditions.get(k)} vs {cand.conditions.get(k)}" for k in keys if str(ref.conditions.get(k)) != str(cand.conditions.get(k))]
        diffs += [f"{k} {ref.conditions.get(k)} vs {cand.conditions.get(k)}" for k in REF_BUDGET_KEYS
                  if not _budget(ref.conditions, k) >= _budget(cand.conditions, k)]
        for split, played in cand.outcomes.items():
            missing = played.keys() - ref.outcomes.get(split, {}).keys()
            if missing:
                diffs.append(f"{len(missing)} {split} game and seed pair(s) the candidate played, {label} did not (e.g. {sorted(missing)[0]})")
        if diffs:
            raise EvoError(f"promotion: {label} was evaluated under other conditions than the candidate ({'; '.join(diffs)}); "
                           "re-run the baselines stage with the candidate's settings")


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


# ---- tags, report, registry ----------------------------------------------------------------------------

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


def _not_found(e) -> bool:
    """MLflow's "there is no such thing" (an alias not set answers INVALID_PARAMETER_VALUE "... not
    found"), as opposed to any other failure, which must never read as "no champion"."""
    code = getattr(e, "error_code", "")
    return code == "RESOURCE_DOES_NOT_EXIST" or (code == "INVALID_PARAMETER_VALUE" and str(e).rstrip(".").endswith("not found"))


def _champion_alias(c, name: str) -> tuple[str | None, object]:
    """(the champion's version, its model version) or (None, None); any other answer of the registry stops."""
    from mlflow.exceptions import MlflowException

    try:
        mv = c.get_model_version_by_alias(name, "champion")
    except MlflowException as e:
        if _not_found(e):
            return None, None
        raise EvoError(f"promotion: cannot read {name}'s champion from MLflow ({type(e).__name__}: {str(e).splitlines()[0][:200]}); nothing moved") from None
    except Exception as e:  # the store unreachable, a broken connection: not "no champion"
        raise EvoError(f"promotion: cannot read {name}'s champion from MLflow ({type(e).__name__}: {str(e).splitlines()[0][:200]}); nothing moved") from None
    return str(mv.version), mv


def read_champion(c, name: str):
    """(version, its evidence) of the current champion, or (None, None) when there is none. Anything
    else the registry answers (an error, a champion without its evaluation record) stops the gate."""
    _, mv = _champion_alias(c, name)
    if mv is None:
        return None, None
    tags = mv.tags or {}
    if not any(k.startswith("eval.") for k in tags) or "cond.hash" not in tags:
        raise EvoError(f"promotion: champion {name} version {mv.version} has no evaluation tags (eval.*, cond.*), so nothing can be "
                       "compared with it; nothing moved")
    try:
        import tempfile

        local = c.download_artifacts(mv.run_id, EVIDENCE, tempfile.mkdtemp())
        ev = Evidence.from_json(json.loads(Path(local).read_text()))
    except Exception as e:
        raise EvoError(f"promotion: champion {name} version {mv.version} has no readable {EVIDENCE} in run {mv.run_id} "
                       f"({type(e).__name__}); nothing moved") from None
    return mv, ev


def best_so_far(c, name: str, cond_hash: str) -> dict[str, float]:
    """The best success per split among the versions ever promoted under these conditions."""
    best: dict[str, float] = {}
    for v in c.search_model_versions(f"name='{name}' and tag.decision='promoted' and tag.`cond.hash`='{cond_hash}'"):
        for split in SPLITS:
            x = (v.tags or {}).get(f"eval.{split}.all")
            if x is not None:
                best[split] = max(best.get(split, 0.0), float(x))
    return best


def gate(c, name: str, run_id: str, model_dir: Path, model_md5: str, cand: Evidence, refs: dict[str, Evidence], t: Thresholds,
         curve: list[dict], report_dir: Path, log_weights: bool = True, model_digest: str | None = None,
         record: Callable[[Decision], str | None] | None = None, evaluated_md5: str | None = None) -> Decision:
    """The whole gate: ``register`` the decision, then ``record`` it (a callable returning the run's git
    record, or None), then ``finalize`` it. The aliases move only once the record exists."""
    d = register(c, name, run_id, model_dir, model_md5, cand, refs, t, curve, report_dir, log_weights, model_digest, evaluated_md5)
    if d.reused:
        return d
    return finalize(c, name, d, record(d) if record else None)


def register(c, name: str, run_id: str, model_dir: Path | None, model_md5: str, cand: Evidence, refs: dict[str, Evidence], t: Thresholds,
             curve: list[dict], report_dir: Path, log_weights: bool = True, model_digest: str | None = None,
             evaluated_md5: str | None = None) -> Decision:
    """Register the candidate (once per DVC hash), decide, tag, describe, write the report, and leave the
    decision ``pending``: no alias moves until ``finalize``. A version left pending by an interrupted gate
    is decided again on the champion it saw, not re-registered; a complete one is returned as reused.
    What binds the evidence to the model: ``evaluated_md5`` (the DVC hash of the model the evaluation read, from
    dvc.lock) must be ``model_md5``, and the weights in ``model_dir``, where they are here, must have the digest the
    evaluation loaded; with the weights left on the remote (``model_dir`` None) the hashes are all there is."""
    from mlflow.exceptions import MlflowException

    if evaluated_md5 is not None and evaluated_md5 != model_md5 or model_dir is None and not evaluated_md5:
        raise EvoError(f"promotion: the evaluation read model {evaluated_md5 or 'none named'} but the candidate is {model_md5 or 'none'} "
                       "(dvc.lock); re-run evaluate: nothing was registered")
    if not model_digest:
        raise EvoError(f"promotion: the candidate's evaluation names no model_digest, so nothing binds it to {model_dir or model_md5}; re-run evaluate")
    if model_dir is not None:  # the weights are here: they must be the ones evaluated (else dvc.lock's hashes bind them: the caller)
        from evoharness.training.checkpoint import weights_digest

        here = weights_digest(model_dir)
        if here != model_digest:
            raise EvoError(f"promotion: {model_dir} holds weights {here}, but evaluation loaded {model_digest}; re-run evaluate")
    try:
        c.get_registered_model(name)
    except MlflowException as e:
        if not _not_found(e):
            raise EvoError(f"promotion: cannot read registered model {name} ({type(e).__name__}); nothing moved") from None
        try:
            c.create_registered_model(name, description="EvoHarness agents; alias champion is the promoted one, challenger the latest candidate")
        except MlflowException as e2:  # made a moment ago by another retrain's gate
            if getattr(e2, "error_code", "") != "RESOURCE_ALREADY_EXISTS":
                raise EvoError(f"promotion: cannot register model {name} ({type(e2).__name__}); nothing moved") from None
    existing = c.search_model_versions(f"name='{name}' and tag.dvc_md5='{model_md5}'")
    mv = max(existing, key=lambda m: int(m.version)) if existing else None
    if mv is not None and (mv.tags or {}).get("decision.state") == "complete":
        tags = mv.tags
        return Decision(promoted=tags.get("decision") == "promoted", checks=[], reasons=[tags.get("decision.reasons", "")],
                        champion_version=tags.get("decision.champion_before"), version=str(mv.version), reused=True,
                        extra={"run_id": mv.run_id, "git_ref": tags.get("git_ref")})
    if mv is not None:  # an interrupted gate: decide again, on the champion now (another retrain may have moved it)
        before = (mv.tags or {}).get("decision.champion_before", "none")
        champ, champ_ev = read_champion(c, name)
        if champ is None or str(champ.version) == str(mv.version):  # none now, or this version already made champion
            champ, champ_ev = (None, None)
            if before != "none":
                champ = c.get_model_version(name, before)
                champ_ev = read_champion_version(c, name, champ)
        run_id = mv.run_id
    else:
        champ, champ_ev = read_champion(c, name)
    best = best_so_far(c, name, conditions_hash(cand.conditions))
    decision = decide(cand, champ_ev, refs, best, t)
    decision.champion_version = str(champ.version) if champ is not None else None
    decision.extra["run_id"] = run_id

    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    atomic.write_json(report_dir / "evidence.json", cand.to_json(), indent=1)
    if mv is None:
        if model_dir is None:  # the weights stayed on the DVC remote: the version points there
            log_weights = False
            atomic.write_text(report_dir / "dvc-pointer.yaml", yaml.safe_dump({"path": "data/models/grpo", "md5": model_md5, "model_digest": model_digest,
                                                                                "restore": "dvc pull data/models/grpo (at this version's git_ref)"}, sort_keys=False))
            c.log_artifact(run_id, str(report_dir / "dvc-pointer.yaml"), "model")
        else:
            model_dir = Path(model_dir)
            files = [f for f in sorted(model_dir.rglob("*")) if f.is_file()]
            if not log_weights:
                files = [f for f in files if not f.name.endswith((".safetensors", ".bin", ".pt"))]
            for f in files:
                rel = f.relative_to(model_dir).parent.as_posix()
                c.log_artifact(run_id, str(f), "model" + ("" if rel == "." else f"/{rel}"))
        c.log_artifact(run_id, str(report_dir / "evidence.json"), "promotion")
        source = f"{c.get_run(run_id).info.artifact_uri}/model"
        mv = c.create_model_version(name, source=source, run_id=run_id, description=f"GRPO model, DVC md5 {model_md5} (decision pending)",
                                    tags={"dvc_md5": model_md5, "weights_in_mlflow": str(log_weights).lower(), "decision.state": "pending",
                                          "decision.champion_before": decision.champion_version or "none"})
    decision.version = str(mv.version)
    for k, v in version_tags(decision, cand).items():
        c.set_model_version_tag(name, mv.version, k, v)
    plot = annealing_plot(curve, report_dir / "annealing.png")
    artifact_plot = f"get-artifact?path=promotion%2Fannealing.png&run_uuid={run_id}" if plot else None
    md = report(name, mv.version, decision, cand, champ_ev.summary if champ_ev else None, artifact_plot)
    atomic.write_text(report_dir / "promotion.md", report(name, mv.version, decision, cand, champ_ev.summary if champ_ev else None, plot.name if plot else None))
    atomic.write_json(report_dir / "decision.json", decision.as_dict(), indent=2)
    c.log_artifacts(run_id, str(report_dir), "promotion")
    c.update_model_version(name, mv.version, description=md)
    return decision


def finalize(c, name: str, decision: Decision, git_ref: str | None = None) -> Decision:
    """Make a registered decision final: the version names the run's git record (``git_ref``), the
    aliases move (``challenger`` always, ``champion`` when promoted), and its state becomes complete.
    A reused (already complete) decision is returned as it is."""
    if decision.reused:
        return decision
    if decision.promoted:
        # Compare and set: the champion must still be the one this decision was compared with. Another
        # retrain (another checkout sharing the registry) may have moved it in the meantime; the decision
        # then stays pending, and the rerun decides again against the new champion.
        now, _ = _champion_alias(c, name)
        if now not in (decision.champion_version, decision.version):
            raise EvoError(f"promotion: {name}'s champion is version {now or 'none'} now, but version {decision.version} was compared with "
                           f"version {decision.champion_version or 'none'} (another retrain promoted in the meantime); nothing moved, "
                           "the decision stays pending: rerun the retrain to decide against the new champion")
    if git_ref:
        c.set_model_version_tag(name, decision.version, "git_ref", git_ref)
        decision.extra["git_ref"] = git_ref
    c.set_registered_model_alias(name, "challenger", decision.version)
    if decision.promoted:
        c.set_registered_model_alias(name, "champion", decision.version)
    run_id = decision.extra.get("run_id")
    if run_id:
        c.set_tag(run_id, "decision", decision.word)
        c.set_tag(run_id, "model_version", decision.version)
    c.set_model_version_tag(name, decision.version, "decision.state", "complete")
    return decision


def read_champion_version(c, name: str, mv):
    """The evidence of a given (former) champion version, failing closed like ``read_champion``."""
    import tempfile

    try:
        local = c.download_artifacts(mv.run_id, EVIDENCE, tempfile.mkdtemp())
        return Evidence.from_json(json.loads(Path(local).read_text()))
    except Exception as e:
        raise EvoError(f"promotion: version {mv.version} of {name} has no readable {EVIDENCE} ({type(e).__name__}); nothing moved") from None


def check_model_name(name: str) -> None:
    """A registered model name (or prefix) goes into MLflow's filter strings: nothing that could end the quote."""
    import re

    if not re.fullmatch(r"[A-Za-z0-9._/ -]*", name):
        raise EvoError(f"model name {name[:80]!r}: a registered model name holds letters, digits, '.', '_', '-', '/' and spaces only")


def promotions(c, name_prefix: str) -> list[dict]:
    """Every decision, newest first, across the registered models whose name starts with prefix."""
    check_model_name(name_prefix)
    rows = []
    for rm in c.search_registered_models(f"name LIKE '{name_prefix}%'"):
        aliases = {}
        for alias, ver in (rm.aliases or {}).items():
            aliases.setdefault(str(ver), []).append(alias)
        for v in c.search_model_versions(f"name='{rm.name}'"):
            t = v.tags
            rows.append({
                "model": rm.name, "version": int(v.version), "decision": t.get("decision", "?") if t.get("decision.state", "complete") == "complete" else "pending",
                "seen": t.get("eval.valid_seen.all", "-"), "unseen": t.get("eval.valid_unseen.all", "-"),
                "aliases": ",".join(sorted(aliases.get(str(v.version), []))), "run_id": v.run_id,
                "reasons": t.get("decision.reasons", ""), "created": v.creation_timestamp,
            })
    rows.sort(key=lambda r: (r["created"], r["version"]), reverse=True)
    return rows
