"""The six ALFWorld task families, their short names and which rooms they are valid in."""

from __future__ import annotations

FAMILIES: dict[str, str] = {
    "pick_and_place_simple": "Pick",
    "look_at_obj_in_light": "Look",
    "pick_clean_then_place_in_recep": "Clean",
    "pick_heat_then_place_in_recep": "Heat",
    "pick_cool_then_place_in_recep": "Cool",
    "pick_two_obj_and_place": "Pick2",
}
SHORT_TO_FAMILY = {v: k for k, v in FAMILIES.items()}

# Rooms each family is generated in (ALFRED's GOALS_VALID).
FAMILY_ROOMS: dict[str, tuple[str, ...]] = {
    "pick_and_place_simple": ("Kitchen", "LivingRoom", "Bathroom", "Bedroom"),
    "pick_two_obj_and_place": ("Kitchen", "LivingRoom", "Bathroom", "Bedroom"),
    "look_at_obj_in_light": ("LivingRoom", "Bedroom"),
    "pick_clean_then_place_in_recep": ("Kitchen", "Bathroom"),
    "pick_heat_then_place_in_recep": ("Kitchen",),
    "pick_cool_then_place_in_recep": ("Kitchen",),
}

ROOM_SCENES: dict[str, range] = {
    "Kitchen": range(1, 31),
    "LivingRoom": range(201, 231),
    "Bedroom": range(301, 331),
    "Bathroom": range(401, 431),
}

# ALFRED's valid_unseen scenes: never used for train or valid_seen.
DEFAULT_UNSEEN_SCENES = (10, 219, 308, 424)

SPLITS = ("train", "valid_seen", "valid_unseen")


def family_of(name: str) -> str:
    """Accept a family's full name or short name; return the full name."""
    if name in FAMILIES:
        return name
    if name in SHORT_TO_FAMILY:
        return SHORT_TO_FAMILY[name]
    known = ", ".join(FAMILIES.values())
    from evoharness.core.errors import EvoError

    raise EvoError(f"unknown task family {name!r} (known: {known})")


def room_of(scene: int) -> str:
    for room, scenes in ROOM_SCENES.items():
        if scene in scenes:
            return room
    from evoharness.core.errors import EvoError

    raise EvoError(f"scene {scene} is in no known room type")
