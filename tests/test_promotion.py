"""The promotion gate on a real MLflow SQLite store (migrated once per session, copied per test):
game-by-game comparisons, the checks and their reasons, fail-closed reading, completing an interrupted
decision, the reviewer's page, the listing."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from evoharness.ops import promotion, tracking
from evoharness.ops import decision
from evoharness.ops import evidence
from evoharness.core.errors import EvoError
from evoharness.ops.evidence import Evidence
from evoharness.ops.decision import Thresholds, decide
from evoharness.agent.training.checkpoint import weights_digest

ROOT = Path(__file__).resolve().parents[1]
T = Thresholds(min_seen=0.3, min_unseen=0.2, tolerance=0.05, max_errored=0.1, alpha=0.05, must_beat=["sft-inline", "random"])
COND = {"games": "g1", "splits": "valid_seen,valid_unseen", "seeds": "0", "max_steps": "30", "max_turns": "60", "mode": "inline",
        "charge_meta_actions": "false", "decoding": "constrained", "sampling": "False:1.0", "max_new_tokens": "32"}
N = 60  # games per split


def ev(label: str, seen_wins: int, unseen_wins: int, errored: int = 0, cond: dict | None = None, shift: int = 0) -> Evidence:
    """A model's evaluation on the same 60 + 60 games: the first ``wins`` games (rotated by ``shift``) won."""
    outcomes, summary = {}, {}
    for split, wins in (("valid_seen", seen_wins), ("valid_unseen", unseen_wins)):
        keys = [f"{split}/game{i:02d}#s0" for i in range(N)]
        won = {keys[(i + shift) % N] for i in range(wins)}
        outcomes[split] = {k: int(k in won) for k in keys}
        rate = wins / N
        summary[split] = {"Pick": {"success": rate}, "all": {"success": rate, "episodes": N, "wins": wins}}
    return Evidence(label, summary, outcomes, errored, dict(cond or COND))


def refs(sft=(12, 6), rnd=(0, 0), cond: dict | None = None) -> dict:
    scripted = {**(cond or COND), "decoding": "n/a", "sampling": "n/a", "max_new_tokens": "n/a"}  # the random policy decodes nothing
    return {"sft-inline": ev("sft-inline", *sft, cond=cond), "random": ev("random", *rnd, cond=scripted)}


