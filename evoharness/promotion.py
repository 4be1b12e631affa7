"""The promotion gate: every evaluated GRPO model becomes a registered model version (alias
``challenger``); the alias ``champion`` moves to it only if seen and unseen success meet the
profile's thresholds and neither falls below the current champion's by more than the tolerance.

The decision, every check with its value and threshold, and the reasons are written as version
tags, and as a markdown report (per-family table beside the champion's, the annealing plot) that
is logged with the run. A model already registered (same DVC hash) is not registered twice: its
recorded decision is returned, so a retrain with nothing changed decides nothing new.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from evoharness.alfworld.families import FAMILIES
from evoharness.errors import EvoError

CANDIDATE = "grpo-inline"  # the evaluate stage's label for the model the gate decides on
SPLITS = ("valid_seen", "valid_unseen")


class Thresholds(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    min_seen: float = Field(ge=0, le=1, description="valid_seen success the candidate must reach")
    min_unseen: float = Field(ge=0, le=1, description="valid_unseen success the candidate must reach")
    tolerance: float = Field(0.02, ge=0, le=1, description="how far below the champion either split may fall")


class PromotionParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model_name: str = Field("evoharness-agent", min_length=1, description="registered model name; the profile is appended")
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
    op: str  # ">="
    threshold: float
    passed: bool

    def line(self) -> str:
        return f"{self.name}: {self.value:.3f} {self.op} {self.threshold:.3f} -> {'pass' if self.passed else 'FAIL'}"


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


def decide(candidate: dict[str, float], champion: dict[str, float] | None, t: Thresholds) -> Decision:
    """candidate / champion: ``{"valid_seen": success, "valid_unseen": success}`` in [0, 1]."""
    checks = [
        Check("seen_success", candidate["valid_seen"], ">=", t.min_seen, candidate["valid_seen"] >= t.min_seen - 1e-12),
        Check("unseen_success", candidate["valid_unseen"], ">=", t.min_unseen, candidate["valid_unseen"] >= t.min_unseen - 1e-12),
    ]
    if champion is not None:
        for split, name in (("valid_seen", "seen_vs_champion"), ("valid_unseen", "unseen_vs_champion")):
            floor = champion[split] - t.tolerance
            checks.append(Check(name, candidate[split], ">=", floor, candidate[split] >= floor - 1e-12))
    failed = [c for c in checks if not c.passed]
    if failed:
        reasons = []
        for c in failed:
            if c.name.endswith("vs_champion"):
                split = "seen" if c.name.startswith("seen") else "unseen"
                reasons.append(f"{split} success {c.value:.1%} regresses more than {t.tolerance:.1%} below the champion's {c.threshold + t.tolerance:.1%}")
            else:
                split = c.name.split("_")[0]
                reasons.append(f"{split} success {c.value:.1%} is below the threshold {c.threshold:.1%}")
    else:
        reasons = ["meets both thresholds" + (" and does not regress against the champion" if champion is not None else "; there is no champion yet")]
    return Decision(promoted=not failed, checks=checks, reasons=reasons)


def split_success(summary: dict) -> dict[str, float]:
    """From one model's evaluate results (``{split: {family|all: {...}}}``)."""
    try:
        return {s: float(summary[s]["all"]["success"]) for s in SPLITS}
    except (KeyError, TypeError):
        raise EvoError(f"evaluation results lack {'/'.join(SPLITS)} 'all' success; re-run the evaluate stage") from None


def version_tags(decision: Decision, summary: dict) -> dict[str, str]:
    tags = {
        "decision": decision.word,
        "decision.reasons": "; ".join(decision.reasons),
        "decision.champion_before": decision.champion_version or "none",
    }
    for c in decision.checks:
        tags[f"check.{c.name}"] = c.line()
    for split in SPLITS:
        for fam, v in summary.get(split, {}).items():
            if isinstance(v, dict) and "success" in v:
                tags[f"eval.{split}.{fam}"] = f"{v['success']:.4f}"
    return tags


def summary_from_tags(tags: dict) -> dict:
    out: dict = {}
    for k, v in tags.items():
        if k.startswith("eval."):
            _, split, fam = k.split(".", 2)
            out.setdefault(split, {})[fam] = {"success": float(v)}
    return out


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


