"""The game loader: one listing for generated games and the official ALFWorld json_2.1.1 splits.

Both use the official layout ``<split>/<task>-<obj>-<mrecep>-<recep>-<scene>/trial_*/`` holding
``traj_data.json`` and ``game.tw-pddl``; the rules for which games count are AlfredTWEnv's.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from evoharness.agent.alfworld.families import FAMILIES, SPLITS
from evoharness.core.errors import EvoError

GAME_FILE = "game.tw-pddl"
TRAJ_FILE = "traj_data.json"


@dataclass(frozen=True)
class Game:
    """One playable game. ``id`` is ``<split>/<task dir>/<trial>``: stable across machines.

    ``error`` is set when the files are unreadable; such a game is still listed so that an
    evaluation reports it as an errored episode rather than silently skipping it.
    """

    id: str
    path: str
    split: str
    family: str
    error: str | None = None

    @property
    def short_family(self) -> str:
        return FAMILIES.get(self.family, self.family)


# TextWorld's grammar evaluates ``{...}`` in its rules as Python: a game file is accepted only with ALFWorld's
# own domain and grammar (this alfworld package's files), the grammar's goal replaced by plain words, and a
# PDDL problem made only of PDDL's characters. Anything else is refused by content, before the engine sees it.
_GOAL = re.compile(r"[A-Za-z0-9 ,.'-]{1,300}")
_PROBLEM = re.compile(r"[A-Za-z0-9\s()\-:?_.;=]*")
MAX_GAME_BYTES = 4 << 20


@lru_cache(maxsize=1)
def _trusted() -> tuple[str, str, str]:
    from evoharness.agent.alfworld.scenes import domain_text, grammar_text

    prefix, _, suffix = grammar_text().partition("UNKNOWN GOAL")
    return domain_text(), prefix, suffix


def untrusted(data: dict) -> str | None:
    """Why a game file's content is not ALFWorld's own (None: it is). Checked field by field, by content."""
    domain, prefix, suffix = _trusted()
    if data["pddl_domain"] != domain:
        return "its pddl_domain is not ALFWorld's alfred.pddl"
    g = data["grammar"]
    goal = g[len(prefix):len(g) - len(suffix)] if len(g) >= len(prefix) + len(suffix) else ""
    if not (g.startswith(prefix) and g.endswith(suffix) and _GOAL.fullmatch(goal)):
        return "its grammar is not ALFWorld's alfred.twl2 with a plain-words goal (a grammar can run code)"
    if not _PROBLEM.fullmatch(data["pddl_problem"]):
        return "its pddl_problem holds characters PDDL does not use"
    return None


def official_root() -> Path | None:
    """``$ALFWORLD_DATA/json_2.1.1`` when it holds the official splits, else None."""
    root = os.environ.get("ALFWORLD_DATA")
    if not root:
        return None
    p = Path(root) / "json_2.1.1"
    return p if p.is_dir() else None


def resolve_root(root: str | Path | None) -> Path:
    if root is not None:
        return Path(root)
    official = official_root()
    if official is None:
        raise EvoError("no games root given and $ALFWORLD_DATA/json_2.1.1 does not exist; run `evoharness games` first")
    return official


def _read_game(trial: Path, root: Path, split: str) -> Game | None:
    gid = trial.relative_to(root).as_posix()
    gpath = trial / GAME_FILE
    try:
        traj = json.loads((trial / TRAJ_FILE).read_text())
        family = traj["task_type"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return Game(gid, str(gpath), split, "unknown", f"{trial / TRAJ_FILE}: unreadable traj_data ({type(e).__name__}: {e})")
    if family not in FAMILIES:
        return None  # movable-receptacle tasks etc.: AlfredTWEnv skips them too
    if not gpath.exists():
        return None
    try:
        if gpath.stat().st_size > MAX_GAME_BYTES:
            raise ValueError(f"larger than {MAX_GAME_BYTES >> 20} MiB")
        data = json.loads(gpath.read_text())
        for key in ("pddl_domain", "grammar", "pddl_problem"):
            if not isinstance(data.get(key), str):
                raise ValueError(f"missing field {key!r}")
    except (OSError, ValueError) as e:
        return Game(gid, str(gpath), split, family, f"{gpath}: corrupt game file ({e})")
    why = untrusted(data)
    if why:
        raise EvoError(f"game file {gpath} refused: {why}; games are data, never code (regenerate it with `evoharness games`)")
    if data.get("solvable") is not True:
        return None
    return Game(gid, str(gpath), split, family)


def list_games(root: str | Path | None, split: str, families: list[str] | None = None) -> list[Game]:
    """Every game of a split, sorted by id; AlfredTWEnv's rules (solvable, no movable/Sliced)."""
    if split not in SPLITS:
        raise EvoError(f"unknown split {split!r} (known: {', '.join(SPLITS)})")
    base = resolve_root(root)
    sdir = base / split
    if not sdir.is_dir():
        raise EvoError(f"split folder {sdir} does not exist")
    out = []
    for traj in sorted(sdir.glob(f"*/*/{TRAJ_FILE}")):
        trial = traj.parent
        if "movable" in str(trial) or "Sliced" in str(trial):
            continue
        g = _read_game(trial, base, split)
        if g is not None and (families is None or g.family in families or g.error):
            out.append(g)
    return out
