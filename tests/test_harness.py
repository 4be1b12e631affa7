"""The BPE workspace: every meta-action, every mode, ablations, consolidation rules, persistence."""

from __future__ import annotations

import json

import pytest

from evoharness.core.errors import EvoError
from evoharness.agent.harness import Belief, Experience, HarnessConfig, Progress, Workspace
from evoharness.agent.harness.consolidate import consolidate
from evoharness.agent.harness.experience import MAX_PER_CATEGORY, USAGE_VETO, route

INTRO = "You are in the middle of a room. Looking quickly around you, you see a cabinet 1, a countertop 1, a fridge 1, and a microwave 1."


def test_belief_tracks_receptacles_objects_opened_and_held():
    b = Belief()
    b.observe(None, INTRO)
    assert b.receptacles == ["cabinet 1", "countertop 1", "fridge 1", "microwave 1"]
    b.observe("go to fridge 1", "You arrive at fridge 1. The fridge 1 is closed.")
    b.observe("open fridge 1", "You open the fridge 1. The fridge 1 is open. In it, you see a apple 1, and a egg 2.")
    assert b.objects == {"apple 1": "fridge 1", "egg 2": "fridge 1"} and "fridge 1" in b.opened
    b.observe("take apple 1 from fridge 1", "You pick up the apple 1 from the fridge 1.")
    assert b.held == "apple 1" and "apple 1" not in b.objects
    assert b.answer("apple") == "apple 1 held"
    assert b.answer("egg") == "egg 2 in fridge 1"
    assert "cabinet 1" in b.answer("unvisited") and "fridge 1" not in b.answer("unvisited")
    b.observe("move apple 1 to countertop 1", "You move the apple 1 to the countertop 1.")
    assert b.held is None and b.objects["apple 1"] == "countertop 1"
    b.observe("go to cabinet 1", "Nothing happens.")
    assert "cabinet 1" not in b.visited  # a failed action teaches nothing


def test_track_ranks_unvisited_receptacles_by_where_experience_found_the_object():
    bank = Experience.seeded()
    bank.apply([{"op": "add", "category": "search_priorities", "key": "apple", "text": "apple is usually in: fridge (3), microwave (1)"}])
    assert bank.where_counts("where is the apple") == {"fridge": 3, "microwave": 1} and bank.where_counts("mug") == {}
    ws = Workspace(HarnessConfig(), bank)
    ws.start(INTRO)
    assert ws.handle("track", "apple") == (True, "track: not seen yet: apple; unvisited: fridge 1, microwave 1, cabinet 1, countertop 1")
    assert ws.handle("track", "mug")[1].endswith("unvisited: cabinet 1, countertop 1, fridge 1, microwave 1")  # no priority: room order
    assert ws.views()["RESULT"].startswith("track: not seen yet")
    ws.observe("go to fridge 1", "You arrive at fridge 1. The fridge 1 is closed.")
    assert ws.views()["RESULT"] == "none"  # an env action moves on: the answer was for the turn before
    assert ws.handle("track", "apple")[1].endswith("unvisited: microwave 1, cabinet 1, countertop 1")
    no_e = Workspace(HarnessConfig(experience=False), bank)  # the ablation without Experience: room order
    no_e.start(INTRO)
    assert no_e.handle("track", "apple")[1].endswith("unvisited: cabinet 1, countertop 1, fridge 1, microwave 1")


def test_progress_commit_marks_open_done_and_caps_open():
    p = Progress()
    assert p.commit("find apple").startswith("now: find apple")
    p.commit("heat apple")
    assert p.items == [("find apple", True), ("heat apple", False)]
    assert p.commit("heat apple") == "done: heat apple" and p.open == []
    p.commit("done")
    assert all(d for _, d in p.items)
    assert p.commit("") == "commit needs a subgoal"


def test_recall_routes_by_intent_and_returns_top3():
    bank = Experience.seeded()
    bank.apply([
        {"op": "add", "category": "search_priorities", "key": "apple", "text": "apple is usually in: fridge (3), countertop (1)"},
        {"op": "add", "category": "search_priorities", "key": "mug", "text": "mug is usually in: cabinet (2)"},
        {"op": "add", "category": "task_skills", "key": "pick_heat_then_place_in_recep", "text": "heat: take the apple, heat it with the microwave"},
        {"op": "add", "category": "mistakes", "key": "x", "text": "apple: do not look in the drawer"},
        {"op": "add", "category": "notes", "text": "apple 1 was in fridge"},
    ])
    assert route("where is the apple")[0] == "where"
    assert route("how do I heat the apple")[0] == "how"
    assert route("mistakes with apple")[0] == "mistakes"
    text, ids = bank.recall("where is the apple")
    assert text.startswith("apple is usually in: fridge") and len(ids) <= 3
    assert all(bank.get(i).category in ("search_priorities", "notes") for i in ids)
    text, _ = bank.recall("how to heat an apple")
    assert "microwave" in text
    text, ids = bank.recall("mistakes apple")
    assert all(bank.get(i).category == "mistakes" for i in ids) and "drawer" in text


