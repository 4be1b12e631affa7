"""The random-admissible baseline: a well-formed response with a uniformly random env action."""

from __future__ import annotations

import random

from evoharness.agent.episode import Privileged, TurnView, format_response


class RandomPolicy:
    name = "random"

    def __init__(self):
        self.rng = random.Random(0)

    def fingerprint(self) -> str:
        return "random:v1"

    def reset(self, seed: int) -> None:
        self.rng = random.Random(f"random/{seed}")

    def act(self, prompt: str, view: TurnView, privileged: Privileged) -> str:
        return format_response("I pick an action at random.", self.rng.choice(view.admissible))
