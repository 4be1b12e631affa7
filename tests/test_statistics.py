"""The statistics behind the comparison and ablation tables: Wilson intervals, McNemar's exact paired test (against
SciPy's binomial test), and the claims table built from them."""

import math

import pytest
from scipy.stats import binomtest

from evoharness.agent.compare import claims, comparison_table
from evoharness.agent.evaluate import mcnemar_greater, wilson
from evoharness.core.errors import EvoError


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


def _outcomes(wins: dict[str, dict[str, int]]) -> dict:
    """Per-episode outcomes on 60 shared games: a model with w wins won the first w (so any two differ on |w1 - w2|)."""
    return {m: {split: {f"g{i}": int(i < w) for i in range(60)} for split, w in by.items()} for m, by in wins.items()}


def test_claims_name_their_test_and_the_table_carries_intervals():
    from evoharness.agent.compare import CLAIMS

    wins = {"sft-inline": {"valid_seen": 31, "valid_unseen": 23}, "sft-env_only": {"valid_seen": 11, "valid_unseen": 3},
            "grpo-inline": {"valid_seen": 34, "valid_unseen": 25}}
    results = {m: {split: _split(w) for split, w in by.items()} for m, by in wins.items()}
    text = claims(results, CLAIMS, _outcomes(wins))
    assert ("| GRPO improves on its SFT model: grpo-inline > sft-inline | valid_seen | 34/60 vs 31/60 | McNemar exact, paired by game "
            "(3 won by grpo-inline only, 0 by sft-inline only) | 0.1250 |") in text
    assert "| valid_unseen | 23/60 vs 3/60 | McNemar exact, paired by game (20 won by sft-inline only, 0 by sft-env_only only) | 9.5e-07 |" in text  # never 0.0000
    assert "**51.7** [39, 64] | 30.0 / 40.0 |" in comparison_table(results)
    with pytest.raises(EvoError, match=r"no per-episode outcomes of \['sft-env_only'\] on valid_seen"):
        claims(results, CLAIMS, _outcomes({m: by for m, by in wins.items() if m != "sft-env_only"}))  # no test on counts alone
    del results["sft-env_only"]  # a claim whose models were not evaluated is left out, not reported as p = 1
    assert "sft-env_only" not in claims(results, CLAIMS, _outcomes(wins))


def test_ablation_table_names_each_claim_of_the_paper_with_its_test():
    from evoharness.agent.ablation import CLAIMS, ROWS, ablation_table

    seen = {"ReAct-SFT": 11, "frozen harness (always_on)": 14, "SFT-inline": 31, "plain GRPO (success only, env_only)": 13,
            "cost-aware GRPO (EvoHarness-RL)": 34, "cost-aware GRPO without Belief": 4, "cost-aware GRPO without Progress": 1,
            "cost-aware GRPO without Experience": 10}
    assert set(seen) == {r.label for r in ROWS}
    wins = {k: {"valid_seen": w, "valid_unseen": max(0, w - 8)} for k, w in seen.items()}
    results = {k: {split: _split(w) for split, w in by.items()} for k, by in wins.items()}
    text = claims(results, CLAIMS, _outcomes(wins))
    assert len(CLAIMS) == 7 and text.count("\n") == 1 + 2 * len(CLAIMS)
    assert ("| choosing when to call the harness beats its panels every turn: SFT-inline > frozen harness (always_on) | valid_seen | 31/60 vs 14/60 | "
            "McNemar exact, paired by game (17 won by SFT-inline only, 0 by frozen harness (always_on) only) | 7.6e-06 |") in text
    assert "| Progress helps: cost-aware GRPO (EvoHarness-RL) > cost-aware GRPO without Progress | valid_seen | 34/60 vs 1/60 |" in text
    assert "**" not in ablation_table(results) and "31.0" not in ablation_table(results) and "51.7 [39, 64]" in ablation_table(results)
