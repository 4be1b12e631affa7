"""Belief: the scene state the agent has observed this episode, answered by ``track``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_ITEM = re.compile(r"\ban? ([a-z]+(?: [a-z]+)*? \d+)")


def object_type(name: str) -> str:
    """``cabinet 3`` -> ``cabinet``: the type behind an instance name."""
    return re.sub(r"\s*\d+$", "", name.strip())


def _items(text: str) -> list[str]:
    return _ITEM.findall(text)


@dataclass
class Belief:
    """Receptacles seen, objects and where, opened receptacles, what is held.

    Built only from observations and the agent's own successful actions, never from the
    engine's hidden state: it holds what a careful agent would have written down.
    """

    receptacles: list[str] = field(default_factory=list)
    visited: list[str] = field(default_factory=list)
    objects: dict[str, str] = field(default_factory=dict)  # object -> receptacle last seen in
    opened: set[str] = field(default_factory=set)
    held: str | None = None
    location: str | None = None
    states: dict[str, str] = field(default_factory=dict)  # object -> clean/hot/cool

    def observe(self, action: str | None, observation: str) -> None:
        obs = observation.strip()
        if action is None:  # the intro: "Looking quickly around you, you see a cabinet 1, ..."
            if "you see" in obs:
                self.receptacles = _items(obs.split("you see", 1)[1])
            return
        if obs.startswith("Nothing happens"):
            return
        if action.startswith("go to "):
            self.location = action[len("go to ") :]
            if self.location not in self.visited:
                self.visited.append(self.location)
        if "you see" in obs and self.location:
            seen = _items(obs.split("you see", 1)[1])
            for o, r in list(self.objects.items()):
                if r == self.location and o not in seen:
                    del self.objects[o]
            for o in seen:
                self.objects[o] = self.location
        if action.startswith("open "):
            self.opened.add(action[len("open ") :])
        elif action.startswith("close "):
            self.opened.discard(action[len("close ") :])
        elif action.startswith("take "):
            obj = action[len("take ") :].split(" from ")[0]
            self.held = obj
            self.objects.pop(obj, None)
        elif action.startswith("move "):
            obj, _, recep = action[len("move ") :].partition(" to ")
            self.held = None
            self.objects[obj] = recep
        for verb, state in (("clean ", "clean"), ("heat ", "hot"), ("cool ", "cool")):
            if action.startswith(verb):
                self.states[action[len(verb) :].split(" with ")[0]] = state
        if action.startswith("use "):
            self.states[action[len("use ") :]] = "on"

    def unvisited(self, priority: dict[str, int] | None = None) -> list[str]:
        """Receptacles not yet visited; with ``priority`` (receptacle type -> times the sought
        object was found in one, from Experience), likeliest first, room order breaking ties."""
        left = [r for r in self.receptacles if r not in self.visited]
        if priority:
            left.sort(key=lambda r: -priority.get(object_type(r), 0))
        return left

    def answer(self, query: str, priority: dict[str, int] | None = None) -> str:
        """``track [query]``: where things are. An empty query gives the whole summary; an object
        not seen yet gives the unvisited receptacles, ranked by ``priority`` when given."""
        q = query.strip().lower()
        words = [w for w in re.findall(r"[a-z]+", q) if w not in {"where", "is", "the", "a", "an", "my", "find"}]
        lines = []
        if not words or any(w in ("all", "state", "scene", "belief") for w in words):
            return self.summary()
        if any(w in ("unvisited", "unexplored", "unchecked", "left") for w in words):
            return "unvisited: " + (", ".join(self.unvisited(priority)) or "none")
        if any(w in ("held", "holding", "inventory", "carrying", "hand") for w in words):
            return f"holding: {self.held or 'nothing'}"
        for o, r in sorted(self.objects.items()):
            if any(w in o for w in words):
                lines.append(f"{o} in {r}")
        if self.held and any(w in self.held for w in words):
            lines.append(f"{self.held} held")
        if not lines:
            return f"not seen yet: {' '.join(words)}; unvisited: {', '.join(self.unvisited(priority)[:6]) or 'none'}"
        return "; ".join(lines[:8])

    def summary(self) -> str:
        objs = ", ".join(f"{o} in {r}" for o, r in sorted(self.objects.items())[:10]) or "none"
        return (
            f"at: {self.location or 'start'}; holding: {self.held or 'nothing'}; "
            f"visited: {', '.join(self.visited) or 'none'}; seen: {objs}"
        )
