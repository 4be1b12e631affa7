"""The registry side of the promotion gate: register an evaluated model as a version, read the champion and its
evidence, decide (``decision``) and move the aliases by compare-and-set, idempotently; every decision listed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import yaml

from evoharness.core import atomic
from evoharness.core.errors import EvoError
from evoharness.ops.decision import Decision, Thresholds, annealing_plot, decide, report, version_tags
from evoharness.ops.evidence import EVIDENCE, SPLITS, Evidence, conditions_hash

# ---- evidence: what one model's evaluation says, game by game ------------------------------------------


# ---- the decision ------------------------------------------------------------------------------------


# ---- tags, report, registry ----------------------------------------------------------------------------


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
    """Register the candidate (once per DVC hash and evaluation conditions), decide, tag, describe, write the report, and leave the
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
        from evoharness.agent.training.checkpoint import weights_digest

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
    # One version per model and evaluation conditions: the same weights evaluated otherwise (another bank mode, step
    # budget, panel) are decided again as a version of their own, never given the decision made on other evidence. Every
    # version is created with its conditions' hash; one without (registered before versions carried it) counts as matching.
    cond = conditions_hash(cand.conditions)
    existing = [m for m in c.search_model_versions(f"name='{name}' and tag.dvc_md5='{model_md5}'")
                if (m.tags or {}).get("cond.hash", cond) == cond]
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
    best = best_so_far(c, name, cond)
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
                                    tags={"dvc_md5": model_md5, "cond.hash": cond, "weights_in_mlflow": str(log_weights).lower(), "decision.state": "pending",
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
