"""The paper's ablation table, as DVC stages outside the main job (``ablation/dvc.yaml``, run by
``evoharness ablation``): ReAct-SFT, the frozen harness (always_on), SFT-inline, plain GRPO
(success-only reward, env_only), cost-aware GRPO, and cost-aware GRPO without Belief, without
Progress, without Experience; success on seen and unseen with 95 % Wilson intervals, harness calls per
episode and the free and charged budgets, beside the paper's numbers.

The main job's evaluations are reused (ReAct-SFT, SFT-inline, cost-aware GRPO: ``data/eval``); the
ablation models are evaluated here on the same games, under the same conditions, each in its own mode
and with its own harness modules.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from evoharness.agent.harness.workspace import META_VERBS
from evoharness.core import atomic
from evoharness.core.errors import EvoError

SPLITS = ("valid_seen", "valid_unseen")


@dataclass(frozen=True)
class Row:
    label: str
    model: str  # the model folder
    mode: str
    off: tuple[str, ...] = ()  # harness modules switched off
    main: str = ""  # the main job's evaluate label, when the row is one of its models
    paper: tuple[float | None, float | None] = (None, None)  # the paper's success (%), seen / unseen (DESIGN.md)


ROWS = (
    Row("ReAct-SFT", "data/models/sft-env_only", "env_only", main="sft-env_only", paper=(47.9, None)),
    Row("frozen harness (always_on)", "data/ablation/models/sft-always_on", "always_on", paper=(56.4, None)),
    Row("SFT-inline", "data/models/sft-inline", "inline", main="sft-inline", paper=(68.6, None)),
    Row("plain GRPO (success only, env_only)", "data/ablation/models/grpo-plain", "env_only", paper=(65.6, None)),
    Row("cost-aware GRPO (EvoHarness-RL)", "data/models/grpo", "inline", main="grpo-inline", paper=(96.9, 86.6)),
    Row("cost-aware GRPO without Belief", "data/ablation/models/grpo-no_belief", "inline", ("belief",)),
    Row("cost-aware GRPO without Progress", "data/ablation/models/grpo-no_progress", "inline", ("progress",)),
    Row("cost-aware GRPO without Experience", "data/ablation/models/grpo-no_experience", "inline", ("experience",)),
)


# What the paper's table claims, each tested on this table's games (McNemar exact, one-sided, paired by game, per split).
CLAIMS = (
    ("SFT-inline", "frozen harness (always_on)", "choosing when to call the harness beats its panels every turn"),
    ("frozen harness (always_on)", "ReAct-SFT", "the frozen harness beats no harness"),
    ("cost-aware GRPO (EvoHarness-RL)", "plain GRPO (success only, env_only)", "cost-aware GRPO beats plain GRPO"),
    ("plain GRPO (success only, env_only)", "ReAct-SFT", "plain GRPO beats ReAct-SFT"),
    *((("cost-aware GRPO (EvoHarness-RL)", f"cost-aware GRPO without {m}", f"{m} helps")) for m in ("Belief", "Progress", "Experience")),
)


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in label.lower()).strip("-").replace("--", "-")


def ablation(params_path: str, profile, games_root: Path, main_eval: Path, bank_path: Path, out: Path, echo: Callable[[str], None] = print) -> dict:
    """Evaluate the ablation rows not in the main job, then write ``table.md`` and ``results.json``."""
    from evoharness.agent.alfworld.games import list_games
    from evoharness.agent.compare import eval_setup, per_family
    from evoharness.agent.envpool import EnvPool
    from evoharness.agent.evaluate import evaluate, outcomes_of
    from evoharness.agent.harness.experience import Experience
    from evoharness.agent.training.checkpoint import check_checkpoint, resolve_checkpoint
    from evoharness.core.config import load_params

    p = load_params(params_path)
    bank = Experience.load(bank_path)
    out = Path(out)
    results: dict = {}
    outcomes: dict = {}
    with EnvPool(profile.episode_workers) as pool:
        for row in ROWS:
            if row.main:
                f = Path(main_eval) / row.main / "results.json"
                try:
                    results[row.label] = {s: v for s, v in json.loads(f.read_text()).items() if s in SPLITS}
                except (OSError, ValueError):
                    raise EvoError(f"ablation: the main job's evaluation {f} is missing; run the main job first") from None
                outcomes[row.label] = {s: outcomes_of(Path(main_eval) / row.main / s, results[row.label][s]["all"]["episodes"]) for s in SPLITS}
                continue
            check_checkpoint(resolve_checkpoint(Path(row.model)), f"ablation: model {row.label}")
            cfg, spec = eval_setup(p, profile, row.model, row.mode, tuple(row.off))
            own = Path(row.model) / "experience.json"
            b = Experience.load(own) if own.exists() else bank
            results[row.label] = {}
            for split in SPLITS:
                games = per_family(list_games(games_root, split), profile.eval_games_per_family)
                r = evaluate(games, spec, cfg, list(p.eval.seeds), out / _slug(row.label) / split, profile.episode_workers,
                             b if row.mode != "env_only" else None, pool=pool)
                results[row.label][split] = r["summary"]
                outcomes.setdefault(row.label, {})[split] = outcomes_of(out / _slug(row.label) / split, r["summary"]["all"]["episodes"])
            echo(f"{row.label}: seen {results[row.label]['valid_seen']['all']['success']:.1%}, unseen {results[row.label]['valid_unseen']['all']['success']:.1%}")
    from evoharness.agent.compare import claims

    table = ablation_table(results) + "\n\n" + claims(results, CLAIMS, outcomes)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(table + "\n")
    atomic.write_json(out / "results.json", results, indent=1)
    echo(table)
    return {row.label: {s: results[row.label][s]["all"]["success"] for s in SPLITS} for row in ROWS}


def ablation_table(results: dict) -> str:
    head = ("| model | valid_seen % [95 % CI] | valid_unseen % [95 % CI] | harness calls / episode | steps (free) | steps (charged) "
            "| paper seen | paper unseen |")
    lines = [head, "|---" * 8 + "|"]
    for row in ROWS:
        r = results.get(row.label)
        if r is None:
            continue
        cells = []
        for s in SPLITS:
            a = r[s]["all"]
            lo, hi = a.get("ci95", [0, 0])
            cells.append(f"{100 * a['success']:.1f} [{100 * lo:.0f}, {100 * hi:.0f}]")
        a = r["valid_seen"]["all"]
        calls = sum(a["calls"].get(v, 0.0) for v in META_VERBS)
        ps, pu = row.paper
        lines.append(f"| {row.label} | {cells[0]} | {cells[1]} | {calls:.2f} | {a.get('steps_free', 0):.1f} | {a.get('steps_charged', 0):.1f} | "
                     f"{'–' if ps is None else ps} | {'–' if pu is None else pu} |")
    return "\n".join(lines)