def test_the_checks_thresholds_errors_baselines_champion_and_floor():
    d = decide(ev("c", 24, 15), None, refs(), {}, T)
    assert d.promoted and "there is no champion yet" in d.reasons[0]
    assert [c.name for c in d.checks] == ["seen_success", "unseen_success", "errored_episodes", "beats_sft-inline", "beats_random",
                                          "seen_vs_sft-inline", "unseen_vs_sft-inline"]
    d = decide(ev("c", 15, 15), None, refs(), {}, T)
    assert not d.promoted and d.reasons == ["seen success 25.0% is below the threshold 30.0%"]
    d = decide(ev("c", 24, 15, errored=13), None, refs(), {}, T)  # 13 of 120 errored: more than 10 %
    assert not d.promoted and d.reasons == ["13 of 120 episodes errored (10.8%), more than the limit 10.0%"]
    d = decide(ev("c", 24, 15), None, refs(sft=(30, 10)), {}, T)  # 39 wins against the SFT model's 40, 6 seen games lost
    assert not d.promoted and d.reasons == ["does not beat sft-inline on the same games (39 vs 40 wins of 120 games)",
                                            "seen success regresses against sft-inline (p = 0.016 < 0.05; McNemar exact, one-sided: sft-inline-only wins 6, candidate-only wins 0)"]
    # Split by split against its SFT parent: more wins pooled (26 + 24 against 20 + 28 of 120) does not hide 12
    # unseen games only the parent won against 8 only the candidate won; 4 more only-parent wins on one split is noise.
    d = decide(ev("c", 26, 24, shift=4), None, refs(sft=(20, 28)), {}, T)
    assert d.promoted, d.reasons
    d = decide(ev("c", 38, 14), None, refs(sft=(24, 28)), {}, T)  # 52 vs 52 is not more: fails beats as well
    assert not d.promoted and d.reasons[1].startswith("unseen success regresses against sft-inline (p = 0.000 < 0.05; McNemar exact")
    d = decide(ev("c", 40, 16), None, refs(sft=(12, 30)), {}, T)  # 56 against 42 pooled, 14 unseen games lost
    assert not d.promoted and [c.name for c in d.checks if not c.passed] == ["unseen_vs_sft-inline"]
    assert d.reasons == ["unseen success regresses against sft-inline (p = 0.000 < 0.05; McNemar exact, one-sided: sft-inline-only wins 14, candidate-only wins 0)"]
    with pytest.raises(EvoError, match="no evaluation of 'sft-inline'.*no_regression"):
        decide(ev("c", 24, 15), None, {"random": ev("random", 0, 0)}, {}, T.model_copy(update={"must_beat": ["random"]}))
    # Against the champion, game by game: 6 fewer wins on the same games is within noise, 12 is a regression.
    champ = ev("champ", 30, 15)
    assert decide(ev("c", 24, 15, shift=10), champ, refs(), {}, T).promoted  # 10 games only the champion won, 4 only the candidate
    d = decide(ev("c", 18, 15), champ, refs(), {}, T)
    assert not d.promoted and d.reasons[0].startswith("seen success regresses against the champion (p = 0.000 < 0.05; McNemar exact")
    # Other games, step limits or decoding: not compared, the difference named.
    d = decide(ev("c", 40, 30, cond={**COND, "max_steps": "50"}), champ, refs(cond={**COND, "max_steps": "50"}), {}, T)
    assert not d.promoted and "champion evaluated under other conditions: max_steps 30 (champion) vs 50" in d.reasons[0]
    # A baseline the candidate must beat shares its games, seeds, budgets and harness (and decoding, model to model),
    # or the gate decides nothing.
    with pytest.raises(EvoError, match=r"^promotion: sft-inline was evaluated under other conditions than the candidate \(max_steps 30 vs 50\)"):
        decide(ev("c", 40, 30, cond={**COND, "max_steps": "50"}), champ, refs(), {}, T)
    with pytest.raises(EvoError, match=r"sft-inline .* \(decoding greedy vs constrained\)"):
        decide(ev("c", 40, 30), None, refs(cond={**COND, "decoding": "greedy"}) | {"random": refs()["random"]}, {}, T)
    with pytest.raises(EvoError, match=r"random .* \(seeds 0,1 vs 0\)"):
        decide(ev("c", 40, 30), None, {**refs(), "random": ev("random", 0, 0, cond={**COND, "seeds": "0,1", "decoding": "n/a"})}, {}, T)
    # The main job's shape: the baselines stage plays the episode budget (50 steps, all games), the evaluate stage the
    # profile's eval budget (30 here): more steps and more games for the reference only make it harder to beat.
    roomy = {**refs()["random"].conditions, "max_steps": "50", "games": "another-hash"}
    bigger = ev("random", 0, 0, cond=roomy)
    for split in bigger.outcomes:
        bigger.outcomes[split][f"{split}/extra#s0"] = 1
    assert decide(ev("c", 40, 30), None, {**refs(), "random": bigger}, {}, T).promoted
    fewer = ev("random", 0, 0, cond=roomy)
    del fewer.outcomes["valid_unseen"]["valid_unseen/game03#s0"]
    with pytest.raises(EvoError, match=r"random .* \(1 valid_unseen game and seed pair\(s\) the candidate played, random did not \(e\.g\. valid_unseen/game03#s0\)\)"):
        decide(ev("c", 40, 30), None, {**refs(), "random": fewer}, {}, T)
    # The floor: never below the best champion so far minus the tolerance.
    d = decide(ev("c", 24, 15, shift=10), champ, refs(), {"valid_seen": 0.6, "valid_unseen": 0.25}, T)
    assert not d.promoted and d.reasons == ["seen success 40.0% is below the floor 55.0% (best champion so far 60.0% minus 5.0%)"]


def test_missing_or_nan_metrics_stop_the_gate():
    bad = ev("c", 24, 15)
    bad.summary["valid_unseen"]["all"]["success"] = math.nan
    with pytest.raises(EvoError, match=r"c's valid_unseen success is nan, not a rate"):
        decide(bad, None, refs(), {}, T)
    del bad.summary["valid_unseen"]["all"]
    with pytest.raises(EvoError, match=r"c has no valid_unseen success in its evaluation"):
        decide(bad, None, refs(), {}, T)
    with pytest.raises(EvoError, match=r"no evaluation of 'random' to compare the candidate with"):
        decide(ev("c", 24, 15), None, {"sft-inline": ev("s", 1, 1)}, {}, T)


