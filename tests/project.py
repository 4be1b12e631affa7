"""A copy of the project in a temp folder as its own git + DVC repo with a local remote, and a micro
parameter set that runs every stage of the pipeline on 2 cores in a few minutes."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from evoharness.ops.vcs import dvc, git
from evoharness.ops.remote import ensure_remote

ROOT = Path(__file__).resolve().parents[1]

MICRO_MODEL = {"kind": "tiny", "hidden_size": 32, "intermediate_size": 64, "layers": 1, "heads": 2, "kv_heads": 1, "max_length": 1024}
MICRO = {
    "seed": 3,
    "profile": "tiny-cpu",
    "workers": 2,
    "games": {"per_family": {"train": 1, "valid_seen": 1, "valid_unseen": 1}, "max_per_type": 3, "distractors": 2},
    "grpo_games": {"seed": 4, "per_family": {"train": 1}},
    "panel": {"seed": 6, "per_family": {s: {f: 1 for f in ("pick_and_place_simple", "look_at_obj_in_light", "pick_clean_then_place_in_recep",
                                                        "pick_heat_then_place_in_recep", "pick_cool_then_place_in_recep", "pick_two_obj_and_place")}
                                        for s in ("valid_seen", "valid_unseen")}},
    "episode": {"max_steps": 40},
    "demos": {"n": 6, "noise": 0.2, "batch_size": 6},
    "pairs": {"val_fraction": 0.2, "few_shot": 0},
    "validate": {"max_tokens": 1024},
    "eval": {"seeds": [0], "baselines": ["teacher"]},
    "consolidator": {"endpoint": "rules", "window": 20},
    "profiles": {"tiny-cpu": {
        "base": MICRO_MODEL,
        "sft": {"batch_size": 8, "max_steps": 3, "save_steps": 1, "eval_steps": 3, "max_length": 1024},
        "grpo": {"games_per_step": 2, "rollouts": 2, "turns_per_rollout": 2, "steps": 1, "learning_rate": 0.0005,
                 "max_new_tokens": 16, "max_steps_per_episode": 3, "save_steps": 1},
        "launcher": "local",
        "num_processes": 1,
        "deepspeed_config": "",
        "accelerate_config": "",
        "device": "cpu",
        "generation": "hf",
        "decoding": "constrained",
        "eval_games_per_family": 1,
        "eval_max_steps": 6,
        "episode_workers": 2,
    }},
    "promotion": {"model_name": "evoharness-test", "thresholds": {"tiny-cpu": {"min_seen": 0.0, "min_unseen": 0.0, "tolerance": 0.05, "must_beat": []}}},
}


# The tests' own commits stand in for a user's, so they name an author per command (git -c), leaving the
# repository, HOME and the environment without an identity, as on a fresh machine (conftest).
USER = ["-c", "user.name=test user", "-c", "user.email=user@example.com"]


def commit(repo: Path, *args: str) -> None:
    """``git commit ARGS`` as the test's user."""
    git([*USER, "commit", *args], repo)


def _new_repo(base: Path, params: dict) -> Path:
    """The project's code and config in ``base/repo``, as a fresh git + DVC repository."""
    repo = Path(base) / "repo"
    repo.mkdir(parents=True)
    for d in ("evoharness", "flows", "tasks", "configs"):
        shutil.copytree(ROOT / d, repo / d, ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("dvc.yaml", ".dvcignore", ".gitignore", "prefect.yaml", "constraints.txt"):
        shutil.copy(ROOT / f, repo / f)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    git(["init", "-q", "-b", "main"], repo)  # no identity in its config: the product's own commits must need none
    dvc(["init", "-q"], repo)
    dvc(["config", "core.autostage", "true"], repo)
    return repo


def make_project(base: Path, params: dict | None = None, remote: Path | None = None) -> Path:
    repo = _new_repo(base, params or MICRO)
    ensure_remote(repo, str(remote or (Path(base) / "remote")))
    git(["add", "-A"], repo)
    commit(repo, "-q", "-m", "pipeline")
    return repo


def make_shared_project(base: Path, params: dict, origin: str, remote_url: str, user: str, password: str) -> Path:
    """A project as a team keeps it: code pushed to a git origin, the default DVC remote a network
    one named in the committed .dvc/config, its credentials only in this machine's config.local."""
    repo = _new_repo(base, params)
    dvc(["remote", "add", "-d", "storage", remote_url], repo)
    dvc(["remote", "modify", "--local", "storage", "user", user], repo)
    dvc(["remote", "modify", "--local", "storage", "password", password], repo)
    git(["add", "-A"], repo)
    commit(repo, "-q", "-m", "pipeline")
    git(["remote", "add", "origin", origin], repo)
    git(["push", "-q", "origin", "main"], repo)
    git(["branch", "-q", "--set-upstream-to=origin/main"], repo)
    return repo