def report(name: str, version: str | None, decision: Decision, summary: dict, champion: dict | None, plot: str | None) -> str:
    fams = list(FAMILIES.values()) + ["all"]
    lines = [f"# Promotion decision: {name} version {version or '?'} — **{decision.word.upper()}**", ""]
    lines += [f"- {r}" for r in decision.reasons]
    lines += ["", "| check | value | threshold | result |", "|---|---|---|---|"]
    for c in decision.checks:
        lines.append(f"| {c.name} | {c.value:.3f} | {c.op} {c.threshold:.3f} | {'pass' if c.passed else '**FAIL**'} |")
    lines += ["", f"Per-family success (%), candidate beside the champion (version {decision.champion_version or 'none'}):", ""]
    lines.append("| split | model | " + " | ".join(fams) + " |")
    lines.append("|---" * (len(fams) + 2) + "|")
    for split in SPLITS:
        for label, s in (("candidate", summary), ("champion", champion)):
            if s is None:
                continue
            row = [f"{100 * s.get(split, {}).get(f, {}).get('success', float('nan')):.0f}" if f in s.get(split, {}) else "-" for f in fams]
            lines.append(f"| {split} | {label} | " + " | ".join(row) + " |")
    if plot:
        lines += ["", f"![annealing]({plot})"]
    return "\n".join(lines) + "\n"


def gate(c, name: str, run_id: str, model_dir: Path, model_md5: str, summary: dict, t: Thresholds, curve: list[dict],
         report_dir: Path, log_weights: bool = True) -> Decision:
    """Register the candidate (once per DVC hash), decide, tag, move aliases, write the report."""
    from mlflow.exceptions import MlflowException

    if summary.get("model_digest"):
        from evoharness.training.checkpoint import weights_digest

        here = weights_digest(model_dir)
        if here != summary["model_digest"]:
            raise EvoError(f"promotion: {model_dir} holds weights {here}, but evaluation loaded {summary['model_digest']}; re-run evaluate")
    try:
        c.get_registered_model(name)
    except MlflowException:
        c.create_registered_model(name, description="EvoHarness agents; alias champion is the promoted one, challenger the latest candidate")
    existing = c.search_model_versions(f"name='{name}' and tag.dvc_md5='{model_md5}'")
    if existing:
        v = max(existing, key=lambda m: int(m.version))
        tags = v.tags
        return Decision(promoted=tags.get("decision") == "promoted", checks=[], reasons=[tags.get("decision.reasons", "")],
                        champion_version=tags.get("decision.champion_before"), version=str(v.version), reused=True)

    try:
        champ = c.get_model_version_by_alias(name, "champion")
    except MlflowException:
        champ = None
    champ_summary = summary_from_tags(champ.tags) if champ is not None else None
    decision = decide(split_success(summary), split_success(champ_summary) if champ_summary else None, t)
    decision.champion_version = str(champ.version) if champ is not None else None

    model_dir = Path(model_dir)
    files = [f for f in sorted(model_dir.rglob("*")) if f.is_file()]
    if not log_weights:
        files = [f for f in files if not f.name.endswith((".safetensors", ".bin", ".pt"))]
    for f in files:
        rel = f.relative_to(model_dir).parent.as_posix()
        c.log_artifact(run_id, str(f), "model" + ("" if rel == "." else f"/{rel}"))
    source = f"{c.get_run(run_id).info.artifact_uri}/model"
    mv = c.create_model_version(name, source=source, run_id=run_id, tags={"dvc_md5": model_md5, "weights_in_mlflow": str(log_weights).lower()},
                                description=f"GRPO model, DVC md5 {model_md5}")
    decision.version = str(mv.version)
    c.set_registered_model_alias(name, "challenger", mv.version)
    for k, v in version_tags(decision, summary).items():
        c.set_model_version_tag(name, mv.version, k, v)
    if decision.promoted:
        c.set_registered_model_alias(name, "champion", mv.version)

    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    plot = annealing_plot(curve, report_dir / "annealing.png")
    md = report(name, mv.version, decision, summary, champ_summary, plot.name if plot else None)
    (report_dir / "promotion.md").write_text(md)
    (report_dir / "decision.json").write_text(json.dumps(decision.as_dict(), indent=2))
    c.log_artifacts(run_id, str(report_dir), "promotion")
    c.set_tag(run_id, "decision", decision.word)
    c.set_tag(run_id, "model_version", mv.version)
    return decision


def promotions(c, name_prefix: str) -> list[dict]:
    """Every decision, newest first, across the registered models whose name starts with prefix."""
    rows = []
    for rm in c.search_registered_models(f"name LIKE '{name_prefix}%'"):
        aliases = {}
        for alias, ver in (rm.aliases or {}).items():
            aliases.setdefault(str(ver), []).append(alias)
        for v in c.search_model_versions(f"name='{rm.name}'"):
            t = v.tags
            rows.append({
                "model": rm.name, "version": int(v.version), "decision": t.get("decision", "?"),
                "seen": t.get("eval.valid_seen.all", "-"), "unseen": t.get("eval.valid_unseen.all", "-"),
                "aliases": ",".join(sorted(aliases.get(str(v.version), []))), "run_id": v.run_id,
                "reasons": t.get("decision.reasons", ""), "created": v.creation_timestamp,
            })
    rows.sort(key=lambda r: (r["created"], r["version"]), reverse=True)
    return rows
