"""The library's command line (``python -m evoharness.cli``: the DVC stages' commands), one module per command
group: ``data``, ``train``, ``evaluation``, ``ops``; ``app`` holds the Typer app and the helpers they share. Every
failure is one line: ``error: <what and where>``. The commands that start Prefect flows (``run``, ``deploy``) live
above the library, in ``flows.cli``, which is what the ``evoharness`` command runs."""

from __future__ import annotations

from evoharness.cli import data, train, evaluation, ops  # noqa: F401  (importing a group registers its commands)
from evoharness.cli.app import PARAMS, app, main

__all__ = ["PARAMS", "app", "main"]
