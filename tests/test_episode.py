"""The episode engine on the real engine: parsing, budget, modes, trace, reward, prompt identity."""

from __future__ import annotations

import json

import pytest

from evoharness.agent.alfworld.games import list_games
from evoharness.agent.collect import collect
from evoharness.agent.episode import EpisodeConfig, build_prompt, parse_response, run_episode
from evoharness.agent.evaluate import evaluate
from evoharness.agent.harness import Experience, HarnessConfig
from evoharness.agent.policies import PolicySpec, make_policy
from evoharness.agent.reward import RewardConfig, components, diversity_weight, total


class Script:
    """A policy that replays fixed responses (then repeats the last one)."""

    name = "script"

    def __init__(self, responses):
        self.responses = list(responses)
        self.i = 0

    def fingerprint(self):
        return "script:" + "|".join(self.responses)

    def reset(self, seed):
        self.i = 0

    def act(self, prompt, view, privileged):
        r = self.responses[min(self.i, len(self.responses) - 1)]
        self.i += 1
        return r


def test_parse_response():
    assert parse_response("<think>go</think>\n<action>go to fridge 1</action>").action == "go to fridge 1"
    p = parse_response("<think>x</think>\n<action>recall [where is the apple]</action>")
    assert (p.verb, p.argument) == ("recall", "where is the apple")
    assert parse_response("<think>x</think><action>a</action><action>b</action>").error
    assert parse_response("go to fridge 1").error
    assert parse_response("<think>x</think>\n<action> </action>").error
    assert parse_response("chatter <think>x</think>\n<action>look</action>").error


def test_reward_matches_hand_computation():
    cfg = RewardConfig()
    assert diversity_weight(0, cfg) == pytest.approx(1.0)
    assert diversity_weight(75, cfg) == pytest.approx(0.5)
    assert diversity_weight(150, cfg) == pytest.approx(0.0) and diversity_weight(400, cfg) == pytest.approx(0.0)
    c = components(True, 20, 50, {"track": 1, "commit": 2, "recall": 0, "note": 0}, repeats=3, invalid=2)
    assert c == {"success": 1.0, "efficiency": 0.6, "diversity": 0.5, "repeats": 3.0, "invalid": 2.0}
    # 10 + 1*0.6 + 0.5*0.5 - 0.1*3 - 0.1*2 = 10.35 at u = 75
    assert total(c, 75, cfg) == pytest.approx(10.35)
    lost = components(False, 50, 50, {"track": 0, "commit": 0, "recall": 0, "note": 0}, repeats=20, invalid=5)
    assert total(lost, 0, cfg) == pytest.approx(-1.0 - 0.5)


def test_a_repeat_is_the_same_meta_action_again_before_any_env_action(games_root, pool):
    game = list_games(games_root, "valid_seen")[0]
    track, look = "<think>x</think>\n<action>track egg</action>", "<think>x</think>\n<action>look</action>"
    t = run_episode(pool.workers[0], game, Script([track, track, look, track, look]), EpisodeConfig(max_steps=2, max_turns=10), Experience.seeded(), 0)
    assert [x.kind for x in t.turns] == ["track", "track", "env", "track", "env"]
    assert t.outcome["calls"]["track"] == 3 and t.outcome["repeats"] == 1  # the second call only: the third follows a step


def test_invalid_outputs_cost_a_step_and_say_nothing_happens(games_root, pool):
    game = list_games(games_root, "valid_seen")[0]
    policy = Script(["no tags at all", "<think>x</think>\n<action>fly to the moon</action>", "<think>x</think>\n<action>look</action>"])
    t = run_episode(pool.workers[0], game, policy, EpisodeConfig(max_steps=3), None, 0)
    assert [x.kind for x in t.turns] == ["invalid", "invalid", "env"]
    assert t.turns[1].observation == "Nothing happens."
    assert t.outcome["invalid"] == 2 and t.outcome["steps"] == 3 and not t.outcome["won"]
    assert "OBSERVATION: Nothing happens." in t.turns[2].prompt


def test_meta_actions_are_free_unless_charged(games_root, pool):
    game = list_games(games_root, "valid_seen")[0]
    script = ["<think>x</think>\n<action>track</action>", "<think>x</think>\n<action>commit find it</action>", "<think>x</think>\n<action>look</action>"]
    free = run_episode(pool.workers[0], game, Script(script), EpisodeConfig(max_steps=2), Experience.seeded(), 0)
    charged = run_episode(pool.workers[0], game, Script(script), EpisodeConfig(max_steps=2, harness=HarnessConfig(charge_meta_actions=True)), Experience.seeded(), 0)
    assert [x.kind for x in free.turns] == ["track", "commit", "env", "env"]
    assert [x.kind for x in charged.turns] == ["track", "commit"]
    assert free.outcome["calls"]["track"] == 1 and charged.outcome["steps"] == 2
    off = run_episode(pool.workers[0], game, Script(script), EpisodeConfig(max_steps=2, harness=HarnessConfig(mode="env_only")), None, 0)
    assert [x.kind for x in off.turns] == ["invalid", "invalid"]  # no verbs in env_only


