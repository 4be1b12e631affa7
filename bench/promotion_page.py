"""The reviewer's page, as a reviewer sees it: a registered model version in MLflow's own UI
(`mlflow server` on loopback over the project's store), rendered by headless Chromium and saved as a
PNG. The page is the version's description, which the promotion gate writes: the decision, each check
with its value and threshold, the per-family table beside the champion's, the annealing plot.

    .venv/bin/python bench/promotion_page.py [--store sqlite:///mlflow.db] [--model NAME] [--version N] [--out docs/promotion-page.png] [--width 1900] [--height 1700]

Needs Debian's chromium (`apt-get install chromium`); prints where the page and the picture are.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", default=f"sqlite:///{Path.cwd() / 'mlflow.db'}")
    ap.add_argument("--model", default=None, help="registered model (default: the newest evoharness-agent-*)")
    ap.add_argument("--version", default=None, help="model version (default: the newest)")
    ap.add_argument("--out", type=Path, default=Path("docs/promotion-page.png"))
    ap.add_argument("--height", type=int, default=1700)
    ap.add_argument("--width", type=int, default=1900)
    args = ap.parse_args()
    from mlflow import MlflowClient

    c = MlflowClient(tracking_uri=args.store, registry_uri=args.store)
    name = args.model or sorted((m.name for m in c.search_registered_models("name LIKE 'evoharness-agent-%'")), key=len)[0]
    version = args.version or str(max(int(v.version) for v in c.search_model_versions(f"name='{name}'")))
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("error: no chromium on PATH (Debian: apt-get install chromium)")
    port = free_port()
    log = Path(tempfile.mkdtemp()) / "mlflow.log"
    server = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri", args.store, "--host", "127.0.0.1",
                               "--port", str(port), "--workers", "1"], stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    raise SystemExit(f"error: mlflow server did not start: {log.read_text()[-1500:]}")
                time.sleep(0.5)
        url = f"http://127.0.0.1:{port}/#/models/{name}/versions/{version}"
        args.out.parent.mkdir(parents=True, exist_ok=True)
        profile = tempfile.mkdtemp()
        cmd = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}", f"--window-size={args.width},{args.height}",
               "--virtual-time-budget=20000", "--hide-scrollbars", f"--screenshot={args.out.resolve()}", url]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
        if r.returncode or not args.out.exists():
            raise SystemExit(f"error: chromium failed ({r.returncode}): {r.stderr[-1500:]}")
        print(f"{name} version {version}: {url}\nscreenshot: {args.out} ({args.out.stat().st_size:,} bytes)")
    finally:
        os.killpg(server.pid, 15)


if __name__ == "__main__":
    main()
