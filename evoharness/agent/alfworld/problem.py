"""Sample an ALFWorld task in a scene and write it as PDDL, following alfworld's augment_pddl_states.

Everything here is a pure function of (scene, family, rng): the same seed gives the same bytes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from evoharness.agent.alfworld.scenes import Receptacle, Scene, static_receptacle_types

LAMPS = ("DeskLamp", "FloorLamp")
LAMP_HOLDERS = ("Desk", "SideTable", "Dresser", "Shelf", "DiningTable", "CoffeeTable")
# ALFRED's rules: the appliance that transforms the object is never the destination.
NOT_A_DESTINATION = {
    "pick_clean_then_place_in_recep": {"SinkBasin", "BathtubBasin", "Microwave", "Fridge", "Toaster"},
    "pick_heat_then_place_in_recep": {"Microwave", "Fridge", "SinkBasin", "BathtubBasin", "Toaster"},
    "pick_cool_then_place_in_recep": {"Fridge", "Microwave", "SinkBasin", "BathtubBasin", "Toaster"},
}
ALWAYS_EXCLUDED_DESTINATIONS = {"Toaster"}
REQUIRED_APPLIANCE = {
    "pick_clean_then_place_in_recep": ("SinkBasin", "BathtubBasin"),
    "pick_heat_then_place_in_recep": ("Microwave",),
    "pick_cool_then_place_in_recep": ("Fridge",),
}
ACTION_CLASS = {
    "pick_clean_then_place_in_recep": "Cleanable",
    "pick_heat_then_place_in_recep": "Heatable",
    "pick_cool_then_place_in_recep": "Coolable",
}


class NoTask(Exception):
    """This scene cannot host this family (no appliance, no compatible object...)."""


@dataclass
class Problem:
    family: str
    scene: int
    object_target: str
    parent_target: str  # "" for look
    toggle_target: str  # "" unless look
    receptacles: list[Receptacle]
    placements: list[tuple[str, str, str]] = field(default_factory=list)  # (object id, type, receptacle id)
    start_location: str = ""

    @property
    def pddl_params(self) -> dict:
        return {
            "object_target": self.object_target,
            "parent_target": self.parent_target,
            "toggle_target": self.toggle_target,
            "mrecep_target": "",
            "object_sliced": False,
        }

    @property
    def dirname(self) -> str:
        recep = self.toggle_target if self.family == "look_at_obj_in_light" else self.parent_target
        return f"{self.family}-{self.object_target}-None-{recep}-{self.scene}"


def _c():
    import alfworld.gen.constants as constants

    return constants


def _holders(obj_type: str, receps: list[Receptacle]) -> list[Receptacle]:
    if obj_type in LAMPS:
        return [r for r in receps if r.type in LAMP_HOLDERS]
    val = _c().VAL_RECEPTACLE_OBJECTS
    return [r for r in receps if obj_type in val.get(r.type, ())]


def pickupable_types(scene: Scene) -> list[str]:
    c = _c()
    static = static_receptacle_types()
    kinds = set()
    for objs in c.VAL_RECEPTACLE_OBJECTS.values():
        kinds |= set(objs)
    out = [t for t in scene.object_types if t in kinds and t not in static and t not in LAMPS and "Sliced" not in t]
    return sorted(t for t in out if _holders(t, list(scene.receptacles)))


def sample_problem(scene: Scene, family: str, rng: random.Random, *, max_per_type: int, distractors: int) -> Problem:
    c = _c()
    # Cap instances per receptacle type: the engine's cost and the expert's search grow with them.
    by_type: dict[str, list[Receptacle]] = {}
    for r in scene.receptacles:
        by_type.setdefault(r.type, []).append(r)
    receps: list[Receptacle] = []
    for rtype in sorted(by_type):
        inst = by_type[rtype]
        receps.extend(inst if len(inst) <= max_per_type else rng.sample(inst, max_per_type))
    rtypes = {r.type for r in receps}

    candidates = pickupable_types(scene)
    toggle = ""
    if family == "look_at_obj_in_light":
        lamps = [t for t in LAMPS if t in scene.object_types]
        if not lamps or not any(r.type in LAMP_HOLDERS for r in receps):
            raise NoTask("no lamp or nowhere to put one")
        toggle = rng.choice(lamps)
    if family in REQUIRED_APPLIANCE:
        if not rtypes & set(REQUIRED_APPLIANCE[family]):
            raise NoTask(f"no {REQUIRED_APPLIANCE[family]}")
        candidates = [t for t in candidates if t in c.VAL_ACTION_OBJECTS[ACTION_CLASS[family]]]
    if not candidates:
        raise NoTask("no compatible object")
    obj = rng.choice(candidates)

    parent = ""
    if family != "look_at_obj_in_light":
        banned = NOT_A_DESTINATION.get(family, ALWAYS_EXCLUDED_DESTINATIONS)
        dests = sorted({r.type for r in _holders(obj, receps)} - banned)
        # The target must start somewhere that is not the destination type.
        dests = [d for d in dests if any(r.type != d for r in _holders(obj, receps))]
        if not dests:
            raise NoTask(f"no destination for {obj}")
        parent = rng.choice(dests)

    problem = Problem(family, scene.number, obj, parent, toggle, receps, start_location=scene.start_location)
    avoid = {parent} | set(REQUIRED_APPLIANCE.get(family, ()))
    n_targets = rng.randint(2, 3) if family == "pick_two_obj_and_place" else rng.randint(1, 2)
    starts = [r for r in _holders(obj, receps) if r.type not in avoid]
    if not starts:
        raise NoTask(f"nowhere to start {obj}")
    used_ids: set[str] = set()

    def place(otype: str, holders: list[Receptacle]) -> None:
        r = rng.choice(holders)
        base = r.id.split("|")
        x, y, z = (float(v) for v in base[1:4])
        while True:  # ids must be unique; offsets keep them inside the receptacle's bounds
            oid = f"{otype}|{x + rng.uniform(-0.3, 0.3):+06.2f}|{y + 0.05:+06.2f}|{z + rng.uniform(-0.3, 0.3):+06.2f}"
            if oid not in used_ids:
                break
        used_ids.add(oid)
        problem.placements.append((oid, otype, r.id))

    for _ in range(n_targets):
        place(obj, starts)
    if toggle:
        place(toggle, _holders(toggle, receps))
    others = [t for t in candidates + pickupable_types(scene) if t != obj]
    for otype in rng.sample(sorted(set(others)), min(distractors, len(set(others)))):
        holders = _holders(otype, receps)
        # A distractor of the target type would change the task; other types may go anywhere valid.
        if holders:
            place(otype, holders)
    return problem


def _esc(name: str) -> str:
    for a, b in (("-", "_minus_"), ("|", "_bar_"), ("+", "_plus_"), (".", "_dot_"), (",", "_comma_")):
        name = name.replace(a, b)
    return name


def problem_pddl(problem: Problem, name: str) -> str:
    c = _c()
    import alfworld.gen.goal_library as glib

    objs = problem.placements
    obj_types = sorted({t for _, t, _ in objs})
    all_otypes = sorted(set(c.OBJECTS) - static_receptacle_types() | set(obj_types))
    all_rtypes = sorted(static_receptacle_types())
    locations = sorted({r.location for r in problem.receptacles} | {problem.start_location})
    actions = c.VAL_ACTION_OBJECTS
    in_fridge = {r.id for r in problem.receptacles if r.type == "Fridge"}

    lines = [f"(define (problem {name})", "(:domain alfred)", "(:objects", "agent1 - agent"]
    lines += [f"{t}Type - otype" for t in all_otypes]
    lines += [f"{t}Type - rtype" for t in all_rtypes]
    lines += [f"{_esc(o)} - object" for o, _, _ in objs]
    lines += [f"{_esc(r.id)} - receptacle" for r in problem.receptacles]
    lines += [f"{_esc(loc)} - location" for loc in locations]
    lines += [")", "(:init"]
    lines += [f"(receptacleType {_esc(r.id)} {r.type}Type)" for r in problem.receptacles]
    lines += [f"(objectType {_esc(o)} {t}Type)" for o, t, _ in objs]
    present_rtypes = sorted({r.type for r in problem.receptacles})
    for rt in present_rtypes:
        for ot in obj_types:
            if ot in c.VAL_RECEPTACLE_OBJECTS.get(rt, ()) or (ot in LAMPS and rt in LAMP_HOLDERS):
                lines.append(f"(canContain {rt}Type {ot}Type)")
    for o, t, r in objs:
        if t not in LAMPS:
            lines.append(f"(pickupable {_esc(o)})")
        if t in c.MOVABLE_RECEPTACLES_SET:
            lines.append(f"(isReceptacleObject {_esc(o)})")
        for cls, pred in (("Cleanable", "cleanable"), ("Heatable", "heatable"), ("Coolable", "coolable"), ("Sliceable", "sliceable")):
            if t in actions[cls]:
                lines.append(f"({pred} {_esc(o)})")
        if t in LAMPS:
            lines.append(f"(toggleable {_esc(o)})")
        if r in in_fridge and t == problem.object_target:
            lines.append(f"(isCool {_esc(o)})")
    for r in problem.receptacles:
        if r.type in c.OPENABLE_CLASS_SET:
            lines.append(f"(openable {_esc(r.id)})")
    lines.append(f"(atLocation agent1 {_esc(problem.start_location)})")
    lines += [f"(inReceptacle {_esc(o)} {_esc(r)})" for o, _, r in objs]
    lines += [f"(receptacleAtLocation {_esc(r.id)} {_esc(r.location)})" for r in problem.receptacles]
    lines.append(")")
    goal = glib.gdict[problem.family]["pddl"].format(
        obj=problem.object_target, recep=problem.parent_target, toggle=problem.toggle_target, mrecep=""
    )
    lines.append(goal.replace("#", "-").strip())
    return "\n".join(lines) + "\n"
