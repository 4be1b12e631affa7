"""The scripted teacher: ALFWorld's handcoded expert for env actions, with BPE meta-actions where
a good agent would use them.

recall at the start; commit each subgoal as the task moves on; note after finding and taking
the target. Every move the teacher makes on information is put on the student's screen first:
before each move to find an object (the task's object, Pick2's second one, the Look task's lamp) it
calls ``track <object>`` and goes where the answer points: the receptacle it was seen in (one it did
not place itself), else the first unvisited receptacle, ranked by where Experience says the object
usually is. In ``always_on`` it follows the BELIEF panel's order, in ``env_only`` the room's. That
replaces the expert's own search, which reads the first turn's room listing and its private memory
of where each object class was seen: the student sees neither. Moves to the destination or an
appliance follow the objective and the recipe. ``noise`` replaces an expert step by a random
admissible command, so that some demos fail, as the paper's teacher did (87 of 500 kept).
"""

from __future__ import annotations

import random
import re

from evoharness.agent.episode import Privileged, TurnView, format_response
from evoharness.agent.harness.belief import object_type

# The think of a noise step (a random admissible command). SFT pairs skip these turns as targets:
# they stay in later turns' history, but the student is not taught to act at random.
DETOUR_THINK = "I try something else here."


def _next_subgoal(family: str, target: dict, event: str) -> str | None:
    obj, recep, toggle = target["object"], target["receptacle"], target["toggle"]
    if event == "took":
        return {
            "pick_clean_then_place_in_recep": f"clean {obj}",
            "pick_heat_then_place_in_recep": f"heat {obj}",
            "pick_cool_then_place_in_recep": f"cool {obj}",
            "look_at_obj_in_light": f"find {toggle}",
        }.get(family, f"put {obj} in {recep}")
    if event == "transformed":
        return f"put {obj} in {recep}"
    if event == "placed_first" and family == "pick_two_obj_and_place":
        return f"find second {obj}"
    return None


def _think(action: str, target: dict) -> str:
    obj = target["object"] or "object"
    verb, _, rest = action.partition(" ")
    if action.startswith("go to "):
        return f"I go to the {action[6:]} to look for what I need."
    return {
        "open": f"The {rest} is closed; I open it to look inside.",
        "close": f"I close the {rest}.",
        "take": f"I take the {rest.split(' from ')[0]}.",
        "move": f"I put the {rest.split(' to ')[0]} in the {rest.split(' to ')[-1]}.",
        "heat": f"I heat the {obj} with the microwave.",
        "cool": f"I cool the {obj} with the fridge.",
        "clean": f"I clean the {obj} in the sink.",
        "use": f"I turn on the {rest} while holding the {obj}.",
        "examine": f"I examine the {rest}.",
    }.get(verb, "I try this command.")


class TeacherPolicy:
    name = "teacher"

    def __init__(self, noise: float = 0.0):
        self.noise = noise
        self.reset(0)

    def fingerprint(self) -> str:
        return f"teacher:v2:noise={self.noise}"

    def reset(self, seed: int) -> None:
        self.rng = random.Random(f"teacher/{seed}/{self.noise}")
        self.queue: list[tuple[str, str]] = []
        self.started = False
        self.placed = 0
        self.detoured = False

    def _queue(self, verbs, verb: str, arg: str, think: str) -> None:
        if verb in verbs:
            self.queue.append((think, f"{verb} {arg}"))

    def _events(self, view: TurnView, p: Privileged) -> None:
        """Read what the last env action did and queue the meta-actions it calls for."""
        verbs, t = view.verbs, p.target
        obj = t["object"]
        hist = view.last_actions
        if not hist:
            return
        last, obs = hist[-1], view.observation  # one new action per turn: each event is read once
        if last.split(" ")[0] in ("track", "commit", "recall", "note"):
            return
        if obs.startswith("Nothing happens"):
            return
        if last.startswith(f"take {obj} ") and "You pick up" in obs:
            recep = last.split(" from ")[-1]
            self._queue(verbs, "note", f"{obj} was in {object_type(recep)}", f"I found the {obj} in the {recep}; worth remembering.")
            nxt = _next_subgoal(p.family, t, "took")
            if nxt:
                self._queue(verbs, "commit", nxt, f"I have the {obj}; next I {nxt}.")
        elif re.match(r"(clean|heat|cool) ", last) and obj in last:
            nxt = _next_subgoal(p.family, t, "transformed")
            self._queue(verbs, "commit", nxt, f"The {obj} is ready; next I {nxt}.")
        elif last.startswith(f"move {obj} ") and "You move" in obs:
            self.placed += 1
            if self.placed == 1:
                nxt = _next_subgoal(p.family, t, "placed_first")
                if nxt:
                    self._queue(verbs, "commit", nxt, f"One {obj} is placed; next I {nxt}.")
        if self.detoured:  # back from a random step: the next search move tracks again anyway
            self.detoured = False

    def _target(self, p: Privileged) -> str | None:
        """The object type a move to a receptacle would be for: the task's object while nothing is
        held (again for Pick2's second one), the lamp while holding the object in a Look task; None
        when the move is to the destination or an appliance (named by the objective or the recipe)."""
        t, belief = p.target, p.workspace.belief
        if belief.held is None:
            return t["object"]
        if p.family == "look_at_obj_in_light" and t.get("toggle") and belief.held.startswith(f"{t['object']} "):
            return t["toggle"]
        return None

    @staticmethod
    def _ranking(p: Privileged, target: str) -> dict[str, int] | None:
        """The search order the student is shown: ``track``'s answer (inline), the BELIEF panel's
        (always_on), or the room's own order (env_only shows neither)."""
        ws = p.workspace
        if ws.config.mode == "inline":
            return ws.search_priority(target)
        if ws.config.mode == "always_on":
            sought = ws.sought()
            return ws.bank.where_counts(sought) if sought else None
        return None

    def act(self, prompt: str, view: TurnView, privileged: Privileged) -> str:
        p, verbs = privileged, view.verbs
        if not self.started:
            self.started = True
            self._queue(verbs, "recall", f"where is the {p.target['object']}", f"Before searching, I recall where a {p.target['object']} usually is.")
            first = f"find {p.target['object']}"
            self._queue(verbs, "commit", first, f"My first subgoal is to {first}.")
        else:
            self._events(view, p)
        if self.queue:
            think, action = self.queue.pop(0)
            return format_response(think, action)
        action = p.expert_action
        target = self._target(p) if action and action.startswith("go to ") else None
        if target:  # a move on information: put it on screen first (track), then move as it says
            belief = p.workspace.belief
            if "track" in verbs and (not view.last_actions or view.last_actions[-1] != f"track {target}"):
                return format_response(f"Where is a {target}? Let me check what I know.", f"track {target}")
            known = [r for _, r in belief.where(target) if r != belief.location]
            order = known or belief.unvisited(self._ranking(p, target))
            if order and f"go to {order[0]}" in view.admissible:
                action = f"go to {order[0]}"
        if action is None or action not in view.admissible or (self.noise and self.rng.random() < self.noise):
            action = self.rng.choice(view.admissible)
            self.detoured = True
            return format_response(DETOUR_THINK, action)
        return format_response(_think(action, p.target), action)
