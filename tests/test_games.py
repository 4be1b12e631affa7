"""Offline ALFWorld games: six families per split, solvable on the real engine, official layout."""

from __future__ import annotations

import json
import random
import re

from evoharness.agent.alfworld.families import DEFAULT_UNSEEN_SCENES, FAMILIES
from evoharness.agent.alfworld.games import list_games


def test_every_family_in_every_split(games_root):
    for split in ("train", "valid_seen", "valid_unseen"):
        games = list_games(games_root, split)
        assert sorted(g.family for g in games) == sorted(FAMILIES), split
        assert all(g.error is None for g in games)


def test_expert_walkthrough_wins_on_the_engine(games_root, pool):
    """Replay each stored walkthrough on a fresh engine: every game must be won."""
    games = [g for s in ("train", "valid_seen", "valid_unseen") for g in list_games(games_root, s)]

    def replay(worker, game):
        data = json.loads(open(game.path).read())
        assert data["solvable"] is True and data["walkthrough"]
        step = worker.reset(game.path, 0)
        for cmd in data["walkthrough"]:
            assert cmd in step.admissible, (game.id, cmd)
            step = worker.step(cmd)
        return step.won

    assert all(pool.map(replay, games))


def test_official_layout_and_scene_splits(games_root):
    scenes = {}
    for split in ("train", "valid_seen", "valid_unseen"):
        for g in list_games(games_root, split):
            task_dir = g.id.split("/")[1]
            task, obj, mrecep, recep, scene = task_dir.split("-")
            assert task == g.family and mrecep == "None"
            traj = json.loads((games_root / g.id / "traj_data.json").read_text())
            assert traj["task_type"] == g.family
            assert set(traj["pddl_params"]) >= {"object_target", "parent_target", "toggle_target", "mrecep_target", "object_sliced"}
            game = json.loads((games_root / g.id / "game.tw-pddl").read_text())
            assert set(game) >= {"pddl_domain", "grammar", "pddl_problem", "solvable", "walkthrough"}
            assert "UNKNOWN GOAL" not in game["grammar"]
            scenes.setdefault(split, set()).add(int(scene))
    assert not scenes["valid_unseen"] - set(DEFAULT_UNSEEN_SCENES)
    assert not scenes["train"] & set(DEFAULT_UNSEEN_SCENES)
    assert scenes["valid_seen"] <= scenes["train"]


def test_alfworld_own_loader_lists_our_games(games_root):
    """ALFWorld's AlfredTWEnv (its own game collector) accepts the generated layout."""
    from alfworld.agents.environment.alfred_tw_env import AlfredTWEnv

    config = {
        "env": {"goal_desc_human_anns_prob": 0, "task_types": [1, 2, 3, 4, 5, 6]},
        "dataset": {"data_path": str(games_root / "train"), "eval_id_data_path": str(games_root / "valid_seen"),
                    "eval_ood_data_path": str(games_root / "valid_unseen"), "num_train_games": -1, "num_eval_games": -1},
    }
    env = AlfredTWEnv(config, train_eval="eval_out_of_distribution")
    assert env.num_games == 6


def test_generation_is_deterministic():
    from evoharness.agent.alfworld.problem import problem_pddl, sample_problem
    from evoharness.agent.alfworld.scenes import load_scene

    texts = []
    for _ in range(2):
        rng = random.Random(1234)
        p = sample_problem(load_scene(12), "pick_two_obj_and_place", rng, max_per_type=4, distractors=4)
        texts.append(problem_pddl(p, "plan_x"))
    assert texts[0] == texts[1]
    assert sum(1 for line in texts[0].splitlines() if line.startswith("(objectType") and p.object_target + "Type" in line) >= 2


def test_missing_receptacles_get_ids_and_points():
    from evoharness.agent.alfworld.scenes import load_scene

    scene = load_scene(1)  # FloorPlan1's openable file has no GarbageCan, CoffeeMachine, Toaster...
    types = scene.receptacle_types
    assert {"GarbageCan", "CoffeeMachine", "Toaster", "StoveBurner"} <= types
    locs = [r.location for r in scene.receptacles]
    assert len(locs) == len(set(locs))


def test_official_data_used_when_alfworld_data_is_set(games_root, tmp_path, monkeypatch):
    official = tmp_path / "alfworld" / "json_2.1.1"
    official.parent.mkdir()
    official.symlink_to(games_root)
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path / "alfworld"))
    games = list_games(None, "valid_seen")
    assert len(games) == 6 and all(g.path.startswith(str(official)) for g in games)


def test_grpo_games_share_no_problem_with_the_games(games_root, tmp_path):
    """The grpo_games stage's generator: another root's PDDL problems are skipped, never kept."""
    from evoharness.agent.alfworld.generate import GenConfig, generate, problem_keys

    keys = problem_keys(games_root)
    assert len(keys) == 18  # 6 families x 3 splits, all distinct
    fams = ["pick_and_place_simple", "look_at_obj_in_light"]
    out = tmp_path / "grpo_games"
    # games_root's own seed: each family's first solvable draw is games_root's train game
    s = generate(out, GenConfig(seed=7, per_family={"train": 1}, families=fams, avoid=frozenset(keys)))
    new = problem_keys(out)
    assert len(new) == 2 and not set(new) & set(keys)
    assert all(s["splits"]["train"][FAMILIES[f]]["shared_skipped"] >= 1 for f in fams), s
    assert not (out / "valid_seen").exists() and not (out / "valid_unseen").exists()
    # without the avoided set the same seed gives games_root's problems back (the test above is not vacuous)
    again = generate(tmp_path / "plain", GenConfig(seed=7, per_family={"train": 1}, families=fams))
    assert set(problem_keys(tmp_path / "plain")) <= set(keys) and "shared_skipped" not in again["splits"]["train"][FAMILIES[fams[0]]]


