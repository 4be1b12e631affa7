"""Run many episodes over the environment workers, appending each trace as it finishes."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Callable

from evoharness.agent.alfworld.games import Game
from evoharness.agent.envpool import EnvPool
from evoharness.agent.episode import EpisodeConfig, run_episode
from evoharness.agent.harness.experience import Experience
from evoharness.agent.policies import PolicySpec, make_policy


class JsonlWriter:
    """Append-only JSONL; a line cut short by a killed run is closed off, never overwritten."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() and self.path.stat().st_size:
            with open(self.path, "rb") as f:
                f.seek(-1, 2)
                if f.read(1) != b"\n":
                    with open(self.path, "a") as g:
                        g.write("\n")
        self._lock = threading.Lock()

    def write(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False)
        with self._lock, open(self.path, "a") as f:
            f.write(line + "\n")


def read_jsonl(path: Path) -> tuple[list[dict], list[int]]:
    """Records and the line numbers that did not parse (kept in the file, reported)."""
    records, bad = [], []
    if not Path(path).exists():
        return records, bad
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except ValueError:
                bad.append(i)
    return records, bad


def run_batch(
    pool: EnvPool,
    jobs: list[tuple[Game, int]],
    spec: PolicySpec,
    cfg: EpisodeConfig,
    bank: Experience | None,
    writer: JsonlWriter | None = None,
    progress: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Episodes for (game, seed) jobs, in job order. The bank is read-only throughout."""

    def one(worker, job):
        game, seed = job
        return run_episode(worker, game, make_policy(spec), cfg, bank, seed).to_json()

    def done(job, rec):
        if writer is not None:
            writer.write(rec)
        if progress is not None:
            progress(rec)

    probe = make_policy(spec)  # a model policy decodes the episodes' turns in lockstep rounds (reproducible batches)
    around = (lambda t: probe.session(t)) if hasattr(probe, "session") else None
    return pool.map(one, jobs, on_result=done, around=around)
