"""The engine wrapper: transcripts are the same with and without the text-generation speedups."""

from __future__ import annotations

import json
import subprocess
import sys

from evoharness.agent.alfworld.games import list_games

SCRIPT = """
import json, sys
from evoharness.agent.alfworld.engine import Engine
eng = Engine(speedups={speedups})
out = []
for path in sys.argv[1:]:  # the first game comes again last: a reset of a game translated before
    s = eng.reset(path, 3)
    out.append([s.observation, s.admissible, s.expert_action])
    for cmd in json.load(open(path))["walkthrough"] + ["look", "inventory"]:
        s = eng.step(cmd)
        out.append([s.observation, s.admissible, s.won, s.expert_action])
print(json.dumps(out))
"""


def test_speedups_do_not_change_transcripts(games_root):
    paths = [g.path for g in list_games(games_root, "valid_unseen")][:3]
    outs = []
    for flag in (False, True):
        r = subprocess.run([sys.executable, "-c", SCRIPT.format(speedups=flag), *paths, paths[0]], capture_output=True, text=True, check=True)
        outs.append(json.loads(r.stdout))
    assert outs[0] == outs[1]
    assert len(outs[0]) > 10


def test_intro_banner_is_stripped_but_expert_sees_it(games_root, pool):
    game = list_games(games_root, "valid_seen")[0]
    w = pool.workers[0]
    step = w.reset(game.path, 0)
    assert "Welcome" not in step.observation and step.observation.startswith("You are in the middle of a room")
    assert step.task.startswith(("put", "look", "examine", "clean", "heat", "cool", "find"))
    assert step.expert_action is not None  # the expert parsed the receptacles from the banner
