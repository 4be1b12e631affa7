"""What the main job prints after the retrain flow: the data, the models' table, the decision and its checks, the git
record, and where the Prefect and MLflow UIs are."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable

from evoharness.agent.evaluate import format_table
from evoharness.core.secrets import redact


def print_results(root: Path, res: dict, prefect_api: str | None, echo: Callable[[str], None] = print) -> None:
    """What the main job prints after the retrain flow: data, models, the decision, where to look."""
    from evoharness.ops.tracking import tracking_uri

    root = Path(root)
    summary = json.loads((root / "data" / "baselines" / "summary.json").read_text())
    for label, s in summary.items():
        echo(format_table(label, s))
    demos = json.loads((root / "data" / "metrics" / "demos.json").read_text())
    pairs = json.loads((root / "data" / "metrics" / "pairs.json").read_text())
    echo(f"teacher demos: {demos['won']}/{demos['demos']} won; SFT pairs: {pairs['rows']['train']} train / {pairs['rows']['val']} val rows")
    react, react_pairs = root / "data" / "metrics" / "demos_react.json", root / "data" / "metrics" / "pairs_react.json"
    if react.exists() and react_pairs.exists():
        r, rp = json.loads(react.read_text()), json.loads(react_pairs.read_text())
        echo(f"ReAct-SFT's demos (the teacher without the harness): {r['won']}/{r['demos']} won; {rp['kept']} used (as many as SFT-inline's), "
             f"{rp['rows']['train']} train / {rp['rows']['val']} val rows")
    panel = root / "data" / "metrics" / "panel.json"
    if panel.exists():
        pm = json.loads(panel.read_text())
        counts = {split: sum(f["kept"] for f in fams.values()) for split, fams in pm.items() if isinstance(fams, dict)}
        echo(f"evaluation panel: {', '.join(f'{n} {split}' for split, n in counts.items())} games (digest {str(pm.get('digest', '?'))[:16]})")
    comparison = root / "data" / "eval" / "comparison.md"
    if comparison.exists():
        echo("\nModels on valid_seen / valid_unseen (success % per family, calls per episode by verb):")
        echo(comparison.read_text())
    d = res["decision"]
    echo(f"stages run: {', '.join(res['ran']) or 'none'}; reused from DVC: {', '.join(res['cached']) or 'none'} ({res['seconds']:.0f} s)")
    echo(f"decision: {d['model']} version {d['version']} {d['decision'].upper()}" + (" (decided before; nothing changed)" if d.get("reused") else ""))
    for r in d["reasons"]:
        echo(f"  - {r}")
    for c in d.get("checks", []):
        echo(f"  - {c}")
    uri = tracking_uri(root)
    if res.get("git_ref"):
        echo(f"git record: {res['git_ref']} ({res['git_record_commit'][:12]}): `evoharness reproduce {res['parent_run_id']}` re-makes it")
    if uri.startswith(("http://", "https://")):  # the team's server: its UI, never the credentials in the URI
        from evoharness.core.secrets import public_url

        shown = re.sub(r"//[^/@]*@", "//", public_url(uri)).rstrip("/")
        echo(f"MLflow run {res['parent_run_id']}: {shown}/#/experiments (`evoharness promotions` lists decisions)")
    else:
        echo(f"MLflow run {res['parent_run_id']}: `mlflow ui --backend-store-uri {redact(uri)}` then http://127.0.0.1:5000 "
             "(`evoharness promotions` lists decisions)")
    if prefect_api:
        echo(f"Prefect UI: {prefect_api.removesuffix('/api')}")
    else:
        echo("Prefect UI: `prefect server start` (it reads the same local database), then http://127.0.0.1:4200")
