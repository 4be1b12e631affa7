"""The main job and the baselines stage as plain library calls (Prefect flows wrap the same)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from evoharness.alfworld.games import list_games
from evoharness.config import load_params
from evoharness.envpool import EnvPool
from evoharness.evaluate import evaluate, format_table
from evoharness.harness.experience import Experience
from evoharness.policies import parse_policy


def baselines(params_path: str, games_root: Path, bank_path: Path, out: Path, echo: Callable[[str], None] = print) -> dict:
    """The teacher and each baseline on valid_seen and valid_unseen, with the demos' bank frozen."""
    p = load_params(params_path)
    bank = Experience.load(bank_path)
    results = {}
    with EnvPool(p.workers) as pool:
        for split in ("valid_seen", "valid_unseen"):
            games = list_games(games_root, split)
            for pol in p.eval.baselines:
                label = f"{pol}-{p.episode.harness.mode}-{split}"
                r = evaluate(games, parse_policy(pol), p.episode, list(p.eval.seeds), Path(out) / label, p.workers, bank, pool=pool)
                results[label] = r["summary"]
                echo(format_table(label, r["summary"]))
    (Path(out) / "summary.json").write_text(json.dumps(results, indent=2))
    return results


def main_job(start: Path, echo: Callable[[str], None] = print) -> None:
    """Set up the default remote, reproduce the DVC pipeline, push its data, print the results."""
    from evoharness.lineage import dvc, ensure_remote, repo_root

    root = repo_root(start)
    remote = ensure_remote(root)
    echo(f"DVC remote: {remote}")
    dvc(["repro"], root, stream=True)
    dvc(["push"], root)
    echo("pushed every output to the remote; dvc.lock records their hashes")
    summary = json.loads((root / "data" / "baselines" / "summary.json").read_text())
    for label, s in summary.items():
        echo(format_table(label, s))
    demos = json.loads((root / "data" / "metrics" / "demos.json").read_text())
    pairs = json.loads((root / "data" / "metrics" / "pairs.json").read_text())
    echo(f"teacher demos: {demos['won']}/{demos['demos']} won; SFT pairs: {pairs['rows']['train']} train / {pairs['rows']['val']} val rows")
    comparison = root / "data" / "eval" / "comparison.md"
    if comparison.exists():
        echo("\nModels on valid_seen / valid_unseen (success % per family, calls per episode by verb):")
        echo(comparison.read_text())
