"""Whole files or none: ``write_text`` writes a temporary file beside the target and renames it over the
target, so a kill mid-write leaves the old file (or none), never a torn one that a resume or a gate reads."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def write_text(path: str | Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(path: str | Path, data, **dumps) -> Path:
    return write_text(path, json.dumps(data, **dumps))
