"""The BPE workspace H_t = (Belief, Progress, Experience), reached only through meta-actions.

Meta-actions never touch the simulator: the workspace answers them, and the answer is shown
on the next turn. Modes: ``env_only`` (ReAct, no harness), ``always_on`` (panels injected
every turn, env actions only), ``inline`` (the four verbs available). Each module can be
switched off for ablations; a disabled verb is an invalid action.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict

from evoharness.agent.harness.belief import Belief
from evoharness.agent.harness.experience import Experience
from evoharness.agent.harness.progress import Progress

META_VERBS = ("track", "commit", "recall", "note")
ACHIEVING = ("take", "clean", "heat", "cool", "use", "move")  # env actions that complete a subgoal
VERB_MODULE = {"track": "belief", "commit": "progress", "recall": "experience", "note": "experience"}
Mode = Literal["env_only", "always_on", "inline"]


class HarnessConfig(BaseModel):
    """Which harness the agent acts through. ``charge_meta_actions``: a meta-action costs a step
    (on in GRPO training, off in the reported evaluations)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    mode: Mode = "inline"
    belief: bool = True
    progress: bool = True
    experience: bool = True
    charge_meta_actions: bool = False

    @property
    def verbs(self) -> tuple[str, ...]:
        if self.mode != "inline":
            return ()
        return tuple(v for v in META_VERBS if getattr(self, VERB_MODULE[v]))


@dataclass
class Workspace:
    """One episode's workspace. The Experience bank is shared and read-only here."""

    config: HarnessConfig
    bank: Experience | None
    task: str = ""
    family: str = ""
    belief: Belief = field(default_factory=Belief)
    progress: Progress = field(default_factory=Progress)
    notes: list[str] = field(default_factory=list)
    recalled: list[str] = field(default_factory=list)
    hints: str = ""
    result: str = ""

    def start(self, observation: str) -> None:
        self.belief.observe(None, observation)
        if self.config.mode == "always_on":
            self._refresh_hints(self.task)

    def observe(self, action: str, observation: str) -> None:
        """An env action ran: Belief reads its observation, and RESULT goes back to ``none``, so
        RESULT only ever answers the meta-action of the turn before (a stale answer, shown
        after the agent has moved on, reads the same as a fresh one). In ``always_on`` the harness
        runs itself: Progress records each subgoal the action achieved, and the hints follow it."""
        self.belief.observe(action, observation)
        self.result = ""
        if self.config.mode == "always_on" and not observation.startswith("Nothing happens"):
            verb = action.split(" ", 1)[0]
            if verb in ACHIEVING and self.config.progress:
                self.progress.commit(action.split(" from ")[0].split(" with ")[0])
                self._refresh_hints(f"how to {self.task}" if verb != "move" else self.task)

    def _refresh_hints(self, query: str) -> None:
        if self.config.experience and self.bank is not None:
            self.hints, ids = self.bank.recall(query, self.family)
            self.recalled.extend(ids)

    def sought(self) -> str:
        """The object type the objective names first among those Experience has search priorities
        for (the frozen harness reads the objective, never the task's hidden targets)."""
        if self.bank is None or not self.config.experience:
            return ""
        for w in self.task.lower().replace(".", " ").split():
            if self.bank.where_counts(w):
                return w
        return ""

    def handle(self, verb: str, arg: str) -> tuple[bool, str]:
        """Answer a meta-action; (valid, text shown next turn). A disabled verb is invalid."""
        if verb not in self.config.verbs:
            return False, "Nothing happens."
        arg = arg.strip()
        if verb == "track":
            out = self.belief.answer(arg, self.search_priority(arg))
        elif verb == "commit":
            if not arg:
                return False, "commit needs a subgoal"  # an empty commit is no move: invalid, like an empty note
            out = self.progress.commit(arg)
        elif verb == "recall":
            if self.bank is None:
                out = "no experience yet"
            else:
                out, ids = self.bank.recall(arg or self.task, self.family)
                self.recalled.extend(ids)
                self.hints = out
        else:  # note
            if not arg:
                return False, "note needs an insight"
            self.notes.append(arg)
            out = "noted"
        self.result = f"{verb}: {out}"
        return True, self.result

    def search_priority(self, query: str) -> dict[str, int]:
        """Where Experience says the object named in ``query`` is usually found: Belief ranks its
        unvisited receptacles by it (the B and E of the workspace working together)."""
        if self.bank is None or not self.config.experience:
            return {}
        return self.bank.where_counts(query)

    def views(self) -> dict[str, str]:
        """The panels the prompt shows this turn (empty dict in env_only)."""
        cfg = self.config
        if cfg.mode == "env_only":
            return {}
        v: dict[str, str] = {}
        if cfg.mode == "always_on":
            if cfg.belief:
                sought = self.sought()
                v["BELIEF"] = self.belief.summary(self.bank.where_counts(sought) if sought else None, sought)
            if cfg.progress:
                v["PLAN"] = self.progress.checklist()
            if cfg.experience:
                v["HINTS"] = self.hints or "none"
            return v
        if cfg.progress:
            v["PLAN"] = self.progress.checklist()
        if cfg.experience:
            v["HINTS"] = self.hints or "none"
        v["RESULT"] = self.result or "none"
        return v
