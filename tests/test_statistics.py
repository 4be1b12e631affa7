"""The statistics behind the comparison and ablation tables: Wilson intervals, the one-sided Fisher
exact test (against SciPy's), and the claims table built from them."""

import math

import pytest
from scipy.stats import fisher_exact

from evoharness.agent.compare import claims, comparison_table
from evoharness.agent.evaluate import fisher_greater, wilson


@pytest.mark.parametrize("w1,w2", [(31, 11), (23, 3), (34, 31), (0, 0), (60, 0), (5, 40)])
def test_fisher_greater_is_scipys_one_sided_test(w1, w2):
    want = fisher_exact([[w1, 60 - w1], [w2, 60 - w2]], alternative="greater")[1]
    assert math.isclose(fisher_greater(w1, 60, w2, 60), want, rel_tol=1e-9, abs_tol=1e-12)


def test_wilson_interval():
    assert wilson(0, 60) == (0.0, 0.0602)  # a 0 % model's interval still admits ~6 %
    lo, hi = wilson(31, 60)
    assert lo < 31 / 60 < hi and (lo, hi) == (0.3931, 0.6383)  # the textbook formula, z = 1.96


def _split(wins: int, n: int = 60) -> dict:
    calls = {v: 0.0 for v in ("track", "commit", "recall", "note")}
    return {"all": {"success": wins / n, "wins": wins, "episodes": n, "ci95": list(wilson(wins, n)), "steps": 30.0,
                    "steps_free": 30.0, "steps_charged": 40.0, "calls": calls, "invalid_rate": 0.0}}


def test_claims_name_their_test_and_the_table_carries_intervals():
    results = {"sft-inline": {"valid_seen": _split(31), "valid_unseen": _split(23)},
               "sft-env_only": {"valid_seen": _split(11), "valid_unseen": _split(3)},
               "grpo-inline": {"valid_seen": _split(34), "valid_unseen": _split(25)}}
    text = claims(results)
    assert "| the harness helps SFT (BPE-SFT above ReAct-SFT): sft-inline > sft-env_only | valid_seen | 31/60 vs 11/60 | 1.2e-04 |" in text
    assert "| GRPO improves on its SFT model: grpo-inline > sft-inline | valid_seen | 34/60 vs 31/60 | 0.3571 |" in text
    assert "**51.7** [39, 64] | 30.0 / 40.0 |" in comparison_table(results)
    assert "| valid_unseen | 23/60 vs 3/60 | 5.7e-06 |" in text  # a small p reads as itself, never as 0.0000
    del results["sft-env_only"]  # a claim whose models were not evaluated is left out, not reported as p = 1
    assert "sft-env_only" not in claims(results)


def test_ablation_table_names_each_claim_of_the_paper_with_its_test():
    from evoharness.agent.ablation import CLAIMS, ROWS, ablation_table

    seen = {"ReAct-SFT": 11, "frozen harness (always_on)": 14, "SFT-inline": 31, "plain GRPO (success only, env_only)": 13,
            "cost-aware GRPO (EvoHarness-RL)": 34, "cost-aware GRPO without Belief": 4, "cost-aware GRPO without Progress": 1,
            "cost-aware GRPO without Experience": 10}
    assert set(seen) == {r.label for r in ROWS}
    results = {k: {"valid_seen": _split(w), "valid_unseen": _split(max(0, w - 8))} for k, w in seen.items()}
    text = claims(results, CLAIMS)
    assert len(CLAIMS) == 7 and text.count("\n") == 1 + 2 * len(CLAIMS)
    assert "| choosing when to call the harness beats its panels every turn: SFT-inline > frozen harness (always_on) | valid_seen | 31/60 vs 14/60 | 0.0012 |" in text
    assert "| Progress helps: cost-aware GRPO (EvoHarness-RL) > cost-aware GRPO without Progress | valid_seen | 34/60 vs 1/60 | 1.8e-12 |" in text
    assert "**" not in ablation_table(results) and "31.0" not in ablation_table(results) and "51.7 [39, 64]" in ablation_table(results)
