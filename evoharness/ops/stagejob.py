"""One dispatched stage job, run from the dispatched commit's own checkout (``dispatch.run_in_checkout``
starts ``python -m evoharness.ops.stagejob SPEC RESULT`` there): the commit's code pulls the inputs, runs
the stage and pushes its outputs. It dies with its driver: orphaned, it kills its own process group.

It also reads its own flow run's state from the Prefect API (plain HTTP, every ``FOLLOW_S``) and stops,
its driver included, once the run is being cancelled or has ended. The worker is meant to do that on
``Cancelling``, but cannot when the driver is frozen and the worker's event subscription misses the
cancellation (it backfills from the box's own clock: on a box minutes ahead, never)."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from evoharness.core.errors import EvoError


def _die_with(parent: int, gone: threading.Event):
    """Once the driver is gone (killed outright, or by its worker) or ``gone`` is set, the DVC command running
    is killed with its process group (``vcs.guarded``) and then this job's own group. Returns the guard's check."""

    def watch() -> None:
        while os.getppid() == parent and not gone.is_set():
            time.sleep(1)
        gone.set()
        time.sleep(5)  # the guard's turn first: it kills DVC's own process group
        os.killpg(os.getpgrp(), signal.SIGKILL)

    def check() -> None:
        if gone.is_set():
            raise EvoError("the job's driver is gone (killed, or cancelled by its worker): the stage is stopped")

    threading.Thread(target=watch, daemon=True, name="die-with-driver").start()
    return check


FOLLOW_S = 10.0
STOPPED_STATES = ("CANCELLING", "CANCELLED", "CRASHED", "FAILED", "COMPLETED")


def _api(api: str, path: str, body: dict | None = None) -> dict | None:
    """One call of the Prefect REST API (the library does not import Prefect); None when it cannot be made."""
    import base64
    import urllib.request

    req = urllib.request.Request(f"{api.rstrip('/')}/{path}", data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json"}, method="POST" if body is not None else "GET")
    if os.environ.get("PREFECT_API_KEY"):
        req.add_header("Authorization", f"Bearer {os.environ['PREFECT_API_KEY']}")
    elif os.environ.get("PREFECT_API_AUTH_STRING"):
        req.add_header("Authorization", "Basic " + base64.b64encode(os.environ["PREFECT_API_AUTH_STRING"].encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read() or b"{}")
    except (OSError, ValueError):
        return None  # the server away: the driver's fence decides


def _flow_run_state(api: str, flow_run_id: str) -> str | None:
    return ((_api(api, f"flow_runs/{flow_run_id}") or {}).get("state") or {}).get("type")


def _follow(flow_run_id: str | None, driver: int, stop: threading.Event) -> None:
    api = os.environ.get("PREFECT_API_URL", "").strip()
    if not (api and flow_run_id):
        return

    def loop() -> None:
        while not stop.wait(FOLLOW_S):
            state = _flow_run_state(api, flow_run_id)
            if state in STOPPED_STATES:
                print(f"the job's flow run is {state}: stopping the stage and its driver (pid {driver})", flush=True)
                try:
                    os.kill(driver, signal.SIGKILL)  # frozen or not, it must not outlive its cancellation
                except ProcessLookupError:
                    pass
                if state == "CANCELLING":  # what the worker would have said, had it been told
                    _api(api, f"flow_runs/{flow_run_id}/set_state", {"state": {"type": "CANCELLED", "name": "Cancelled", "message":
                         "the job stopped itself on its cancellation (its driver did not answer)"}, "force": True})
                stop.set()  # then the DVC command and this job's process group go
                return

    threading.Thread(target=loop, daemon=True, name="follow-flow-run").start()


def main(argv: list[str]) -> int:
    from evoharness.ops.dispatch import run_checked_out
    from evoharness.ops.vcs import guarded

    spec = json.loads(Path(argv[0]).read_text())
    gone = threading.Event()
    check = _die_with(os.getppid(), gone)
    _follow(spec.get("flow_run_id"), os.getppid(), gone)

    def stopped(signum, _frame):  # the driver stops the job (its time limit, a fence, a cancellation)
        raise EvoError(f"the job was stopped by signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, stopped)
    result_f = Path(argv[1])
    try:
        with guarded(check):
            res = run_checked_out(spec, Path.cwd())
    except EvoError as e:
        print(f"error: {e}", flush=True)
        return 2
    tmp = result_f.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(res)))
    tmp.replace(result_f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