def _model(tmp_path: Path, i: int) -> Path:
    d = tmp_path / f"model{i}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "i": i}))
    (d / "model.safetensors").write_bytes(os.urandom(256))
    (d / "experience.json").write_text("{}")
    return d


CURVE = [{"update": u, "success": 0.1 * u, "diversity_weight": 1 - 0.1 * u, "invalid_rate": 0.5 - 0.1 * u,
          "calls_per_episode": {"track": 3 - u, "commit": 2.5, "recall": 1, "note": 2 - 0.5 * u}} for u in range(4)]


class Faulty:
    """The real client, with one named call failing once: an MLflow outage at that moment."""

    def __init__(self, c, fail: str, exc: Exception):
        self._c, self._fail, self._exc = c, fail, exc

    def __getattr__(self, name):
        attr = getattr(self._c, name)
        if name == self._fail:
            def boom(*a, **k):
                self._fail = None
                raise self._exc
            return boom
        return attr


@pytest.fixture()
def store(mlflow_store, tmp_path):
    c = tracking.client(tmp_path)
    exp = tracking.experiment_id(c, tmp_path)
    name = "agent-test"

    def candidate(i, cand, client=None, md5=None, t=T, r=None):
        run = c.create_run(exp, run_name=f"promote-{i}")
        model = _model(tmp_path, i) if md5 is None else tmp_path / f"model{md5}"
        return promotion.gate(client or c, name, run.info.run_id, model, f"md5-{md5 or i}", cand, r or refs(), t, CURVE,
                              tmp_path / f"report{i}", model_digest=weights_digest(model))

    def champion():
        return str(c.get_model_version_by_alias(name, "champion").version)

    return c, name, candidate, champion


