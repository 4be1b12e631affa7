"""Export the ablation table's figures to committed files (``evoharness ablation`` must have run in ``--project``).

Reads the main job's evaluations it reuses (``data/eval``: ReAct-SFT, SFT-inline, cost-aware GRPO) and the
ablation models' (``data/ablation/eval``), and writes under ``--out``:

- ``outcomes.jsonl``: one compact line per episode (row, split, game, seed, won, free steps, harness calls);
- ``results.json``: per row and split the wins, success with its 95 % Wilson interval, harness calls and free
  steps per episode, and the paper's claims with McNemar's exact one-sided test, paired by game (every row plays the same games), all from ``outcomes.jsonl`` alone
  (``derive``);
- ``results.md``: the table beside the paper's numbers, then the claims.

    .venv/bin/python bench/export_ablation.py --project . --out bench/results/ablation
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SPLITS = ("valid_seen", "valid_unseen")


def outcomes_of(project: Path) -> list[dict]:
    from evoharness.agent.ablation import ROWS, _slug
    from evoharness.agent.harness.workspace import META_VERBS

    rows = []
    for row in ROWS:
        for split in SPLITS:
            d = project / "data" / "eval" / row.main / split if row.main else project / "data" / "ablation" / "eval" / _slug(row.label) / split
            res = json.loads((d / "results.json").read_text())
            wanted = res["games"] * len(res["seeds"])
            recs = [json.loads(x) for x in (d / "episodes.jsonl").read_text().splitlines() if x.strip()][:wanted]
            if len(recs) != wanted:
                raise SystemExit(f"error: {d}/episodes.jsonl holds {len(recs)} episodes, its results {wanted}")
            for r in recs:
                o = r.get("outcome") or {}
                rows.append({"row": row.label, "split": split, "game": r["game_id"], "seed": r["seed"],
                             "won": int(bool(o.get("won")) and not r.get("error")), "steps": o.get("steps_free", o.get("steps")),
                             "calls": sum((o.get("calls") or {}).get(v, 0) for v in META_VERBS)})
    return rows


def derive(rows: list[dict]) -> dict:
    """Every figure from the per-episode outcomes alone."""
    from evoharness.agent.ablation import CLAIMS, ROWS
    from evoharness.agent.evaluate import mcnemar_greater, wilson

    by: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        by.setdefault((r["row"], r["split"]), []).append(r)
    res: dict = {"rows": {}, "claims": []}
    for row in ROWS:
        for split in SPLITS:
            eps = by.get((row.label, split))
            if not eps:
                continue
            w, n = sum(e["won"] for e in eps), len(eps)
            lo, hi = wilson(w, n)
            res["rows"].setdefault(row.label, {"paper": list(row.paper)})[split] = {
                "wins": w, "episodes": n, "success": round(100 * w / n, 1), "ci95": [round(100 * lo, 1), round(100 * hi, 1)],
                "calls": round(sum(e["calls"] for e in eps) / n, 2), "steps": round(sum(e["steps"] or 0 for e in eps) / n, 1)}
    for a, b, what in CLAIMS:
        for split in SPLITS:
            if a in res["rows"] and b in res["rows"]:
                x, y = res["rows"][a][split], res["rows"][b][split]
                only_a, only_b, p = mcnemar_greater(*({f"{e['game']}#s{e['seed']}": e["won"] for e in by[(r, split)]} for r in (a, b)))
                res["claims"].append({"claim": what, "a": a, "b": b, "split": split, "wins": [x["wins"], y["wins"]],
                                      "discordant": [only_a, only_b], "p": float(f"{p:.3g}")})
    return res


def table(res: dict) -> str:
    lines = ["| model | valid_seen % [95 % CI] | valid_unseen % [95 % CI] | harness calls / episode (seen) | free steps (seen) | paper seen / unseen |",
             "|---|---|---|---|---|---|"]
    for label, r in res["rows"].items():
        cells = [f"{r[s]['success']:.1f} [{r[s]['ci95'][0]:.1f}, {r[s]['ci95'][1]:.1f}] ({r[s]['wins']}/{r[s]['episodes']})" for s in SPLITS]
        ps, pu = r["paper"]
        lines.append(f"| {label} | {cells[0]} | {cells[1]} | {r['valid_seen']['calls']:.1f} | {r['valid_seen']['steps']:.1f} | "
                     f"{'–' if ps is None else ps} / {'–' if pu is None else pu} |")
    lines += ["", "| claim (McNemar, paired, one-sided) | split | wins | won by one only | p |", "|---|---|---|---|---|"]
    for c in res["claims"]:
        lines.append(f"| {c['a']} above {c['b']}: {c['claim']} | {c['split']} | {c['wins'][0]} vs {c['wins'][1]} | {c['discordant'][0]} vs {c['discordant'][1]} | {c['p']:.3g} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--project", type=Path, default=Path("."))
    ap.add_argument("--out", type=Path, default=Path("bench/results/ablation"))
    args = ap.parse_args()
    rows = outcomes_of(args.project)
    res = derive(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "outcomes.jsonl").write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows))
    (args.out / "results.json").write_text(json.dumps(res, indent=1) + "\n")
    (args.out / "results.md").write_text(table(res) + "\n")
    print(table(res))


if __name__ == "__main__":
    main()
