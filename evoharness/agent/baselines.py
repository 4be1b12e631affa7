"""The baselines stage: the teacher and each baseline policy on the evaluation panel, with the demos' bank frozen."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from evoharness.agent.alfworld.games import list_games
from evoharness.agent.envpool import EnvPool
from evoharness.agent.evaluate import evaluate, format_table
from evoharness.agent.harness.experience import Experience
from evoharness.agent.policies import parse_policy
from evoharness.agent.policies.spec import policy_label
from evoharness.core import atomic
from evoharness.core.config import load_params


def baselines(params_path: str, games_root: Path, bank_path: Path, out: Path, echo: Callable[[str], None] = print) -> dict:
    """The teacher and each baseline on valid_seen and valid_unseen, with the demos' bank frozen."""
    p = load_params(params_path)
    bank = Experience.load(bank_path)
    results = {}
    with EnvPool(p.workers) as pool:
        for split in ("valid_seen", "valid_unseen"):
            games = list_games(games_root, split)
            for pol in p.eval.baselines:
                label = f"{policy_label(pol)}-{p.episode.harness.mode}-{split}"
                r = evaluate(games, parse_policy(pol), p.episode, list(p.eval.seeds), Path(out) / label, p.workers, bank, pool=pool)
                results[label] = r["summary"]
                echo(format_table(label, r["summary"]))
    atomic.write_json(Path(out) / "summary.json", results, indent=2)
    return results
