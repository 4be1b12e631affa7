"""bench/grpo_seeds.py's statistics: the mean gain over seeds with its 95 % t-interval and the paired test per seed,
re-derived from the compact per-episode outcomes it commits."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from grpo_seeds import rederive, summarize, t_interval  # noqa: E402


def test_t_interval_matches_the_textbook_case():
    mean, sd, half = t_interval([9.0, 15.0, 3.0])  # sd 6, k 3: t(0.975, 2) = 4.303 -> 4.303 * 6 / sqrt(3) = 14.9
    assert (mean, sd) == (9.0, 6.0) and half == pytest.approx(14.906, abs=1e-3)
    mean, sd, half = t_interval([10.0, 12.0, 8.0, 11.0, 9.0])
    assert mean == 10.0 and half == pytest.approx(2.776 * sd / 5 ** 0.5)


def test_the_figures_are_re_derived_from_the_committed_outcomes(tmp_path):
    games = [f"valid_seen/g{i}#s0" for i in range(20)]
    outcomes = {("sft", "valid_seen"): {g: int(i < 8) for i, g in enumerate(games)}}
    for s, extra in ((0, 4), (1, 2), (2, 6)):  # each seed wins the SFT's 8 games and `extra` more
        outcomes[(f"grpo-s{s}", "valid_seen")] = {g: int(i < 8 + extra) for i, g in enumerate(games)}
    res = summarize(outcomes, [0, 1, 2], ["valid_seen"])
    r = res["splits"]["valid_seen"]
    assert [x["gain"] for x in r["per_seed"]] == [20.0, 10.0, 30.0] and r["mean_gain"] == 20.0
    assert r["per_seed"][0]["only_grpo_won"] == 4 and r["per_seed"][0]["only_sft_won"] == 0
    assert r["per_seed"][0]["mcnemar_p"] == pytest.approx(1 / 16, abs=1e-4)
    assert r["ci95"][0] == pytest.approx(20 - 4.303 * 10 / 3 ** 0.5, abs=0.01)
    lines = [json.dumps({"model": m, "split": sp, "episode": e, "won": w}) for (m, sp), o in outcomes.items() for e, w in o.items()]
    (tmp_path / "outcomes.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "results.json").write_text(json.dumps(res))
    assert rederive(tmp_path) == res
