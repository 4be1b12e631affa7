"""Teacher demonstrations: the teacher plays the same episode code on training games, in batches,
with the Experience bank frozen during a batch and consolidated between batches."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from evoharness.agent.alfworld.games import Game
from evoharness.agent.envpool import EnvPool
from evoharness.agent.episode import EpisodeConfig
from evoharness.agent.evaluate import summarize
from evoharness.agent.harness.consolidate import consolidate
from evoharness.agent.harness.experience import Experience
from evoharness.agent.policies import PolicySpec
from evoharness.agent.rollout import JsonlWriter, run_batch
from evoharness.core import atomic
from evoharness.core.errors import EvoError


def collect(
    games: list[Game],
    spec: PolicySpec,
    cfg: EpisodeConfig,
    n_demos: int,
    out_dir: Path,
    batch_size: int = 16,
    workers: int = 2,
    seed: int = 0,
    endpoint=None,
    progress: Callable[[dict], None] | None = None,
) -> dict:
    """Write ``demos.jsonl`` (every episode, won or lost), ``experience.json``, ``edits.jsonl``
    and ``summary.json`` under out_dir. Deterministic for a seed: it starts afresh each time."""
    if not games:
        raise EvoError("collect: no training games (generate them first)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("demos.jsonl", "edits.jsonl"):
        (out_dir / name).unlink(missing_ok=True)
    bank = Experience.seeded()
    writer = JsonlWriter(out_dir / "demos.jsonl")
    edits = JsonlWriter(out_dir / "edits.jsonl")
    jobs = [(games[i % len(games)], seed * 100003 + i) for i in range(n_demos)]
    records: list[dict] = []
    with EnvPool(workers) as pool:
        for b in range(0, len(jobs), batch_size):
            batch = run_batch(pool, jobs[b : b + batch_size], spec, cfg, bank, None, progress)
            for rec in batch:  # job order, not completion order: the file hashes the same on a rerun
                writer.write(rec)
            records += batch
            for e in consolidate(bank, batch, endpoint):
                edits.write({"update": bank.updates, **e})
            bank.save(out_dir / "experience.json")
    summary = {
        "demos": len(records),
        "won": sum(r["outcome"]["won"] for r in records),
        "errored": sum(bool(r.get("error")) for r in records),
        "bank_updates": bank.updates,
        "bank_entries": len(bank.entries),
        "by_family": summarize(records),
    }
    atomic.write_json(out_dir / "summary.json", summary, indent=2)
    return summary
