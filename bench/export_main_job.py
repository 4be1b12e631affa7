"""Export a finished main job's figures to committed files, so every number the README shows can be re-derived.

Reads a project that ran the retrain (its ``data/eval`` and ``data/baselines`` episodes, its MLflow store) and
writes under ``--out``:

- ``outcomes.jsonl``: one compact line per episode of every evaluation (model or baseline, split, game, won, steps);
- ``stage_times.json``: each stage's seconds and whether it ran, from the retrain's MLflow child runs (the
  ``stage_seconds`` metric), with the run id, the processor kind (``machine`` tag) and the total;
- ``results.json``: per model and split the wins, success and 95 % Wilson interval, and the claims with their
  one-sided tests, computed from ``outcomes.jsonl`` alone (``derive``);
- ``results.md``: the table the README embeds between ``<!-- results: ... -->`` markers.

    .venv/bin/python bench/export_main_job.py --project . --out bench/results/main_job
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CLAIMS = (("sft-inline", "sft-env_only", "BPE-SFT above ReAct-SFT (McNemar, paired, one-sided)"),
          ("grpo-inline", "sft-inline", "GRPO above its SFT model (McNemar, paired, one-sided)"))


def outcomes_of(project: Path) -> list[dict]:
    rows = []
    for d in sorted((project / "data" / "eval").glob("*/valid_*")) + sorted((project / "data" / "baselines").glob("*-valid_*")):
        eps = d / "episodes.jsonl"
        if not eps.is_file():
            continue
        res = json.loads((d / "results.json").read_text())
        split = res["split"][0]
        label = d.parent.name if d.parent.name != "baselines" else d.name[: -len(split) - 1]
        wanted = res["games"] * len(res["seeds"])
        recs = [json.loads(x) for x in eps.read_text().splitlines() if x.strip()][:wanted]  # the evaluation's own, in order
        for r in recs:
            rows.append({"model": label, "split": split, "game": r["game_id"], "seed": r["seed"],
                         "won": int(bool((r.get("outcome") or {}).get("won")) and not r.get("error")), "steps": (r.get("outcome") or {}).get("steps")})
    return rows


def derive(rows: list[dict]) -> dict:
    """Every figure from the per-episode outcomes alone."""
    from evoharness.agent.evaluate import mcnemar_greater, wilson

    by: dict[tuple[str, str], dict[str, int]] = {}
    for r in rows:
        by.setdefault((r["model"], r["split"]), {})[f"{r['game']}#s{r['seed']}"] = r["won"]
    res: dict = {"models": {}, "claims": []}
    for (m, split), o in sorted(by.items()):
        w, n = sum(o.values()), len(o)
        lo, hi = wilson(w, n)
        res["models"].setdefault(m, {})[split] = {"wins": w, "episodes": n, "success": round(100 * w / n, 1), "ci95": [round(100 * lo, 1), round(100 * hi, 1)]}
    for a, b, what in CLAIMS:
        for split in ("valid_seen", "valid_unseen"):
            if (a, split) not in by or (b, split) not in by:
                continue
            x, y = by[(a, split)], by[(b, split)]
            only_a, only_b, p = mcnemar_greater(x, y)  # every model played the same games: paired by game
            res["claims"].append({"claim": what, "a": a, "b": b, "split": split, "p": float(f"{p:.3g}")})
    return res


def table(res: dict, times: dict | None) -> str:
    order = [m for m in ("random", "teacher", "base-inline", "sft-env_only", "sft-inline", "grpo-inline") if m in res["models"]]
    order += [m for m in res["models"] if m not in order]
    lines = ["| model | valid_seen % [95 % CI] | valid_unseen % [95 % CI] |", "|---|---|---|"]
    for m in order:
        cells = []
        for split in ("valid_seen", "valid_unseen"):
            s = res["models"][m].get(split)
            cells.append(f"{s['success']:.1f} [{s['ci95'][0]:.1f}, {s['ci95'][1]:.1f}] ({s['wins']}/{s['episodes']})" if s else "–")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    from evoharness.agent.compare import format_p

    lines += ["", "| claim | split | p |", "|---|---|---|"] + [f"| {c['claim']} | {c['split']} | {format_p(c['p'])} |" for c in res["claims"]]
    if times:
        lines += ["", f"Stage times (s) of retrain `{times['run_id'][:8]}` on {times['machine']}, {times['total_s'] / 60:.1f} min in all:", "",
                  "| stage | seconds | ran |", "|---|---|---|"] + [f"| {s} | {v['seconds']:.0f} | {'yes' if v['ran'] else 'reused'} |" for s, v in times["stages"].items()]
    return "\n".join(lines)


def stage_times(project: Path, run_id: str | None = None) -> dict:
    """The stage times of a full retrain (``run_id``, or the newest finished retrain that ran every stage, none of its
    training resumed from a checkpoint): one that reused stages or resumed took none of that time, so its total is not
    what a retrain costs. Retrains logged before the ``resumed_from`` tag existed cannot show a resume: name those."""
    import os

    from mlflow import MlflowClient

    from evoharness.ops import tracking

    os.environ.setdefault("MLFLOW_TRACKING_URI", tracking.tracking_uri(project))
    c = MlflowClient(tracking_uri=tracking.tracking_uri(project))
    exp = c.get_experiment_by_name(tracking.EXPERIMENT)
    parents = c.search_runs([exp.experiment_id], "tags.kind = 'retrain' and attributes.status = 'FINISHED'", order_by=["attributes.start_time DESC"])
    for parent in parents:
        if run_id and not parent.info.run_id.startswith(run_id):
            continue
        kids = c.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
        staged = [k for k in kids if "stage_seconds" in k.data.metrics]
        if run_id or (staged and all(k.data.tags.get("cached") == "false" and "resumed_from" not in k.data.tags for k in staged)):
            break
    else:
        raise SystemExit(f"error: {project}: no finished retrain {'named ' + run_id if run_id else 'that ran every stage'} in MLflow "
                         "(a retrain that reused stages or resumed training from checkpoints took none of that time; name one with --run)")
    stages = {}
    for k in sorted(kids, key=lambda r: r.info.start_time):
        if "stage_seconds" in k.data.metrics:
            stages[k.data.tags["stage"]] = {"seconds": k.data.metrics["stage_seconds"], "ran": k.data.tags.get("cached") == "false"}
    return {"run_id": parent.info.run_id, "machine": parent.data.tags.get("machine", "?"),
            "total_s": round((parent.info.end_time - parent.info.start_time) / 1000, 1), "stages": stages}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--project", type=Path, default=Path("."))
    ap.add_argument("--out", type=Path, default=Path("bench/results/main_job"))
    ap.add_argument("--run", default=None, help="the retrain whose stage times to export (an MLflow run id or its prefix; "
                    "default: the newest finished retrain that ran every stage)")
    args = ap.parse_args()
    rows = outcomes_of(args.project)
    if not rows:
        raise SystemExit(f"error: {args.project}: no evaluation episodes under data/eval or data/baselines (run the main job first)")
    times = stage_times(args.project, args.run)  # before anything is written: a failed export leaves the folder as it was
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "outcomes.jsonl").write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))
    (args.out / "stage_times.json").write_text(json.dumps(times, indent=2) + "\n")
    res = derive(rows)
    (args.out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    (args.out / "results.md").write_text(table(res, times) + "\n")
    print(table(res, times))


if __name__ == "__main__":
    main()
