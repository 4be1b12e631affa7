"""One episode engine for collection, evaluation and RL: budget, history, the per-turn prompt,
output parsing, and the trace.

``build_prompt`` is the only place a policy's input is made: SFT pairs, evaluation and GRPO
rollouts all call it, so a policy is trained and evaluated on byte-identical inputs.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from evoharness.agent.alfworld.engine import EnvStep
from evoharness.agent.alfworld.games import TRAJ_FILE, Game
from evoharness.agent.harness.experience import Experience
from evoharness.agent.harness.workspace import META_VERBS, HarnessConfig, Workspace
from evoharness.agent.reward import RewardConfig, components, total
from evoharness.core.errors import EvoError, PolicyError

PROMPT_VERSION = 4  # 4: an invalid turn changes the next prompt (OBSERVATION, RESULT, LAST ACTIONS)
HISTORY = 10

VERB_HELP = {
    "track": "track [query]: ask your belief of the scene (where things are, what is unvisited).",
    "commit": "commit [subgoal]: close the open subgoal and set the next one on your plan.",
    "recall": "recall [query]: top 3 hints from past episodes (where to look, how to do it, mistakes).",
    "note": "note [insight]: save an insight for future episodes.",
}


class EpisodeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    max_steps: int = Field(50, ge=1)
    max_turns: int = Field(0, ge=0)  # 0: twice max_steps (uncharged meta-actions still end somewhere)
    harness: HarnessConfig = HarnessConfig()
    reward: RewardConfig = RewardConfig()
    update: int = 0  # u, the policy update the reward's diversity weight is taken at

    @property
    def turn_limit(self) -> int:
        return self.max_turns or 2 * self.max_steps


@dataclass(frozen=True)
class TurnView:
    """Everything the prompt shows on one turn."""

    verbs: tuple[str, ...]
    objective: str
    observation: str
    admissible: tuple[str, ...]
    last_actions: tuple[str, ...]
    panels: tuple[tuple[str, str], ...] = ()
    examples: str = ""  # few-shot exemplars for this family (see evoharness.agent.pairs)


def system_text(verbs: tuple[str, ...]) -> str:
    lines = [
        "You are a household agent in a text world. Reach the OBJECTIVE.",
        "Env actions: copy one line of ADMISSIBLE COMMANDS exactly.",
    ]
    if verbs:
        lines.append("Harness actions (answered in RESULT, no time passes in the room):")
        lines += [VERB_HELP[v] for v in verbs]
        lines.append("Use them when they help you decide; skip them when the next step is clear.")
    lines.append("Reply: <think>one or two sentences</think> then <action>exactly one action</action>.")
    return "\n".join(lines)


def build_prompt(view: TurnView) -> str:
    """THE prompt. Same function for SFT pairs, evaluation and RL."""
    parts = [system_text(view.verbs)]
    if view.examples:
        parts.append(f"EXAMPLES:\n{view.examples}")
    parts += [
        f"OBSERVATION: {view.observation}",
        "ADMISSIBLE COMMANDS: " + " | ".join(view.admissible),
        "LAST ACTIONS: " + ("; ".join(view.last_actions) if view.last_actions else "none"),
    ]
    parts += [f"{name}: {text}" for name, text in view.panels]
    # The objective comes last, next to the reply: a small model finds the words it must copy
    # (the object, the receptacle) at a short, steady distance.
    parts.append(f"OBJECTIVE: {view.objective}")
    return "\n".join(parts) + "\n"


def add_examples(prompt: str, examples: str) -> str:
    """The prompt ``build_prompt`` would have made with ``examples`` (used to build few-shot SFT
    pairs from stored demos); ``tests/test_pairs.py`` checks the two agree byte for byte."""
    if not examples:
        return prompt
    head, sep, rest = prompt.partition("\nOBSERVATION: ")
    return f"{head}\nEXAMPLES:\n{examples}{sep}{rest}"


@dataclass(frozen=True)
class Parsed:
    action: str | None
    verb: str | None = None
    argument: str = ""
    error: str | None = None


_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*<action>(.*?)</action>\s*$", re.S)


def parse_response(text: str) -> Parsed:
    """``<think>…</think>\\n<action>…</action>``, exactly one action tag.

    A meta-action is ``verb [argument]``; anything else is an env action (its admissibility is
    checked by the caller)."""
    if text.count("<action>") != 1 or text.count("</action>") != 1:
        return Parsed(None, error=f"expected exactly one <action> tag, found {text.count('<action>')}")
    m = _THINK.match(text)
    if not m:
        return Parsed(None, error="response is not <think>...</think> followed by <action>...</action>")
    action = " ".join(m.group(2).split())
    if not action:
        return Parsed(None, error="empty action")
    head, _, rest = action.partition(" ")
    if head in META_VERBS:
        return Parsed(action, verb=head, argument=rest.strip().strip("[]").strip())
    return Parsed(action)


def format_response(think: str, action: str) -> str:
    return f"<think>{think}</think>\n<action>{action}</action>"


@dataclass
class Turn:
    t: int
    prompt: str
    response: str
    action: str | None
    kind: str  # "env", a meta verb, or "invalid"
    valid: bool
    observation: str
    cost: int


@dataclass
class Trajectory:
    """One episode's trace, one JSON line in a ``.jsonl`` file."""

    episode_id: str
    fingerprint: str
    game_id: str
    split: str
    family: str
    policy: str
    harness: dict
    seed: int
    max_steps: int
    task: str = ""
    target: dict = field(default_factory=dict)
    turns: list[Turn] = field(default_factory=list)
    outcome: dict = field(default_factory=dict)
    reward: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    recalled: list[str] = field(default_factory=list)
    found_in: str | None = None
    error: str | None = None
    bank_updates: int = 0

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Privileged:
    """What only a teacher may read: the expert's next command, the task's targets, the workspace."""

    expert_action: str | None
    target: dict
    family: str
    workspace: Workspace