def test_consolidation_edits_caps_veto_and_persistence(tmp_path):
    bank = Experience.seeded()
    traj = {"family": "pick_heat_then_place_in_recep", "outcome": {"won": True, "steps": 12}, "target": {"object": "apple", "receptacle": "countertop", "toggle": ""},
            "found_in": "fridge 1", "notes": ["apple was in fridge"], "recalled": [], "turns": []}
    log = consolidate(bank, [traj, {**traj, "found_in": "countertop 2", "notes": ["apple was in the fridge"]}])
    ops = {(e["op"], e.get("category")) for e in log}
    assert ("add", "search_priorities") in ops and ("add", "task_skills") in ops and ("add", "notes") in ops
    assert bank.updates == 1
    prio = next(e for e in bank.by_category("search_priorities") if e.key == "apple")
    assert prio.text == "apple is usually in: fridge (1), countertop (1)"
    consolidate(bank, [{**traj, "notes": []}])
    assert prio.text == "apple is usually in: fridge (2), countertop (1)" and bank.updates == 2
    # merge, delete, veto
    a = bank.apply([{"op": "add", "category": "notes", "text": "n1"}, {"op": "add", "category": "notes", "text": "n2"}])
    merged = bank.apply([{"op": "merge", "ids": [a[0]["id"], a[1]["id"]], "text": "n1 and n2"}])
    assert merged[0]["result"] == "applied" and bank.get(a[1]["id"]) is None
    keep = bank.get(a[0]["id"])
    bank.record_uses([keep.id] * USAGE_VETO)
    assert bank.apply([{"op": "delete", "id": keep.id}])[0]["result"].startswith("vetoed")
    # cap: a full category evicts its least-used entry, never a vetoed one
    for i in range(MAX_PER_CATEGORY + 5):
        bank.apply([{"op": "add", "category": "notes", "text": f"filler note {i}"}])
    assert len(bank.by_category("notes")) == MAX_PER_CATEGORY and bank.get(keep.id) is not None
    path = tmp_path / "bank.json"
    bank.save(path)
    again = Experience.load(path)
    assert again.to_json() == bank.to_json() and again.updates == 2


def test_usage_recorded_only_at_consolidation():
    bank = Experience.seeded()
    _, ids = bank.recall("how to take an object")
    assert ids and all(bank.get(i).uses == 0 for i in ids)  # read-only during a batch
    consolidate(bank, [{"family": "pick_and_place_simple", "outcome": {"won": False, "steps": 50}, "target": {}, "notes": [], "recalled": ids, "turns": []}])
    assert all(bank.get(i).uses == 1 for i in ids)


def test_bad_bank_file_is_a_clear_error(tmp_path):
    p = tmp_path / "bank.json"
    p.write_text('{"updates": 1, "next_id": 0, "entries": [{"id": "e0", "category": "gossip", "text": "x"}]}')
    with pytest.raises(EvoError, match="bank.json: malformed .*gossip"):
        Experience.load(p)
    with pytest.raises(EvoError, match="does not exist"):
        Experience.load(tmp_path / "none.json")


def test_modes_and_ablations_decide_which_verbs_exist():
    assert HarnessConfig(mode="env_only").verbs == ()
    assert HarnessConfig(mode="always_on").verbs == ()
    assert HarnessConfig(mode="inline").verbs == ("track", "commit", "recall", "note")
    assert HarnessConfig(mode="inline", experience=False).verbs == ("track", "commit")
    ws = Workspace(HarnessConfig(mode="inline", belief=False), Experience.seeded(), task="put a apple in fridge")
    ws.start(INTRO)
    assert ws.handle("track", "apple") == (False, "Nothing happens.")
    ok, text = ws.handle("commit", "find apple")
    assert ok and ws.views()["PLAN"] == "[ ] find apple" and ws.views()["RESULT"] == text
    ok, _ = ws.handle("note", "apple in fridge")
    assert ok and ws.notes == ["apple in fridge"]
    on = Workspace(HarnessConfig(mode="always_on"), Experience.seeded(), task="take an object and heat it")
    on.start(INTRO)
    assert set(on.views()) == {"BELIEF", "PLAN", "HINTS"} and on.views()["HINTS"] != "none"
    assert Workspace(HarnessConfig(mode="env_only"), None).views() == {}


def test_config_rejects_unknown_fields():
    with pytest.raises(Exception, match="extra"):
        HarnessConfig(mode="inline", beleif=True)
    with pytest.raises(Exception):
        HarnessConfig(mode="sometimes")
    assert json.loads(HarnessConfig().model_dump_json())["mode"] == "inline"


