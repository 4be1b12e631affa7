"""AI2-THOR scene layouts shipped in the alfworld wheel, turned into receptacle instances with locations.

The wheel has, per scene, ``-objects.json`` (types present), ``-openable.json`` (receptacle ids
and the pose to reach them) and ``-layout.npy`` (reachable floor points). The openable file
misses receptacles in most scenes (GarbageCan, CoffeeMachine, StoveBurner, ...), so those get
an id and a reachable point of their own here, deterministically from the scene number.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from evoharness.core.errors import EvoError

GRID = 0.25  # AI2-THOR's navigation step: poses are stored in metres, locations in grid units.


def alfworld_root() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("alfworld")
    if spec is None or not spec.submodule_search_locations:
        raise EvoError("the alfworld package is not installed (pip install alfworld==0.4.2)")
    return Path(list(spec.submodule_search_locations)[0])


def layouts_dir() -> Path:
    return alfworld_root() / "gen" / "layouts"


def domain_text() -> str:
    return (alfworld_root() / "data" / "alfred.pddl").read_text()


def grammar_text() -> str:
    return (alfworld_root() / "data" / "alfred.twl2").read_text()


@dataclass(frozen=True)
class Receptacle:
    """A static receptacle instance: AI2-THOR id, type (e.g. ``SinkBasin``), and its location id."""

    id: str
    type: str
    location: str


@dataclass(frozen=True)
class Scene:
    number: int
    object_types: frozenset[str]
    receptacles: tuple[Receptacle, ...]
    start_location: str

    def of_type(self, rtype: str) -> list[Receptacle]:
        return [r for r in self.receptacles if r.type == rtype]

    @property
    def receptacle_types(self) -> set[str]:
        return {r.type for r in self.receptacles}


def _constants():
    import alfworld.gen.constants as constants

    return constants


def static_receptacle_types() -> set[str]:
    c = _constants()
    return {r for r in c.RECEPTACLES if r not in c.MOVABLE_RECEPTACLES_SET and r in c.VAL_RECEPTACLE_OBJECTS}


def _fmt(v: float) -> str:
    return f"{v:+06.2f}"


def _loc(x: float, z: float, rot: int, hor: int) -> str:
    return f"loc|{int(round(x / GRID))}|{int(round(z / GRID))}|{int(rot)}|{int(hor)}"


@functools.lru_cache(maxsize=256)
def load_scene(number: int) -> Scene:
    base = layouts_dir() / f"FloorPlan{number}"
    try:
        types = json.loads(Path(f"{base}-objects.json").read_text())
        openable = json.loads(Path(f"{base}-openable.json").read_text())
        points = np.load(f"{base}-layout.npy")
    except FileNotFoundError as e:
        raise EvoError(f"scene FloorPlan{number}: layout file missing: {e.filename}") from e
    static = static_receptacle_types()
    used_locs: set[str] = set()

    def unique(loc: str) -> str:
        # Two receptacles reached from the same pose would merge into one "go to" target.
        head, hor = loc.rsplit("|", 1)
        h = int(hor)
        while f"{head}|{h}" in used_locs:
            h += 1
        used_locs.add(f"{head}|{h}")
        return f"{head}|{h}"

    receps: list[Receptacle] = []
    for rid, (x, z, rot, hor) in sorted(openable.items()):
        parts = rid.split("|")
        rtype = parts[4] if len(parts) > 4 else parts[0]
        if rtype not in static:
            continue
        receps.append(Receptacle(rid, rtype, unique(_loc(x, z, rot, hor))))
    # Pitfall: receptacles absent from -openable.json get an id and a reachable point.
    rng = random.Random(number * 7919)
    present = {r.type for r in receps}
    for rtype in sorted(set(types) & static - present):
        px, pz = (float(v) for v in points[rng.randrange(len(points))])
        rot = rng.choice([0, 90, 180, 270])
        y = {"GarbageCan": 0.0, "Toilet": 0.0, "Bathtub": 0.0}.get(rtype, 0.9)
        if rtype == "SinkBasin":
            rid = f"Sink|{_fmt(px)}|{_fmt(y)}|{_fmt(pz)}|SinkBasin"
        elif rtype == "BathtubBasin":
            rid = f"Bathtub|{_fmt(px)}|{_fmt(0.0)}|{_fmt(pz)}|BathtubBasin"
        else:
            rid = f"{rtype}|{_fmt(px)}|{_fmt(y)}|{_fmt(pz)}"
        receps.append(Receptacle(rid, rtype, unique(_loc(px, pz, rot, 30))))
    sx, sz = (float(v) for v in points[rng.randrange(len(points))])
    start = unique(_loc(sx, sz, 0, 60))
    return Scene(number, frozenset(types), tuple(receps), start)


def available_scenes() -> list[int]:
    nums = []
    for p in layouts_dir().glob("FloorPlan*-objects.json"):
        nums.append(int(p.name[len("FloorPlan") : -len("-objects.json")]))
    return sorted(nums)