def test_teacher_uses_every_verb_and_wins_in_inline_mode(games_root, pool):
    games = list_games(games_root, "valid_unseen")
    cfg = EpisodeConfig()
    trajs = pool.map(lambda w, g: run_episode(w, g, make_policy(PolicySpec(kind="teacher")), cfg, Experience.seeded(), 0), games)
    assert all(t.outcome["won"] for t in trajs), [t.game_id for t in trajs if not t.outcome["won"]]
    used = {v for t in trajs for v, n in t.outcome["calls"].items() if n}
    assert used == {"track", "commit", "recall", "note"}
    searches = 0
    for t in trajs:
        assert t.turns[0].action.startswith("recall") and t.found_in
        # Every search move follows a track of the sought object and goes where its answer points first.
        for prev, turn in zip(t.turns, t.turns[1:]):
            if prev.action.startswith("track ") and "unvisited: " in turn.prompt.split("RESULT: ")[1] and turn.action.startswith("go to "):
                first = turn.prompt.split("unvisited: ")[1].split(",")[0].split("\n")[0]
                assert turn.action == f"go to {first}", (t.game_id, turn.action, first)
                searches += 1
        assert all(x.prompt.startswith("You are a household agent") for x in t.turns)
    assert searches >= len(trajs)
    env_only = pool.map(lambda w, g: run_episode(w, g, make_policy(PolicySpec(kind="teacher")), EpisodeConfig(harness=HarnessConfig(mode="env_only")), None, 0), games)
    assert all(t.outcome["won"] and sum(t.outcome["calls"].values()) == 0 for t in env_only)
    assert all("track [query]" not in x.prompt for t in env_only for x in t.turns)


def test_prompts_identical_between_collection_and_evaluation(games_root, tmp_path):
    """A demo's prompts are byte-identical to what evaluation builds for the same game and seed."""
    games = list_games(games_root, "train")[:2]
    spec = PolicySpec(kind="teacher")
    cfg = EpisodeConfig()
    collect(games, spec, cfg, n_demos=2, out_dir=tmp_path / "demos", batch_size=2, workers=1, seed=0)
    demos = [json.loads(x) for x in (tmp_path / "demos" / "demos.jsonl").read_text().splitlines()]
    for d in demos:
        game = next(g for g in games if g.id == d["game_id"])
        r = evaluate([game], spec, cfg, [d["seed"]], tmp_path / f"eval-{d['seed']}", workers=1, bank=Experience.seeded())
        ev = [json.loads(x) for x in (tmp_path / f"eval-{d['seed']}" / "episodes.jsonl").read_text().splitlines()][0]
        assert [t["prompt"] for t in ev["turns"]] == [t["prompt"] for t in d["turns"]]
        assert r["played"] == 1
    assert build_prompt.__module__ == "evoharness.agent.episode"


def test_an_invalid_turn_changes_the_next_prompt(games_root, pool):
    """Else a greedy policy, seeing the byte-identical prompt again, repeats itself to the end."""
    game = list_games(games_root, "valid_seen")[0]
    script = ["<think>x</think>\n<action>track egg</action>", "not a reply", "<think>x</think>\n<action>commit</action>",
              "<think>x</think>\n<action>look</action>"]
    t = run_episode(pool.workers[0], game, Script(script), EpisodeConfig(max_steps=3, max_turns=6), Experience.seeded(), 0)
    prompts = [x.prompt for x in t.turns]
    assert [x.kind for x in t.turns] == ["track", "invalid", "invalid", "env"] and len(set(prompts)) == len(prompts)
    assert "RESULT: none" in prompts[2] and "OBSERVATION: Nothing happens." in prompts[2] and "(invalid reply)" in prompts[2]
    assert "RESULT: commit: invalid (commit needs a subgoal)" in prompts[3]
    assert t.outcome["steps_free"] == 3 and t.outcome["steps_charged"] == 4  # both budgets reported


def test_every_move_the_teacher_makes_on_information_is_on_the_students_screen(games_root, pool):
    """Replay the teacher's demos: each move to a receptacle that finds an object (not the objective's
    destination, nor the recipe's appliance) names its receptacle in the prompt it was chosen from,
    in RESULT, OBSERVATION or PLAN."""
    games = list_games(games_root, "train") + list_games(games_root, "valid_seen")
    trajs = pool.map(lambda w, g: run_episode(w, g, make_policy(PolicySpec(kind="teacher", noise=0.2)), EpisodeConfig(), Experience.seeded(), 0), games)
    appliances = {"pick_heat_then_place_in_recep": "microwave", "pick_cool_then_place_in_recep": "fridge", "pick_clean_then_place_in_recep": "sinkbasin"}
    checked = 0
    for t in trajs:
        dest, app = t.target["receptacle"], appliances.get(t.family)
        for turn in t.turns:
            if turn.kind != "env" or not turn.action.startswith("go to ") or "I try something else" in turn.response:
                continue
            where = turn.action[len("go to "):]
            kind = where.rsplit(" ", 1)[0]
            if kind in (dest, app):
                continue
            screen = {k: v for k, v in (ln.split(": ", 1) for ln in turn.prompt.splitlines() if ": " in ln)}
            assert any(where in screen.get(k, "") for k in ("RESULT", "OBSERVATION", "PLAN")), (t.game_id, turn.t, turn.action, screen.get("RESULT"))
            checked += 1
    assert checked >= len(trajs)
