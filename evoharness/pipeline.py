"""The main job as plain library calls: games -> teacher demos -> evaluation of the teacher and
the baselines on seen and unseen. (Prefect flows wrap the same steps.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from evoharness.alfworld.games import list_games
from evoharness.config import load_params
from evoharness.envpool import EnvPool
from evoharness.evaluate import evaluate, format_table
from evoharness.harness.experience import Experience
from evoharness.policies import PolicySpec, parse_policy


def foundation(params_path: str, data: Path, echo: Callable[[str], None] = print) -> dict:
    from evoharness.alfworld.generate import GenConfig, generate
    from evoharness.collect import collect

    p = load_params(params_path)
    g = p.games
    data = Path(data)
    generate(
        data / "games",
        GenConfig(p.seed, dict(g.per_family), list(g.families), tuple(g.unseen_scenes), g.max_per_type, g.distractors, g.max_expert_steps, p.workers),
    )
    demos = collect(list_games(data / "games", "train"), PolicySpec(kind="teacher", noise=p.demos.noise), p.episode, p.demos.n, data / "demos", p.demos.batch_size, p.workers, p.seed)
    echo(f"teacher demos: {demos['won']}/{demos['demos']} won (noise {p.demos.noise}); bank {demos['bank_entries']} entries")
    bank = Experience.load(data / "demos" / "experience.json")
    results = {}
    with EnvPool(p.workers) as pool:
        for split in ("valid_seen", "valid_unseen"):
            games = list_games(data / "games", split)
            for pol in p.eval.baselines:
                spec = parse_policy(pol)
                label = f"{pol}-{p.episode.harness.mode}-{split}"
                r = evaluate(games, spec, p.episode, list(p.eval.seeds), data / "eval" / label, p.workers, bank, pool=pool)
                results[label] = r["summary"]
                echo(format_table(label, r["summary"]))
    (data / "eval" / "foundation.json").write_text(json.dumps(results, indent=2))
    return results
