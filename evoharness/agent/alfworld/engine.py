"""The real ALFWorld engine: TextWorld's PddlEnv with ALFWorld's demangler and handcoded expert.

Only this module and the environment workers import textworld; it is slow to import (~2 s)
and not thread-safe, so it lives in worker processes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvStep:
    """What the engine says after a reset or a step.

    ``observation`` is the text the agent sees (the intro's "Welcome" banner stripped);
    ``admissible`` the exact commands the engine accepts now; ``won`` the benchmark's own
    success flag; ``expert_action`` the handcoded expert's next command (privileged: only a
    teacher may read it, it never enters a prompt).
    """

    observation: str
    admissible: tuple[str, ...]
    won: bool
    expert_action: str | None
    task: str = ""


def _expert_wrapper_class():
    from alfworld.agents.environment.alfred_tw_env import AlfredExpert
    from alfworld.agents.expert import HandCodedAgentTimeout

    class FixedAlfredExpert(AlfredExpert):
        """AlfredExpert whose handcoded agent understands the grammar's ``move X to Y``.

        alfworld 0.4.2's expert updates its inventory only when the last command contains
        ``put``, but the grammar's PutObject says ``move``; without this mapping it never
        drops the first object and Pick2 fails.
        """

        def _gather_infos(self):
            self.state["extra.expert_plan"] = ["look"]
            try:
                if not self.prev_command:
                    self._handcoded_expert.observe(self.state["feedback"])
                else:
                    last = self.prev_command
                    if last.startswith("move "):
                        last = "put " + last[len("move ") :]
                    nxt = self._handcoded_expert.act(self.state, 0, self.state["won"], last)
                    if nxt in self.state["admissible_commands"]:
                        self.state["extra.expert_plan"] = [nxt]
            except HandCodedAgentTimeout:
                self.state["extra.expert_plan"] = [None]
            except Exception:  # the expert gives up (HandCodedAgentFailed and friends)
                self.state["extra.expert_plan"] = [None]

    return FixedAlfredExpert


def split_intro(text: str) -> tuple[str, str]:
    """Split the intro into (observation without the Welcome banner, task text)."""
    body = text
    if "-= Welcome to TextWorld, ALFRED! =-" in body:
        body = body.split("-= Welcome to TextWorld, ALFRED! =-", 1)[1]
    task = ""
    if "Your task is to:" in body:
        body, task = body.split("Your task is to:", 1)
        task = task.strip()
    return body.strip(), task


class Engine:
    """One live ALFWorld game. Not thread-safe: one per process."""

    def __init__(self, expert: bool = True, speedups: bool = True):
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler
        from textworld.envs.pddl import PddlEnv

        if speedups:
            from evoharness.agent.alfworld import speedups as _speedups

            _speedups.apply()
        infos = textworld.EnvInfos(won=True, admissible_commands=True, facts=expert, extras=["gamefile"])
        env = AlfredDemangler(PddlEnv(infos))
        self.expert = expert
        if expert:
            env = _expert_wrapper_class()(env)
        self.env = env
        self.loaded: str | None = None
        self._task = ""

    def _step(self, state, task: str = "") -> EnvStep:
        plan = state.get("extra.expert_plan") if self.expert else None
        return EnvStep(
            observation=state["feedback"].strip(),
            admissible=tuple(state["admissible_commands"]),
            won=bool(state["won"]),
            expert_action=plan[0] if plan else None,
            task=task,
        )

    def reset(self, gamefile: str, seed: int) -> EnvStep:
        # The expert and the task templates use the module-level random: seed it.
        random.seed(seed)
        if self.loaded != gamefile:
            self.env.load(gamefile)
            self.loaded = gamefile
        state = self.env.reset()
        obs, task = split_intro(state["feedback"])
        self._task = task
        step = self._step(state, task)
        return EnvStep(obs, step.admissible, step.won, step.expert_action, task)

    def step(self, command: str) -> EnvStep:
        state, _, _ = self.env.step(command)
        return self._step(state, self._task)
