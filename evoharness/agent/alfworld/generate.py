"""Generate ALFWorld games offline, in the official layout, checked solvable by the handcoded expert.

Deterministic from a seed: the same (seed, split, family, counts) gives the same files.
``valid_unseen`` uses only scenes never used for ``train``; ``valid_seen`` reuses the scenes of
``train`` with new object placements.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from evoharness.agent.alfworld.families import DEFAULT_UNSEEN_SCENES, FAMILIES, FAMILY_ROOMS, ROOM_SCENES
from evoharness.agent.alfworld.games import GAME_FILE, TRAJ_FILE
from evoharness.agent.alfworld.problem import NoTask, Problem, problem_pddl, sample_problem
from evoharness.agent.alfworld.scenes import available_scenes, domain_text, grammar_text, load_scene
from evoharness.agent.envpool import EnvPool, EnvWorker
from evoharness.core.errors import EvoError


@dataclass
class GenConfig:
    seed: int = 0
    per_family: dict[str, int] = field(default_factory=lambda: {"train": 4, "valid_seen": 2, "valid_unseen": 2})
    families: list[str] = field(default_factory=lambda: list(FAMILIES))
    unseen_scenes: tuple[int, ...] = DEFAULT_UNSEEN_SCENES
    max_per_type: int = 4
    distractors: int = 4
    max_expert_steps: int = 60
    workers: int = 2
    avoid: frozenset[str] = frozenset()  # problem_key()s never to generate (another root's games: no shared problem)
    counts: dict[str, dict[str, int]] | None = None  # split -> family -> games, instead of per_family's one count for every family
    seen_scenes: dict[str, list[int]] | None = None  # family -> the scenes its training games use (valid_seen draws from them)


def problem_key(pddl_problem: str) -> str:
    """A game's identity: its PDDL problem without the problem's name (which embeds the game's seed)."""
    body = re.sub(r"^\(define \(problem [^)]*\)", "", pddl_problem.strip())
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def problem_keys(root: Path) -> dict[str, str]:
    """problem_key -> game folder (split/task/trial) for every game under root (each split)."""
    root = Path(root)
    out: dict[str, str] = {}
    for path in sorted(root.glob(f"*/*/*/{GAME_FILE}")):
        try:
            out[problem_key(json.loads(path.read_text())["pddl_problem"])] = str(path.parent.relative_to(root))
        except (OSError, ValueError, KeyError) as e:
            raise EvoError(f"{path}: unreadable game ({type(e).__name__}: {e})") from None
    if not out:
        raise EvoError(f"{root}: no games to stay disjoint from")
    return out


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:4], "big")


def scene_pool(family: str, split: str, unseen: tuple[int, ...]) -> list[int]:
    have = set(available_scenes())
    rooms = FAMILY_ROOMS[family]
    scenes = [s for r in rooms for s in ROOM_SCENES[r] if s in have]
    if split == "valid_unseen":
        return [s for s in scenes if s in unseen]
    return [s for s in scenes if s not in unseen]


def write_game(trial: Path, problem: Problem, seed: int, walkthrough: list[str] | None) -> Path:
    """Write traj_data.json and game.tw-pddl as the official data has them."""
    from alfworld.agents.utils.misc import add_task_to_grammar

    trial.mkdir(parents=True, exist_ok=True)
    traj = {
        "task_id": trial.name,
        "task_type": problem.family,
        "pddl_params": problem.pddl_params,
        "scene": {"floor_plan": f"FloorPlan{problem.scene}", "scene_num": problem.scene, "random_seed": seed},
        "turk_annotations": {"anns": []},
    }
    (trial / TRAJ_FILE).write_text(json.dumps(traj, indent=2))
    random.seed(seed)  # task text templates use the module-level random
    grammar = add_task_to_grammar(grammar_text(), traj)
    game = {
        "pddl_domain": domain_text(),
        "grammar": grammar,
        "pddl_problem": problem_pddl(problem, f"plan_{seed}"),
        "solvable": walkthrough is not None,
        "walkthrough": walkthrough or [],
    }
    (trial / GAME_FILE).write_text(json.dumps(game))
    return trial / GAME_FILE


def expert_play(worker: EnvWorker, gamefile: str, seed: int, max_steps: int) -> list[str] | None:
    """The handcoded expert's walkthrough if it wins within max_steps, else None."""
    step = worker.reset(gamefile, seed)
    walk: list[str] = []
    for _ in range(max_steps):
        if step.expert_action is None:
            return None
        walk.append(step.expert_action)
        step = worker.step(step.expert_action)
        if step.won:
            return walk
    return None


