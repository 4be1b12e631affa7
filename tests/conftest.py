"""Shared fixtures: one small generated game set per session, played on the real engine."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def games_root(tmp_path_factory) -> Path:
    """One game per family in each of train, valid_seen and valid_unseen (18 games)."""
    from evoharness.alfworld.generate import GenConfig, generate

    root = tmp_path_factory.mktemp("games")
    generate(root, GenConfig(seed=7, per_family={"train": 1, "valid_seen": 1, "valid_unseen": 1}))
    return root


@pytest.fixture()
def games_copy(games_root, tmp_path) -> Path:
    """A private copy that a test may corrupt."""
    dst = tmp_path / "games"
    shutil.copytree(games_root, dst)
    return dst


@pytest.fixture(scope="session")
def pool():
    from evoharness.envpool import EnvPool

    p = EnvPool(2)
    yield p
    p.close()