def test_look_and_examine_leave_belief_as_it_was():
    """ALFWorld's `look` answers "Next to it, you see nothing.": that says nothing of what is on the desk."""
    b = Belief()
    b.observe(None, INTRO)
    b.observe("go to countertop 1", "You arrive at countertop 1. On the countertop 1, you see a mug 1, and a potato 1.")
    b.observe("look", "You are facing the countertop 1. Next to it, you see nothing.")
    assert b.objects == {"mug 1": "countertop 1", "potato 1": "countertop 1"}
    b.observe("examine countertop 1", "On the countertop 1, you see a mug 1.")  # a real listing does update it
    assert b.objects == {"mug 1": "countertop 1"}


def test_track_matches_the_exact_type_never_a_substring():
    b = Belief()
    b.observe(None, "Looking quickly around you, you see a cabinet 1, a countertop 1, a drawer 1, and a stoveburner 1.")
    b.observe("go to countertop 1", "You arrive at countertop 1. On the countertop 1, you see a potato 1, a pencil 2, and a butterknife 1.")
    assert b.answer("pot").startswith("not seen yet: pot; unvisited: cabinet 1, drawer 1")
    assert b.answer("pen").startswith("not seen yet: pen") and b.answer("knife").startswith("not seen yet: knife")
    assert b.answer("potato") == "potato 1 in countertop 1" and b.answer("pencil 2") == "pencil 2 in countertop 1"


def test_track_marks_what_the_agent_placed_and_goes_on_to_the_unvisited():
    """Pick2, second object: the apple already placed is not the apple to find."""
    b = Belief()
    b.observe(None, INTRO)
    b.observe("go to countertop 1", "You arrive at countertop 1. On the countertop 1, you see a apple 1.")
    b.observe("take apple 1 from countertop 1", "You pick up the apple 1 from the countertop 1.")
    b.observe("go to fridge 1", "You arrive at fridge 1. The fridge 1 is closed.")
    b.observe("move apple 1 to fridge 1", "You move the apple 1 to the fridge 1.")
    assert b.answer("apple") == "apple 1 in fridge 1 (placed by you); not seen elsewhere yet: apple; unvisited: cabinet 1, microwave 1"
    assert b.where("apple") == []
    b.observe("go to cabinet 1", "You arrive at cabinet 1. On the cabinet 1, you see a apple 2.")
    assert b.answer("apple") == "apple 1 in fridge 1 (placed by you); apple 2 in cabinet 1" and b.where("apple") == [("apple 2", "cabinet 1")]


def test_an_empty_commit_is_invalid_like_an_empty_note():
    ws = Workspace(HarnessConfig(), Experience.seeded())
    ws.start(INTRO)
    assert ws.handle("commit", "") == (False, "commit needs a subgoal")
    assert ws.handle("note", "") == (False, "note needs an insight")
    assert ws.handle("commit", "find apple")[0]


def test_always_on_runs_the_harness_every_turn():
    """The frozen harness: PLAN follows the subgoals the actions achieve, HINTS follow PLAN, BELIEF
    ranks the unvisited receptacles for the objective's object."""
    bank = Experience.seeded()
    bank.apply([{"op": "add", "category": "search_priorities", "key": "apple", "text": "apple is usually in: fridge (3), microwave (1)"},
                {"op": "add", "category": "task_skills", "key": "pick_heat_then_place_in_recep", "text": "heat: take the apple, heat it with the microwave"}])
    ws = Workspace(HarnessConfig(mode="always_on"), bank, task="put a hot apple in countertop.", family="pick_heat_then_place_in_recep")
    ws.start(INTRO)
    v = ws.views()
    assert v["PLAN"] == "(empty)" and "unvisited (likeliest first for apple): fridge 1, microwave 1, cabinet 1, countertop 1" in v["BELIEF"]
    before = v["HINTS"]
    ws.observe("go to fridge 1", "You arrive at fridge 1. The fridge 1 is open. In it, you see a apple 1.")
    ws.observe("take apple 1 from fridge 1", "You pick up the apple 1 from the fridge 1.")
    v = ws.views()
    assert v["PLAN"] == "[ ] take apple 1" and "holding: apple 1" in v["BELIEF"]
    ws.observe("heat apple 1 with microwave 1", "You heat the apple 1 using the microwave 1.")
    assert ws.views()["PLAN"] == "[x] take apple 1; [ ] heat apple 1" and ws.views()["HINTS"] != before


def test_an_llm_merge_cannot_delete_what_it_names_twice_and_a_bad_support_is_rejected():
    bank = Experience.seeded()
    e0 = bank.entries[0]
    e0.uses = USAGE_VETO
    log = bank.apply([{"op": "merge", "ids": [e0.id, e0.id], "text": "x"}, {"op": "add", "category": "notes", "text": "n", "support": "high"}])
    assert [x["result"] for x in log] == ["rejected: merge needs 2+ entries of one category", "rejected: support 'high' is not a number"]
    assert bank.get(e0.id) is e0 and e0.text != "x"
