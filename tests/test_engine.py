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


POOL_FLAGS = """
from evoharness.agent.envpool import EnvPool
if __name__ == "__main__":
    with EnvPool(1) as pool:
        w = pool.workers[0]
        print(w._call("flags", (), 60, "flags"))
"""


def test_workers_run_with_the_hash_seed_pinned_whatever_the_parents_is():
    """An episode's course must not depend on the worker's hash seed (it did: one env_only teacher episode in 400
    went two ways in two runs of the same code). The parent's seed is random here, or another fixed one."""
    import ast
    import os

    for parent in (None, "6"):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
        if parent:
            env["PYTHONHASHSEED"] = parent
        r = subprocess.run([sys.executable, "-c", POOL_FLAGS], capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        flags = ast.literal_eval(r.stdout.strip().splitlines()[-1])
        assert flags == {"PYTHONHASHSEED": "0", "hash_randomization": 0}, (parent, flags)
        if parent:  # the parent's own environment is left as it was
            assert "PYTHONHASHSEED" in env


FOREIGN_SERVER = """
import multiprocessing as mp
from evoharness.agent.envpool import EnvPool
from evoharness.core.errors import EvoError
if __name__ == "__main__":
    p = mp.get_context("forkserver").Process(target=print, args=("other code's worker",))  # starts the server unpinned
    p.start(); p.join()
    with EnvPool(1) as pool:
        try:
            pool.map(lambda w, j: w.reset(j, 0), ["no-game"])
        except EvoError as e:
            print("ERROR", e)
"""


def test_a_fork_server_started_by_other_code_stops_the_batch_in_one_line():
    """Episodes are never played on workers whose hash seed may not be pinned: the batch stops before the first."""
    r = subprocess.run([sys.executable, "-c", FOREIGN_SERVER], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("ERROR environment workers: this process's fork server") and "PYTHONHASHSEED=0" in last, r.stdout