def panel_digest(root: Path) -> str:
    """sha256 over every file under a games root (its relative path and bytes), in path order: the identity params pin."""
    h = hashlib.sha256()
    for f in sorted(p for p in Path(root).rglob("*") if p.is_file()):
        h.update(f.relative_to(root).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def generate(out: Path, cfg: GenConfig, progress=None) -> dict:
    """Generate every split; returns a summary (kept, rejected per family and split)."""
    out = Path(out)
    for fam in cfg.families:
        if fam not in FAMILIES:
            raise EvoError(f"games.families: unknown family {fam!r}")
    from evoharness.agent.alfworld.games import official_root

    official = official_root()
    if out.name == "json_2.1.1" or (official is not None and out.resolve() == official.resolve()):
        raise EvoError(f"games --out {out}: is an official ALFWorld json_2.1.1 folder; generated games go elsewhere (its splits are never replaced)")
    summary: dict = {"seed": cfg.seed, "splits": {}}
    train_scenes: dict[str, set[int]] = {}
    with EnvPool(cfg.workers) as pool:
        for split in ("train", "valid_seen", "valid_unseen"):
            wanted = cfg.counts.get(split, {}) if cfg.counts is not None else {f: cfg.per_family.get(split, 0) for f in cfg.families}
            if sum(wanted.values()) <= 0:
                continue  # not regenerated: what is there stays
            sdir = out / split
            if sdir.exists():
                shutil.rmtree(sdir)  # a split is regenerated whole: stale games must not linger
            summary["splits"][split] = {}
            for fam in cfg.families:
                n = wanted.get(fam, 0)
                if n <= 0:
                    continue
                pool_scenes = scene_pool(fam, split, cfg.unseen_scenes)
                if split == "valid_seen" and train_scenes.get(fam):
                    pool_scenes = sorted(train_scenes[fam])
                elif split == "valid_seen" and cfg.seen_scenes and cfg.seen_scenes.get(fam):
                    pool_scenes = sorted(cfg.seen_scenes[fam])
                if not pool_scenes:
                    raise EvoError(f"no scene can host {fam} in {split}")
                kept: list[tuple[int, Problem, list[str]]] = []
                rejected = shared = 0
                k = 0
                while len(kept) < n:
                    if k > 40 * max(n, 1) + 40:
                        raise EvoError(f"could not generate {n} solvable {fam} games for {split} (kept {len(kept)} after {k} tries)")
                    batch = []
                    while len(batch) < max(2, (n - len(kept)) + 1):
                        s = _seed(cfg.seed, split, fam, k)
                        k += 1
                        rng = random.Random(s)
                        scene = load_scene(rng.choice(pool_scenes))
                        try:
                            p = sample_problem(scene, fam, rng, max_per_type=cfg.max_per_type, distractors=cfg.distractors)
                        except NoTask:
                            rejected += 1
                            continue
                        if cfg.avoid and problem_key(problem_pddl(p, "x")) in cfg.avoid:
                            shared += 1  # the same problem as a game of the avoided root
                            continue
                        trial = sdir / p.dirname / f"trial_T{s:010d}"
                        batch.append((s, p, str(write_game(trial, p, s, None))))

                    def check(worker, job):
                        s, p, path = job
                        try:
                            return expert_play(worker, path, s, cfg.max_expert_steps)
                        except EvoError:
                            return None

                    results = pool.map(check, batch)
                    for (s, p, path), walk in zip(batch, results):
                        trial = Path(path).parent
                        if walk is not None and len(kept) < n:
                            write_game(trial, p, s, walk)
                            kept.append((s, p, walk))
                        else:
                            rejected += walk is None
                            shutil.rmtree(trial)
                            if not any(trial.parent.iterdir()):
                                trial.parent.rmdir()
                        if progress:
                            progress(split, fam, len(kept), n)
                if split == "train":
                    train_scenes[fam] = {p.scene for _, p, _ in kept}
                summary["splits"][split][FAMILIES[fam]] = {
                    "kept": len(kept),
                    "rejected": rejected,
                    **({"shared_skipped": shared} if cfg.avoid else {}),
                    "scenes": sorted({p.scene for _, p, _ in kept}),
                    "mean_expert_steps": round(sum(len(w) for *_, w in kept) / max(len(kept), 1), 2),
                }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
