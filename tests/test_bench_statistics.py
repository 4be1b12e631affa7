"""The benches' statistics (bench/grpo_seeds.py, bench/sampling_eval.py): means over seeds with 95 % t-intervals, paired tests,
nucleus filtering, and the figures re-derived from the compact per-episode outcomes the benches commit."""

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



def test_a_seed_run_stopped_part_way_keeps_its_outcomes_and_reports_the_seeds_done(tmp_path):
    from grpo_seeds import check_machine, load_outcomes, write_results

    from evoharness.core.environment import machine

    assert check_machine(tmp_path, False, {}) == machine()  # a new run records the processor kind it trains on
    games = [f"g{i}#s0" for i in range(10)]
    outcomes = {("sft", sp): {g: int(i < 4) for i, g in enumerate(games)} for sp in ("valid_seen", "valid_unseen")}
    assert write_results(tmp_path, outcomes, ["valid_seen", "valid_unseen"], Path("data/panel")) is None  # no GRPO seed yet
    outcomes[("grpo-s0", "valid_seen")] = {g: int(i < 6) for i, g in enumerate(games)}
    assert write_results(tmp_path, outcomes, ["valid_seen", "valid_unseen"], Path("data/panel")) is None  # seed 0 half done
    outcomes[("grpo-s0", "valid_unseen")] = {g: int(i < 5) for i, g in enumerate(games)}
    res = write_results(tmp_path, outcomes, ["valid_seen", "valid_unseen"], Path("data/panel"))
    assert res["seeds"] == [0] and res["splits"]["valid_seen"]["mean_gain"] == 20.0
    assert res["splits"]["valid_seen"]["ci95"] is None and "(one seed)" in (tmp_path / "results.md").read_text()
    assert load_outcomes(tmp_path / "outcomes.jsonl") == outcomes  # what a resumed run starts from
    assert rederive(tmp_path) == {k: res[k] for k in ("seeds", "splits")}
    assert res["machine"] == machine() and check_machine(tmp_path, True, {}) == machine()  # resumed on the same kind
    with pytest.raises(SystemExit, match="trained with --set {}"):
        check_machine(tmp_path, True, {"turns_per_rollout": 32})  # another recipe's models: not mixed in
    (tmp_path / "run.json").write_text(json.dumps({"machine": "Intel Xeon (family 6 model 143, avx512, 2 cores)", "grpo_overrides": {}}))
    with pytest.raises(SystemExit, match=r"its outcomes come from Intel Xeon .* this machine is "):
        check_machine(tmp_path, True, {})  # another kind's SFT model and seeds: not resumed here
    (tmp_path / "run.json").unlink()
    with pytest.raises(SystemExit, match="an unrecorded processor kind"):
        check_machine(tmp_path, True, {})


def test_nucleus_keeps_the_smallest_set_holding_top_p_of_the_mass():
    import torch

    from evoharness.agent.policies.batched import nucleus

    probs = torch.tensor([[0.05, 0.5, 0.3, 0.15], [0.9, 0.04, 0.03, 0.03]], dtype=torch.float64)
    out = nucleus(probs, 0.9)
    assert out.tolist() == [[0.0, 0.5, 0.3, 0.15], [0.9, 0.0, 0.0, 0.0]]  # 0.5 + 0.3 < 0.9, so 0.15 stays; 0.9 alone is enough
    assert nucleus(probs, 1.0).tolist() == probs.tolist()


def test_sampling_bench_reports_avg_at_k_with_its_interval_across_seeds():
    from sampling_eval import summarize as sampling, table

    games = [f"g{i}" for i in range(10)]
    out = {("m", "valid_seen", "greedy"): {g: int(i < 5) for i, g in enumerate(games)}}
    for s, w in ((0, 3), (1, 4), (2, 5)):
        out[("m", "valid_seen", f"s{s}")] = {g: int(i < w) for i, g in enumerate(games)}
    r = sampling(out, ["m"], ["valid_seen"], [0, 1, 2])["models"]["m"]["valid_seen"]
    assert r["greedy"] == 50.0 and r["sampled_per_seed"] == [30.0, 40.0, 50.0] and r["avg"] == 40.0
    assert r["ci95"] == [round(40 - 4.303 * 10 / 3 ** 0.5, 2), round(40 + 4.303 * 10 / 3 ** 0.5, 2)]
    assert "avg@3" in table({"seeds": [0, 1, 2], "models": {"m": {"valid_seen": r}}})


def test_the_main_job_model_counts_as_its_seed_only_while_it_is_what_dvc_lock_recorded(tmp_path):
    """``--main-job-model``: the seed comes from dvc.lock's grpo stage, and a model folder changed since (DVC re-hashes
    it) or not named by the stage is refused, on a real DVC repository."""
    from grpo_seeds import main_job_seed

    from evoharness.ops.vcs import dvc, git

    git(["init", "-q"], tmp_path)
    dvc(["init", "-q"], tmp_path)
    (tmp_path / "params.yaml").write_text("seed: 7\n")
    (tmp_path / "dvc.yaml").write_text("stages:\n  grpo:\n    cmd: python -c \"import pathlib; p = pathlib.Path('data/models/grpo'); "
                                       "p.mkdir(parents=True, exist_ok=True); (p / 'weights').write_text('w')\"\n"
                                       "    params: [seed]\n    outs: [data/models/grpo]\n")
    dvc(["repro", "-q"], tmp_path)
    assert main_job_seed(Path("data/models/grpo"), tmp_path) == 7
    with pytest.raises(SystemExit, match="does not name it with a seed"):
        main_job_seed(Path("data/models/grpo-other"), tmp_path)
    (tmp_path / "data" / "models" / "grpo" / "weights").write_text("trained again since")
    with pytest.raises(SystemExit, match="its outputs differ from dvc.lock's grpo stage"):
        main_job_seed(Path("data/models/grpo"), tmp_path)
