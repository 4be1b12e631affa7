"""Belief: the scene state the agent has observed this episode, answered by ``track``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_ITEM = re.compile(r"\ban? ([a-z]+(?: [a-z]+)*? \d+)")
# A receptacle's contents are listed only as "On the desk 1, you see ..." (arriving, examining) or
# "In it, you see ..." (opening). "Next to it, you see ..." (look) says nothing about what is on it.
_CONTENTS = re.compile(r"(?:\bOn the [a-z]+ \d+|\bIn it), you see ([^.]*)")


def object_type(name: str) -> str:
    """``cabinet 3`` -> ``cabinet``: the type behind an instance name."""
    return re.sub(r"\s*\d+$", "", name.strip())


def _items(text: str) -> list[str]:
    return _ITEM.findall(text)


def contents(observation: str) -> list[str] | None:
    """The objects an observation lists as on or in the receptacle at hand, or None when it lists
    no receptacle's contents (a look, a take, a failed command)."""
    m = _CONTENTS.search(observation)
    return None if m is None else _items(m.group(1))


@dataclass
class Belief:
    """Receptacles seen, objects and where, opened receptacles, what is held, what the agent placed.

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
    placed: set[str] = field(default_factory=set)  # objects the agent itself moved into a receptacle

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
        seen = contents(obs)
        if seen is not None and self.location:
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
            self.placed.discard(obj)
        elif action.startswith("move "):
            obj, _, recep = action[len("move ") :].partition(" to ")
            self.held = None
            self.objects[obj] = recep
            self.placed.add(obj)
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

    def where(self, kind: str) -> list[tuple[str, str]]:
        """Known instances of an object type that the agent did not place itself: (object, receptacle)."""
        return sorted((o, r) for o, r in self.objects.items() if object_type(o) == kind and o not in self.placed)

    def answer(self, query: str, priority: dict[str, int] | None = None) -> str:
        """``track [query]``: where things are. An empty query gives the whole summary. An object is
        matched by its exact type (``pot`` is not ``potato``) or instance; instances the agent placed
        itself are marked so, and when no other instance is known the answer goes on with the
        unvisited receptacles, ranked by ``priority`` when given."""
        q = query.strip().lower()
        words = [w for w in re.findall(r"[a-z]+", q) if w not in {"where", "is", "the", "a", "an", "my", "find", "second", "another", "other"}]
        if not words or any(w in ("all", "state", "scene", "belief") for w in words):
            return self.summary()
        if any(w in ("unvisited", "unexplored", "unchecked", "left") for w in words):
            return "unvisited: " + (", ".join(self.unvisited(priority)) or "none")
        if any(w in ("held", "holding", "inventory", "carrying", "hand") for w in words):
            return f"holding: {self.held or 'nothing'}"
        lines, free = [], 0
        for o, r in sorted(self.objects.items()):
            if object_type(o) in words or o == q:
                mine = o in self.placed
                free += not mine
                lines.append(f"{o} in {r}" + (" (placed by you)" if mine else ""))
        if self.held and (object_type(self.held) in words or self.held == q):
            lines.append(f"{self.held} held")
            free += 1
        if free == 0:
            ranked = ", ".join(self.unvisited(priority)[:6]) or "none"
            head = "; ".join(lines) + "; " if lines else ""
            return f"{head}not seen{' elsewhere' if lines else ''} yet: {' '.join(words)}; unvisited: {ranked}"
        return "; ".join(lines[:8])

    def summary(self, priority: dict[str, int] | None = None, sought: str = "") -> str:
        objs = ", ".join(f"{o} in {r}" for o, r in sorted(self.objects.items())[:10]) or "none"
        left = self.unvisited(priority)[:6]
        rank = f" (likeliest first for {sought})" if priority and sought else ""
        return (
            f"at: {self.location or 'start'}; holding: {self.held or 'nothing'}; "
            f"visited: {', '.join(self.visited) or 'none'}; seen: {objs}; unvisited{rank}: {', '.join(left) or 'none'}"
        )
