"""One dispatched stage job, run from the dispatched commit's own checkout (``stagerun.run_in_checkout``
starts ``python -m evoharness.stagejob SPEC RESULT`` there): the commit's code pulls the inputs, runs
the stage and pushes its outputs. It dies with its driver: orphaned, it kills its own process group."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from evoharness.errors import EvoError


def _die_with(parent: int):
    """Once the driver is gone (killed outright, or by its worker), the DVC command running is killed with its
    process group (``lineage.guarded``) and then this job's own group. Returns the guard's check."""
    gone = threading.Event()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        gone.set()
        time.sleep(5)  # the guard's turn first: it kills DVC's own process group
        os.killpg(os.getpgrp(), signal.SIGKILL)

    def check() -> None:
        if gone.is_set():
            raise EvoError("the job's driver is gone (killed, or cancelled by its worker): the stage is stopped")

    threading.Thread(target=watch, daemon=True, name="die-with-driver").start()
    return check


def main(argv: list[str]) -> int:
    from evoharness.lineage import guarded
    from evoharness.stagerun import run_checked_out

    check = _die_with(os.getppid())
    spec_f, result_f = Path(argv[0]), Path(argv[1])
    try:
        with guarded(check):
            res = run_checked_out(json.loads(spec_f.read_text()), Path.cwd())
    except EvoError as e:
        print(f"error: {e}", flush=True)
        return 2
    tmp = result_f.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(res)))
    tmp.replace(result_f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
