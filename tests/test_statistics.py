"""The statistics behind the comparison and ablation tables: Wilson intervals, the one-sided Fisher
exact test and McNemar's exact paired test (against SciPy's), and the claims table built from them."""

import math

import pytest
from scipy.stats import binomtest, fisher_exact

from evoharness.agent.compare import claims, comparison_table
from evoharness.agent.evaluate import fisher_greater, mcnemar_greater, wilson


@pytest.mark.parametrize("w1,w2", [(31, 11), (23, 3), (34, 31), (0, 0), (60, 0), (5, 40)])
def test_fisher_greater_is_scipys_one_sided_test(w1, w2):
    want = fisher_exact([[w1, 60 - w1], [w2, 60 - w2]], alternative="greater")[1]
    assert math.isclose(fisher_greater(w1, 60, w2, 60), want, rel_tol=1e-9, abs_tol=1e-12)


@pytest.mark.parametrize("only_a,only_b,both", [(28, 13, 42), (26, 18, 30), (0, 0, 60), (5, 0, 0), (3, 19, 10)])
def test_mcnemar_greater_is_the_exact_binomial_test_on_discordant_games(only_a, only_b, both):
    n = only_a + only_b + both + 7  # 7 games both lost
    a = {f"g{i}": int(i < only_a + both) for i in range(n)}
    b = {f"g{i}": int(only_a <= i < only_a + both + only_b) for i in range(n)}
    b.update({"elsewhere": 1})  # a game only one model played is not a pair
    got = mcnemar_greater(a, b)
    want = binomtest(only_a, only_a + only_b, 0.5, alternative="greater").pvalue if only_a + only_b else 1.0
    assert got[:2] == (only_a, only_b) and math.isclose(got[2], want, rel_tol=1e-9)


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
    text = claims(results)  # no per-episode outcomes: Fisher on the counts, named as such
    assert "| the harness helps SFT (BPE-SFT above ReAct-SFT): sft-inline > sft-env_only | valid_seen | 31/60 vs 11/60 | Fisher exact | 1.2e-04 |" in text
    assert "| GRPO improves on its SFT model: grpo-inline > sft-inline | valid_seen | 34/60 vs 31/60 | Fisher exact | 0.3571 |" in text
    # with the outcomes (every model on the same games), the paired test: 34 vs 31 wins as 3 games won by GRPO only
    games = [f"g{i}" for i in range(60)]
    paired = {m: {"valid_seen": {g: int(i < w) for i, g in enumerate(games)}} for m, w in (("grpo-inline", 34), ("sft-inline", 31))}
    assert ("| GRPO improves on its SFT model: grpo-inline > sft-inline | valid_seen | 34/60 vs 31/60 | McNemar exact, paired by game "
            "(3 won by grpo-inline only, 0 by sft-inline only) | 0.1250 |") in claims(results, outcomes=paired)
    assert "**51.7** [39, 64] | 30.0 / 40.0 |" in comparison_table(results)
    assert "| valid_unseen | 23/60 vs 3/60 | Fisher exact | 5.7e-06 |" in text  # a small p reads as itself, never as 0.0000
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
    assert "| choosing when to call the harness beats its panels every turn: SFT-inline > frozen harness (always_on) | valid_seen | 31/60 vs 14/60 | Fisher exact | 0.0012 |" in text
    assert "| Progress helps: cost-aware GRPO (EvoHarness-RL) > cost-aware GRPO without Progress | valid_seen | 34/60 vs 1/60 | Fisher exact | 1.8e-12 |" in text
    assert "**" not in ablation_table(results) and "31.0" not in ablation_table(results) and "51.7 [39, 64]" in ablation_table(results)
