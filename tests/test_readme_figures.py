"""Every figure the README and docs/ show is read from a committed result file, and every result file's figures
are re-derived here from the per-episode outcomes committed beside them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def test_every_results_block_in_the_docs_is_its_file_word_for_word():
    import readme_figures

    assert readme_figures.stale() == [], "refresh with `.venv/bin/python bench/readme_figures.py --write`"


def test_a_block_that_drifts_from_its_file_is_caught(tmp_path, monkeypatch):
    import readme_figures

    (tmp_path / "docs").mkdir()
    (tmp_path / "r.md").write_text("| a | 1 |\n")
    (tmp_path / "README.md").write_text("x\n<!-- results: r.md -->\n| a | 2 |\n<!-- /results -->\n")
    monkeypatch.setattr(readme_figures, "ROOT", tmp_path)
    assert readme_figures.stale() == ["README.md: r.md (differs from its file)"]
    readme_figures.write()
    assert readme_figures.stale() == [] and "| a | 1 |" in (tmp_path / "README.md").read_text()


def test_the_committed_results_are_re_derived_from_their_outcomes():
    import export_ablation
    import export_main_job
    import grpo_seeds
    import sampling_eval

    checked = 0  # every committed outcomes file, whichever bench wrote it
    for f in sorted((ROOT / "bench" / "results").glob("*/**/outcomes.jsonl")):
        d = f.parent
        rows = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
        saved = json.loads((d / "results.json").read_text())
        if "stage_times.json" in {p.name for p in d.iterdir()}:  # a main job's export
            res = export_main_job.derive(rows)
            assert res == saved, d
            times = json.loads((d / "stage_times.json").read_text())
            assert (d / "results.md").read_text().strip() == export_main_job.table(res, times).strip(), d
        elif "row" in rows[0]:  # the ablation table's export
            res = export_ablation.derive(rows)
            assert res == saved, d
            assert (d / "results.md").read_text().strip() == export_ablation.table(res).strip(), d
        elif "run" in rows[0]:  # the sampling bench
            outcomes: dict = {}
            for r in rows:
                outcomes.setdefault((r["model"], r["split"], r["run"]), {})[r["game"]] = r["won"]
            res = sampling_eval.summarize(outcomes, list(saved["models"]), list(next(iter(saved["models"].values()))), saved["seeds"])
            assert {k: saved[k] for k in res} == res, d
        else:  # GRPO over seeds
            res = grpo_seeds.rederive(d)
            assert {k: saved[k] for k in res} == res, d
        checked += 1
    assert checked >= 1 and (ROOT / "bench" / "results" / "main_job" / "outcomes.jsonl").is_file()  # the README's table is among them