class Policy(Protocol):
    name: str

    def fingerprint(self) -> str: ...

    def reset(self, seed: int) -> None: ...

    def act(self, prompt: str, view: TurnView, privileged: Privileged) -> str: ...


class Stepper(Protocol):
    def reset(self, gamefile: str, seed: int = 0) -> EnvStep: ...

    def step(self, action: str) -> EnvStep: ...


def game_target(game: Game) -> dict:
    """The task's object / receptacle / toggle from traj_data.json, lower-cased like the engine's names."""
    try:
        params = json.loads((Path(game.path).parent / TRAJ_FILE).read_text())["pddl_params"]
    except (OSError, ValueError, KeyError) as e:
        raise EvoError(f"{Path(game.path).parent / TRAJ_FILE}: cannot read pddl_params ({e})") from None
    return {
        "object": params.get("object_target", "").lower(),
        "receptacle": params.get("parent_target", "").lower(),
        "toggle": params.get("toggle_target", "").lower(),
    }


def bank_digest(bank: Experience | None) -> str:
    if bank is None:
        return "none"
    return hashlib.sha256(json.dumps(bank.to_json(), sort_keys=True).encode()).hexdigest()[:16]


def fingerprint(game: Game, seed: int, policy: Policy, cfg: EpisodeConfig, bank: Experience | None, examples: str = "") -> str:
    key = {
        "examples": hashlib.sha256(examples.encode()).hexdigest()[:12] if examples else "",
        "game": game.id,
        "seed": seed,
        "policy": policy.fingerprint(),
        "episode": cfg.model_dump(),
        "prompt_version": PROMPT_VERSION,
        "bank": bank_digest(bank) if cfg.harness.mode != "env_only" and cfg.harness.experience else "none",
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def run_episode(env: Stepper, game: Game, policy: Policy, cfg: EpisodeConfig, bank: Experience | None, seed: int, examples: str = "") -> Trajectory:
    """Play one episode. Engine and worker failures make an errored trajectory, never an exception."""
    fp = fingerprint(game, seed, policy, cfg, bank, examples)
    traj = Trajectory(
        episode_id=f"{game.id}#s{seed}",
        fingerprint=fp,
        game_id=game.id,
        split=game.split,
        family=game.family,
        policy=policy.name,
        harness=cfg.harness.model_dump(),
        seed=seed,
        max_steps=cfg.max_steps,
        bank_updates=bank.updates if bank is not None else 0,
    )
    calls = {v: 0 for v in META_VERBS}
    invalid = repeats = steps = 0
    won = False
    try:
        if game.error:
            raise EvoError(game.error)
        traj.target = game_target(game)
        policy.reset(seed)
        step = env.reset(game.path, seed)
        traj.task = step.task
        ws = Workspace(cfg.harness, bank, task=step.task, family=game.family)
        ws.start(step.observation)
        observation, admissible, expert = step.observation, step.admissible, step.expert_action
        history: list[str] = []
        meta_seen: set[str] = set()  # meta-actions since the last env action: a repeat among them is spam
        t = 0
        while steps < cfg.max_steps and t < cfg.turn_limit and not won:
            view = TurnView(
                verbs=cfg.harness.verbs,
                objective=step.task,
                observation=observation,
                admissible=admissible,
                last_actions=tuple(history[-HISTORY:]),
                panels=tuple(ws.views().items()),
                examples=examples,
            )
            prompt = build_prompt(view)
            response = policy.act(prompt, view, Privileged(expert, traj.target, game.family, ws))
            parsed = parse_response(response)
            if parsed.error:
                kind, valid, shown, cost = "invalid", False, "Nothing happens.", 1
            elif parsed.verb:
                valid, shown = ws.handle(parsed.verb, parsed.argument)
                kind = parsed.verb if valid else "invalid"
                cost = 1 if (not valid or cfg.harness.charge_meta_actions) else 0
                if valid:
                    calls[parsed.verb] += 1
                    repeats += parsed.action in meta_seen
                    meta_seen.add(parsed.action)
            elif parsed.action in admissible:
                step = env.step(parsed.action)
                ws.observe(parsed.action, step.observation)
                meta_seen.clear()  # the room moved on: asking the same again is no longer spam
                observation, admissible, expert, won = step.observation, step.admissible, step.expert_action, step.won
                kind, valid, shown, cost = "env", True, step.observation, 1
                obj = traj.target.get("object", "")
                if traj.found_in is None and obj and parsed.action.startswith(f"take {obj} ") and " from " in parsed.action:
                    traj.found_in = parsed.action.split(" from ", 1)[1]
            else:
                kind, valid, shown, cost = "invalid", False, "Nothing happens.", 1
            if not valid:
                # The next prompt must differ from this one, or a greedy policy repeats itself to the end of
                # its budget: OBSERVATION says nothing happened, RESULT why, LAST ACTIONS holds the attempt.
                invalid += 1
                observation = "Nothing happens."
                ws.result = f"{parsed.verb}: invalid ({shown})" if parsed.verb else ""
            steps += cost
            history.append(parsed.action if parsed.action else "(invalid reply)")
            traj.turns.append(Turn(t, prompt, response, parsed.action, kind, valid, shown, cost))
            t += 1
        traj.notes = list(ws.notes)
        traj.recalled = list(ws.recalled)
    except PolicyError:
        raise
    except EvoError as e:  # EnvWorkerError included: this episode errored, the batch goes on
        traj.error = str(e)
    comp = components(won, steps, cfg.max_steps, calls, repeats, invalid)
    traj.outcome = {
        "won": won,
        "steps": steps,
        "steps_free": sum(1 for x in traj.turns if x.kind in ("env", "invalid")),  # meta-actions free (reported evaluations)
        "steps_charged": len(traj.turns),  # every meta-action a step (GRPO's training budget)
        "turns": len(traj.turns),
        "calls": calls,
        "invalid": invalid,
        "repeats": repeats,
    }
    traj.reward = {**comp, "update": cfg.update, "total": total(comp, cfg.update, cfg.reward)}
    return traj
