"""The evaluate stage: every trained stage's model, each in its mode, on seen and unseen games,
with one JSON per model and a comparison table."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from evoharness.agent.alfworld.families import FAMILIES
from evoharness.agent.alfworld.games import list_games
from evoharness.agent.envpool import EnvPool
from evoharness.agent.evaluate import evaluate, format_table, outcomes_of
from evoharness.agent.harness.experience import Experience
from evoharness.agent.harness.workspace import META_VERBS
from evoharness.agent.policies import PolicySpec
from evoharness.agent.training.profiles import Profile
from evoharness.core import atomic
from evoharness.core.config import load_params
from evoharness.core.errors import EvoError

# (label, model folder under models/, mode): the base with the harness (the gate's floor), SFT without
# and with the harness, and GRPO with it. The base is not also evaluated in env_only: it wins nothing in
# either mode (0/120 each, every retrain so far) and its 120 full-length episodes cost minutes of the
# 60-minute budget that GRPO's 48 updates need.
LINEUP = (
    ("base-inline", "base", "inline"),
    ("sft-env_only", "sft-env_only", "env_only"),
    ("sft-inline", "sft-inline", "inline"),
    ("grpo-inline", "grpo", "inline"),
)


def per_family(games, n: int):
    """The first n games of each family (by id): every family equally represented (0: every game)."""
    if n <= 0:
        return list(games)
    out, seen = [], {}
    for g in games:
        if seen.get(g.family, 0) < n:
            out.append(g)
            seen[g.family] = seen.get(g.family, 0) + 1
    return out


def comparison_table(results: dict) -> str:
    """Per model and split: success per family, overall with its 95 % Wilson interval, steps (the free
    and the charged budget), calls per episode by verb, invalid rate."""
    fams = list(FAMILIES.values())
    lines = ["| model | split | " + " | ".join(fams) + " | all % [95 % CI] | steps free / charged | " + " | ".join(META_VERBS) + " | invalid |",
             "|---" * (len(fams) + 5 + len(META_VERBS)) + "|"]
    for label, splits in results.items():
        for split, s in splits.items():
            if not isinstance(s, dict):
                continue
            row = [f"{100 * s[f]['success']:.0f}" if f in s else "-" for f in fams]
            a = s["all"]
            lo, hi = a.get("ci95", [float("nan"), float("nan")])
            lines.append(f"| {label} | {split} | " + " | ".join(row) + f" | **{100 * a['success']:.1f}** [{100 * lo:.0f}, {100 * hi:.0f}] | "
                         f"{a.get('steps_free', a['steps']):.1f} / {a.get('steps_charged', a['steps']):.1f} | "
                         + " | ".join(f"{a['calls'][v]:.2f}" for v in META_VERBS) + f" | {100 * a['invalid_rate']:.1f}% |")
    return "\n".join(lines)


CLAIMS = (("sft-inline", "sft-env_only", "the harness helps SFT (BPE-SFT above ReAct-SFT)"),
          ("grpo-inline", "sft-inline", "GRPO improves on its SFT model"))


def format_p(p: float) -> str:
    """A p-value as the tables print it: four decimals, or two significant figures below 0.001 (so a
    small p never reads as 0.0000)."""
    return f"{p:.4f}" if p >= 0.001 else f"{p:.1e}"


def eval_setup(params, profile: Profile, path: Path | str, mode: str, off: tuple[str, ...] = ()) -> tuple:
    """The episode config and policy every evaluation of a trained model uses (this stage, the
    ablation table, the bench scripts): greedy, the profile's decoding, backend, device and dtype, the
    eval step and turn caps, meta-actions uncharged; ``off`` names harness modules switched off."""
    h = params.episode.harness.model_copy(update={"mode": mode, "charge_meta_actions": False, **{m: False for m in off}})
    cfg = params.episode.model_copy(update={"harness": h, "max_steps": profile.eval_max_steps or params.episode.max_steps,
                                            "max_turns": profile.eval_max_turns})
    spec = PolicySpec(kind="hf", path=str(path), max_new_tokens=profile.grpo.max_new_tokens, constrained=profile.decoding == "constrained",
                      backend=profile.generation, device=profile.device, dtype=profile.base.dtype)
    return cfg, spec


def claims(results: dict, which: tuple, outcomes: dict) -> str:
    """Each claim (``a`` beats ``b``) the table supports or not, per split, with McNemar's exact one-sided test paired
    by game on the per-episode outcomes (``outcomes[label][split]``, as ``evaluate.outcomes_of`` reads them: every
    model plays the same games). A claim whose models were not both evaluated is left out; an evaluated model
    without its outcomes is an error (a test on counts alone would lose the pairing)."""
    from evoharness.agent.evaluate import mcnemar_greater

    lines = ["| claim | split | wins | test (one-sided) | p |", "|---|---|---|---|---|"]
    for a, b, what in which:
        if a not in results or b not in results:
            continue
        for split in ("valid_seen", "valid_unseen"):
            x, y = results[a].get(split, {}).get("all"), results[b].get(split, {}).get("all")
            if not x or not y:
                continue
            missing = [m for m in (a, b) if not outcomes.get(m, {}).get(split)]
            if missing:
                raise EvoError(f"claims: no per-episode outcomes of {missing} on {split}")
            only_a, only_b, p = mcnemar_greater(outcomes[a][split], outcomes[b][split])
            test = f"McNemar exact, paired by game ({only_a} won by {a} only, {only_b} by {b} only)"
            lines.append(f"| {what}: {a} > {b} | {split} | {x['wins']}/{x['episodes']} vs {y['wins']}/{y['episodes']} | {test} | {format_p(p)} |")
    return "\n".join(lines)


def compare(params_path: str, profile: Profile, games_root: Path, models: Path, bank_path: Path, out: Path, echo: Callable[[str], None] = print) -> dict:
    """Evaluate the lineup on the profile's machine: one process, the profile's device and dtype,
    decoded in batches (``generation``: the model's own weights, or vLLM). Each model's results
    name the weights evaluation loaded (``model_digest``): the promotion gate registers those."""
    from evoharness.agent.episode import bank_digest
    from evoharness.agent.evaluate import evaluate_evolving
    from evoharness.agent.harness.consolidate import make_consolidator
    from evoharness.agent.policies.hf import release
    from evoharness.agent.training.checkpoint import check_checkpoint, resolve_checkpoint, weights_digest
    from evoharness.agent.training.distributed import check_machine

    p = load_params(params_path)
    bank = Experience.load(bank_path)
    consolidator = make_consolidator(p.consolidator.endpoint) if p.eval.bank == "evolve" else None
    out = Path(out)
    check_machine(profile.model_copy(update={"num_processes": 1}))  # evaluation uses one GPU
    results: dict = {}
    outcomes: dict = {}
    digests: dict = {}
    with EnvPool(profile.episode_workers) as pool:
        for label, folder, mode in LINEUP:
            path = Path(models) / folder
            try:
                check_checkpoint(resolve_checkpoint(path), f"compare: model {label}")
            except EvoError as e:
                raise EvoError(f"{e} (run its stage first)") from None
            digests[label] = weights_digest(path)
            cfg, spec = eval_setup(p, profile, path, mode)
            results[label] = {}
            # GRPO evolved its own bank; the others read the teacher's. The bank evaluated with is kept beside the
            # results (a DVC output, logged on the model version): the agent is its weights and its bank.
            own = path / "experience.json"
            b = (Experience.load(own) if own.exists() else bank) if mode != "env_only" else None
            banks = {"bank_mode": p.eval.bank if b is not None else "none", "bank_digest": bank_digest(b)}
            if b is not None:
                b.save(out / label / "bank.json")
            try:
                for split in ("valid_seen", "valid_unseen"):
                    games = per_family(list_games(games_root, split), profile.eval_games_per_family)
                    if b is not None and p.eval.bank == "evolve":  # each split evolves its own copy from the model's bank
                        r = evaluate_evolving(games, spec, cfg, list(p.eval.seeds), out / label / split, Experience.from_json(b.to_json()),
                                              p.consolidator.window, consolidator, profile.episode_workers, pool, warn=echo)
                        banks[f"bank_final_digest_{split}"] = r["bank_digest"]
                    else:
                        r = evaluate(games, spec, cfg, list(p.eval.seeds), out / label / split, profile.episode_workers, b, pool=pool)
                    results[label][split] = r["summary"]
                    outcomes.setdefault(label, {})[split] = outcomes_of(out / label / split, r["summary"]["all"]["episodes"])
                    echo(format_table(f"{label} {split}", r["summary"]))
            finally:  # the next model's engine needs the memory this one holds
                release(str(path))
            atomic.write_json(out / label / "results.json", {**results[label], "model_digest": digests[label], **banks}, indent=2)
    table = comparison_table(results) + "\n\n" + claims(results, CLAIMS, outcomes)
    (out / "comparison.md").write_text(table + "\n")
    echo(table)
    return {label: {split: {"success": s["all"]["success"], **{f: s[f]["success"] for f in FAMILIES.values() if f in s}} for split, s in sp.items()} for label, sp in results.items()}