def test_gate_registers_promotes_and_never_moves_the_champion_on_a_rejection(store, tmp_path):
    c, name, candidate, champion = store
    d1 = candidate(1, ev("grpo-inline", 24, 15))
    assert d1.promoted and d1.version == "1" and champion() == "1"
    d2 = candidate(2, ev("grpo-inline", 12, 15))  # misses the seen threshold
    assert not d2.promoted and champion() == "1" and str(c.get_model_version_by_alias(name, "challenger").version) == "2"
    tags = c.get_model_version(name, "2").tags
    assert tags["decision"] == "rejected" and tags["decision.state"] == "complete" and "seen success 20.0% is below the threshold 30.0%" in tags["decision.reasons"]
    assert tags["check.seen_success"].endswith("FAIL") and tags["check.unseen_success"].endswith("pass")
    assert tags["decision.champion_before"] == "1" and tags["dvc_md5"] == "md5-2" and tags["cond.max_steps"] == "30" and tags["cond.decoding"] == "constrained"
    d3 = candidate(3, ev("grpo-inline", 30, 16))
    assert d3.promoted and champion() == "3"
    again = candidate(4, ev("grpo-inline", 0, 0), md5=3)  # the same model (same DVC hash) again: nothing new is decided
    assert again.reused and again.version == "3" and again.promoted
    assert len(c.search_model_versions(f"name='{name}'")) == 3 and champion() == "3"
    # The same model evaluated under other conditions (another step budget) is new evidence: a version and a decision
    # of its own, made against the champion, which was evaluated otherwise, so it is not promoted on it.
    other = candidate(5, ev("grpo-inline", 30, 16, cond={**COND, "max_steps": "40"}), md5=3,
                      r=refs(cond={**COND, "max_steps": "40"}))
    assert not other.reused and other.version == "4" and not other.promoted and champion() == "3"
    assert "other conditions" in " ".join(other.reasons), other.reasons
    tags4 = c.get_model_version(name, "4").tags
    assert tags4["dvc_md5"] == "md5-3" and tags4["cond.max_steps"] == "40" and tags4["decision.state"] == "complete"
    again = candidate(6, ev("grpo-inline", 30, 16, cond={**COND, "max_steps": "40"}), md5=3, r=refs(cond={**COND, "max_steps": "40"}))
    assert again.reused and again.version == "4"
    assert candidate(7, ev("grpo-inline", 0, 0), md5=3).version == "3"  # the first conditions still find their own decision
    # The reviewer's page is the version's description: decision, checks with values and thresholds, the table, the plot.
    desc = c.get_model_version(name, "2").description
    assert "REJECTED" in desc and "| seen_success | 0.200 | >= 0.300 | **FAIL** |" in desc and "| valid_seen | champion |" in desc
    assert "![annealing](get-artifact?path=promotion%2Fannealing.png&run_uuid=" in desc and "Evaluation conditions:" in desc
    run2 = c.get_model_version(name, "2").run_id
    logged = {a.path for a in c.list_artifacts(run2, "promotion")}
    assert {"promotion/promotion.md", "promotion/annealing.png", "promotion/decision.json", "promotion/evidence.json"} <= logged
    rows = promotion.promotions(c, "agent-")
    assert [r["version"] for r in rows] == [4, 3, 2, 1] and rows[0]["aliases"] == "challenger" and rows[1]["aliases"] == "champion"
    out = subprocess.run([sys.executable, "-m", "evoharness.cli", "promotions", "--model", "agent-"], cwd=tmp_path,
                         capture_output=True, text=True, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    assert "rejected" in out.stdout.splitlines()[1] and "champion" in out.stdout.splitlines()[2]


def test_a_hand_made_zero_percent_candidate_never_replaces_a_champion(store):
    """The tiny profile's own thresholds: a 0 % model fails them, and the baselines, whatever the champion."""
    c, name, candidate, champion = store
    _, tiny = decision.load_promotion(ROOT / "params.yaml", "tiny-cpu")
    assert candidate(1, ev("grpo-inline", 3, 1), t=tiny.model_copy(update={"min_seen": 0.05, "min_unseen": 0.0}),
                     r={"sft-inline": ev("s", 1, 0), "base-inline": ev("b", 0, 0), "random": ev("r", 0, 0)}).promoted  # 5.0 / 1.7
    assert champion() == "1"
    zero = candidate(2, ev("grpo-inline", 0, 0), t=tiny, r={"sft-inline": ev("s", 1, 0), "base-inline": ev("b", 0, 0), "random": ev("r", 0, 0)})
    assert not zero.promoted and champion() == "1"
    assert any("below the threshold" in r for r in zero.reasons) and any("does not beat random" in r for r in zero.reasons)
    assert tiny.min_seen > 0 and tiny.min_unseen > 0 and "random" in tiny.must_beat


def test_the_gate_fails_closed_and_leaves_the_champion_where_it_was(store):
    from mlflow.exceptions import MlflowException

    c, name, candidate, champion = store
    assert candidate(1, ev("grpo-inline", 24, 15)).promoted
    # An MLflow error while reading the champion is not "no champion".
    from mlflow.protos.databricks_pb2 import INTERNAL_ERROR

    broken = Faulty(c, "get_model_version_by_alias", MlflowException("database is locked", error_code=INTERNAL_ERROR))
    with pytest.raises(EvoError, match=r"cannot read agent-test's champion from MLflow \(MlflowException: database is locked\); nothing moved"):
        candidate(2, ev("grpo-inline", 40, 40), client=broken)
    assert champion() == "1" and len(c.search_model_versions(f"name='{name}'")) == 1
    # A champion without its evaluation tags cannot be compared with: stop, do not read it as "none".
    for k in [k for k in c.get_model_version(name, "1").tags if k.startswith(("eval.", "cond."))]:
        c.delete_model_version_tag(name, "1", k)
    with pytest.raises(EvoError, match=r"champion agent-test version 1 has no evaluation tags .*nothing moved"):
        candidate(3, ev("grpo-inline", 40, 40))
    assert champion() == "1"


def test_a_retried_gate_completes_the_decision_it_left_pending(store):
    c, name, candidate, champion = store
    broken = Faulty(c, "set_registered_model_alias", ConnectionError("the tracking server went away"))
    with pytest.raises(ConnectionError):
        candidate(1, ev("grpo-inline", 24, 15), client=broken)  # registered and tagged, no alias moved yet
    mv = c.search_model_versions(f"name='{name}'")[0]
    assert mv.tags["decision.state"] == "pending" and mv.tags["decision"] == "promoted"
    d = candidate(2, ev("grpo-inline", 24, 15), md5=1)  # the task's retry: same model, same hash
    assert not d.reused and d.promoted and d.version == "1" and champion() == "1"
    assert c.get_model_version(name, "1").tags["decision.state"] == "complete" and len(c.search_model_versions(f"name='{name}'")) == 1



def test_a_version_left_pending_just_after_its_creation_is_resumed_only_under_its_own_conditions(store):
    c, name, candidate, champion = store
    broken = Faulty(c, "set_model_version_tag", ConnectionError("the tracking server went away"))
    with pytest.raises(ConnectionError):
        candidate(1, ev("grpo-inline", 24, 15), client=broken)  # created, none of the decision's tags set
    (mv,) = c.search_model_versions(f"name='{name}'")
    assert mv.tags["decision.state"] == "pending" and "decision" not in mv.tags and mv.tags["cond.hash"]
    other = {**COND, "mode": "inline+evolve"}
    d = candidate(2, ev("grpo-inline", 24, 15, cond=other), md5=1, r=refs(cond=other))  # the same weights, evaluated otherwise
    assert d.version == "2" and c.get_model_version(name, "1").tags["decision.state"] == "pending"
    d = candidate(3, ev("grpo-inline", 24, 15), md5=1)  # the retry under the first conditions completes version 1
    assert d.version == "1" and not d.reused and c.get_model_version(name, "1").tags["decision.state"] == "complete"

def test_no_alias_moves_before_the_runs_git_record_exists(store, tmp_path):
    """The record is made between the decision and its aliases: a record that fails leaves the version
    pending and the champion where it was; the rerun completes the decision and the version names its record."""
    c, name, candidate, champion = store
    assert candidate(1, ev("grpo-inline", 24, 15)).promoted and champion() == "1"
    seen = []

    def failing(d):
        seen.append((d.version, d.word, c.get_model_version(name, d.version).tags["decision.state"]))
        raise EvoError("recording the run in git: the origin went away")

    run = c.create_run(tracking.experiment_id(c, tmp_path), run_name="promote-2")
    model = _model(tmp_path, 2)
    with pytest.raises(EvoError, match="the origin went away"):
        promotion.gate(c, name, run.info.run_id, model, "md5-2", ev("grpo-inline", 30, 16), refs(), T, CURVE,
                       tmp_path / "report2", model_digest=weights_digest(model), record=failing)
    assert seen == [("2", "promoted", "pending")]  # decided and tagged before the record was asked for
    assert champion() == "1" and str(c.get_model_version_by_alias(name, "challenger").version) == "1"
    assert c.get_model_version(name, "2").tags["decision.state"] == "pending" and "git_ref" not in c.get_model_version(name, "2").tags
    d = promotion.gate(c, name, run.info.run_id, model, "md5-2", ev("grpo-inline", 30, 16), refs(), T, CURVE,
                       tmp_path / "report2", model_digest=weights_digest(model), record=lambda d: "retrain/run-2")
    assert d.promoted and d.version == "2" and champion() == "2"
    tags = c.get_model_version(name, "2").tags
    assert tags["decision.state"] == "complete" and tags["git_ref"] == "retrain/run-2" and len(c.search_model_versions(f"name='{name}'")) == 2


def test_params_promotion_section_is_validated(tmp_path):
    p = tmp_path / "params.yaml"
    p.write_text("promotion:\n  thresholds:\n    tiny-cpu: {min_seen: 1.5, min_unseen: 0}\n")
    with pytest.raises(EvoError, match=r"promotion.thresholds.tiny-cpu.min_seen: .*1.5"):
        decision.load_promotion(p, "tiny-cpu")
    p.write_text("promotion:\n  thresholds:\n    other: {min_seen: 0.5, min_unseen: 0.4}\n")
    with pytest.raises(EvoError, match="no entry for profile 'tiny-cpu'"):
        decision.load_promotion(p, "tiny-cpu")
    pp, t = decision.load_promotion(ROOT / "params.yaml", "tiny-cpu")
    assert pp.model_name and t.tolerance >= 0


def test_an_unreachable_mlflow_server_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    with pytest.raises(EvoError, match=r"MLflow tracking server http://127.0.0.1:9 is unreachable"):
        tracking.client(tmp_path)
    out = subprocess.run([sys.executable, "-m", "evoharness.cli", "promotions"], cwd=tmp_path, capture_output=True, text=True,
                         env=dict(os.environ, MLFLOW_TRACKING_URI="http://127.0.0.1:9"))
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0
    assert out.stderr.startswith("error: MLflow tracking server http://127.0.0.1:9 is unreachable")


def test_no_secret_is_logged():
    flat = tracking.flatten({"chat": {"api_key": "sk-123", "base_url": "http://x"}, "hf_token": "t", "lr": 0.1})
    assert flat == {"chat.base_url": "http://x", "lr": 0.1}


def test_two_projects_in_one_process_each_log_to_their_own_store(mlflow_template, tmp_path, monkeypatch):
    """Opening a project's store must not leak into the environment: MLflow's own set_tracking_uri
    writes MLFLOW_TRACKING_URI, which made the next project in the process log into the first one's."""
    import shutil

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    ids = {}
    for name in ("a", "b"):
        root = tmp_path / name
        root.mkdir()
        shutil.copy(mlflow_template, root / tracking.DB_NAME)
        c = tracking.client(root)
        assert c.tracking_uri == f"sqlite:///{root.resolve() / tracking.DB_NAME}"
        ids[name] = c.create_run(tracking.experiment_id(c, root), tags={"kind": name}).info.run_id
        assert "MLFLOW_TRACKING_URI" not in os.environ
    for name in ("a", "b"):
        c = tracking.client(tmp_path / name)
        runs = c.search_runs([tracking.experiment_id(c, tmp_path / name)], "")
        assert [r.info.run_id for r in runs] == [ids[name]]


def test_evidence_mixed_with_another_evaluations_episodes_is_refused(tmp_path):
    """evaluate() keeps earlier runs' records after its own in episodes.jsonl: the gate reads an evaluation
    only when the file holds exactly the episodes its results.json played, one per game and seed."""
    d = tmp_path / "valid_seen"
    d.mkdir()
    res = {"policy": "hf:m", "policy_fingerprint": "hf:v3:abc:False:1.0:32:constrained", "split": ["valid_seen"], "seeds": [0], "games": 2,
           "episode_config": {"max_steps": 40, "max_turns": 80, "harness": {"mode": "inline", "charge_meta_actions": False}},
           "summary": {"all": {"success": 0.5, "episodes": 2, "wins": 1}}}
    (d / "results.json").write_text(json.dumps(res))
    own = [{"game_id": f"valid_seen/g{i}", "seed": 0, "fingerprint": f"new{i}", "outcome": {"won": i == 0}} for i in range(2)]
    (d / "episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in own))
    e = evidence.evidence_from_dirs("m", {"valid_seen": d}, "md5")
    assert e.outcomes["valid_seen"] == {"valid_seen/g0#s0": 1, "valid_seen/g1#s0": 0}
    other = {"game_id": "valid_seen/g1", "seed": 0, "fingerprint": "old1", "outcome": {"won": True}}  # another model's episode
    (d / "episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in own + [other]))
    with pytest.raises(EvoError, match=r"holds 3 episodes \(2 distinct game and seed pairs\) where .*results.json played 2"):
        evidence.evidence_from_dirs("m", {"valid_seen": d}, "md5")


def test_a_champion_moved_by_another_retrain_is_never_overwritten_by_a_decision_made_against_the_old_one(store, tmp_path):
    """Two retrains (two checkouts sharing the registry) both compare with 'no champion'; the first to finish
    promotes. The second's alias move is a compare-and-set: refused in one line, its decision left pending, and
    its rerun decides again against the champion of now."""
    c, name, candidate, champion = store
    exp = tracking.experiment_id(c, tmp_path)
    ds = []
    for i, (seen, unseen) in ((1, (24, 15)), (2, (30, 16))):
        run = c.create_run(exp, run_name=f"promote-{i}")
        m = _model(tmp_path, i)
        ds.append(promotion.register(c, name, run.info.run_id, m, f"md5-{i}", ev("grpo-inline", seen, unseen),
                                     refs(), T, CURVE, tmp_path / f"report{i}", model_digest=weights_digest(m)))
    assert [d.champion_version for d in ds] == [None, None] and all(d.promoted for d in ds)
    promotion.finalize(c, name, ds[0], "retrain/run-1")
    assert champion() == "1"
    with pytest.raises(EvoError, match=r"agent-test's champion is version 1 now, but version 2 was compared with version none "
                                       r"\(another retrain promoted in the meantime\); nothing moved, the decision stays pending"):
        promotion.finalize(c, name, ds[1], "retrain/run-2")
    assert champion() == "1" and c.get_model_version(name, "2").tags["decision.state"] == "pending"
    assert str(c.get_model_version_by_alias(name, "challenger").version) == "1"
    # The rerun (same model, same hash): decided again, against version 1, which it beats.
    d = candidate(3, ev("grpo-inline", 30, 16), md5=2)
    assert d.version == "2" and d.champion_version == "1" and d.promoted and champion() == "2"
    assert c.get_model_version(name, "2").tags["decision.champion_before"] == "1"
    # A later candidate is compared with the new champion.
    run = c.create_run(exp, run_name="promote-4")
    m4 = _model(tmp_path, 4)
    d4 = promotion.register(c, name, run.info.run_id, m4, "md5-4", ev("grpo-inline", 28, 16), refs(), T, CURVE, tmp_path / "report4",
                            model_digest=weights_digest(m4))
    assert d4.champion_version == "2"


def test_a_summary_that_contradicts_its_episodes_or_a_candidate_without_a_digest_is_refused(store, tmp_path):
    """The thresholds read results.json's summary and the paired tests read episodes.jsonl: the gate takes them
    only when they are one evaluation; and only evidence bound to the weights (their digest) promotes anything."""
    d = tmp_path / "valid_seen"
    d.mkdir()
    res = {"policy": "hf:m", "policy_fingerprint": "hf:v3:abc:False:1.0:32:constrained", "split": ["valid_seen"], "seeds": [0], "games": 2,
           "episode_config": {"max_steps": 40, "max_turns": 80, "harness": {"mode": "inline", "charge_meta_actions": False}},
           "summary": {"all": {"success": 1.0, "episodes": 2, "wins": 2}}}  # the summary claims both won
    (d / "results.json").write_text(json.dumps(res))
    (d / "episodes.jsonl").write_text("".join(json.dumps({"game_id": f"valid_seen/g{i}", "seed": 0, "outcome": {"won": i == 0}}) + "\n" for i in range(2)))
    with pytest.raises(EvoError, match=r"results.json says 2 wins of 2 \(success 1.0\) but .*episodes.jsonl holds 1 wins of 2: the evidence contradicts itself"):
        evidence.evidence_from_dirs("m", {"valid_seen": d}, "md5")
    c, name, _candidate, _champion = store
    run = c.create_run(tracking.experiment_id(c, tmp_path), run_name="promote-nodigest")
    with pytest.raises(EvoError, match=r"names no model_digest, so nothing binds it to .*model7"):
        promotion.register(c, name, run.info.run_id, _model(tmp_path, 7), "md5-7", ev("grpo-inline", 30, 16), refs(), T, CURVE, tmp_path / "r7")
    assert not c.search_model_versions(f"name='{name}'")  # nothing registered


def test_weights_left_on_the_remote_are_bound_to_the_evidence_by_their_dvc_hash(store, tmp_path):
    """A pool retrain's scheduler never holds the weights: the version is registered on dvc.lock's hashes (the model
    evaluate read is the candidate), with a DVC pointer for its model artifact; another hash, or none, registers nothing."""
    import yaml

    c, name, _candidate, _champion = store
    run = c.create_run(tracking.experiment_id(c, tmp_path), run_name="promote-remote")
    for evaluated in ("md5-other", None):
        with pytest.raises(EvoError, match=r"the evaluation read model .* but the candidate is md5-9 \(dvc.lock\); re-run evaluate"):
            promotion.register(c, name, run.info.run_id, None, "md5-9", ev("grpo-inline", 30, 16), refs(), T, CURVE, tmp_path / "r9",
                               model_digest="d9", evaluated_md5=evaluated)
    assert not c.search_model_versions(f"name='{name}' and tag.dvc_md5='md5-9'")
    d = promotion.register(c, name, run.info.run_id, None, "md5-9", ev("grpo-inline", 30, 16), refs(), T, CURVE, tmp_path / "r9",
                           model_digest="d9", evaluated_md5="md5-9")
    mv = c.get_model_version(name, d.version)
    assert mv.tags["dvc_md5"] == "md5-9" and mv.tags["weights_in_mlflow"] == "false"
    assert [a.path for a in c.list_artifacts(run.info.run_id, "model")] == ["model/dvc-pointer.yaml"]
    pointer = yaml.safe_load(open(c.download_artifacts(run.info.run_id, "model/dvc-pointer.yaml", str(tmp_path))))
    assert pointer == {"path": "data/models/grpo", "md5": "md5-9", "model_digest": "d9", "restore": pointer["restore"]}