def test_grpo_games_section_and_bad_input(tmp_path):
    import subprocess
    import sys

    import pytest

    from evoharness.core.config import load_params
    from evoharness.core.errors import EvoError

    p = tmp_path / "bad.yaml"
    p.write_text("grpo_games: {seed: 3, per_family: {train: 2, valid_seen: 1}}\n")
    with pytest.raises(EvoError, match="grpo_games.per_family: .*only train games"):
        load_params(p)
    cli = [sys.executable, "-m", "evoharness.cli", "games"]
    r = subprocess.run(cli + ["--section", "grpo_games", "--disjoint-from", str(tmp_path / "none"), "--out", str(tmp_path / "g")],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "none: no games to stay disjoint from" in r.stderr, r.stderr
    r = subprocess.run(cli + ["--section", "gmaes", "--out", str(tmp_path / "g")], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == "error: --section: unknown section 'gmaes' (known: games, grpo_games, panel)", r.stderr
    assert not (tmp_path / "g").exists()


PAYLOAD = "{__import__('os').system('touch {marker}')}"


def test_a_game_file_that_could_run_code_is_refused_by_content_and_nothing_runs(games_copy, tmp_path):
    """TextWorld evaluates ``{...}`` in a grammar as Python: a payload planted in any field of a game file
    (the grammar's goal or any rule, the domain, the problem) is refused in one line naming the file, by
    ``list_games`` (evaluate, GRPO's rollouts, a pool job) and by ``play``; the payload never runs."""
    import subprocess
    import sys

    import pytest

    from evoharness.core.errors import EvoError

    game = sorted(games_copy.glob("valid_seen/*/*/game.tw-pddl"))[0]
    clean = json.loads(game.read_text())
    assert list_games(games_copy, "valid_seen")  # the generated games are accepted as they are
    marker = tmp_path / "ran"
    payload = PAYLOAD.replace("{marker}", str(marker))
    from evoharness.agent.alfworld.games import _trusted

    _, prefix, suffix = _trusted()
    goal = clean["grammar"][len(prefix):len(clean["grammar"]) - len(suffix)]
    plants = {
        "the grammar's goal": dict(clean, grammar=prefix + goal + " " + payload + suffix),
        "a grammar rule": dict(clean, grammar=prefix + goal + suffix.replace("\n", payload + "\n", 3)),
        "the domain": dict(clean, pddl_domain=clean["pddl_domain"] + f"\n; {payload}"),
        "the problem": dict(clean, pddl_problem=clean["pddl_problem"].replace(")", f") ; {payload}\n", 1)),
    }
    for where, data in plants.items():
        game.write_text(json.dumps(data))
        with pytest.raises(EvoError, match=rf"game file {re.escape(str(game))} refused: .*games are data, never code"):
            list_games(games_copy, "valid_seen")
        r = subprocess.run([sys.executable, "-m", "evoharness.cli", "play", str(game.parent)], capture_output=True, text=True, timeout=300)
        lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
        assert r.returncode == 2 and lines[-1].startswith(f"error: game file {game} refused"), (where, r.stderr[-2000:])
        assert not marker.exists(), where
    game.write_text(json.dumps(clean))
    assert len(list_games(games_copy, "valid_seen")) == 6


def test_games_write_only_the_splits_they_regenerate_and_never_into_an_official_folder(tmp_path):
    import subprocess
    import sys

    import yaml

    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["games"]["families"] = ["pick_and_place_simple"]
    params["grpo_games"] = {"seed": 3, "per_family": {"train": 1}}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(params))
    out = tmp_path / "g"
    kept = out / "valid_seen" / "someone-elses" / "trial_1" / "traj_data.json"
    kept.parent.mkdir(parents=True)
    kept.write_text("{}")
    cli = [sys.executable, "-m", "evoharness.cli", "games", "--params", str(tmp_path / "p.yaml")]
    r = subprocess.run(cli + ["--section", "grpo_games", "--out", str(out)], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert kept.read_text() == "{}" and len(list((out / "train").glob("*/*/game.tw-pddl"))) == 1  # valid_seen was not regenerated: kept
    official = tmp_path / "alfworld" / "json_2.1.1"
    (official / "train" / "x").mkdir(parents=True)
    r = subprocess.run(cli + ["--section", "grpo_games", "--out", str(official)], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    errors = [ln[ln.index("error: "):] for ln in r.stderr.splitlines() if "error: " in ln]  # (after the progress bar's line)
    assert r.returncode == 2 and errors == [f"error: games --out {official}: is an official ALFWorld json_2.1.1 folder; generated games go elsewhere (its splits are never replaced)"], r.stderr
    assert (official / "train" / "x").is_dir()
