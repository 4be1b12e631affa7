"""The promotion gate on a real MLflow SQLite store (migrated once per session, copied per test):
registration, aliases, decisions with their reasons as version tags, the report, the listing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from evoharness import promotion, tracking
from evoharness.errors import EvoError
from evoharness.promotion import Thresholds, decide

T = Thresholds(min_seen=0.5, min_unseen=0.4, tolerance=0.05)


def _summary(seen: float, unseen: float) -> dict:
    def split(x):
        return {"Pick": {"success": x}, "Heat": {"success": x / 2}, "all": {"success": x, "steps": 10.0, "invalid_rate": 0.1,
                                                                         "calls": {"track": 1.0, "commit": 2.0, "recall": 1.0, "note": 1.0}}}
    return {"valid_seen": split(seen), "valid_unseen": split(unseen)}


def test_decide_checks_thresholds_then_regression_against_the_champion():
    d = decide({"valid_seen": 0.6, "valid_unseen": 0.5}, None, T)
    assert d.promoted and [c.name for c in d.checks] == ["seen_success", "unseen_success"] and "no champion yet" in d.reasons[0]
    d = decide({"valid_seen": 0.45, "valid_unseen": 0.5}, None, T)
    assert not d.promoted and d.reasons == ["seen success 45.0% is below the threshold 50.0%"]
    d = decide({"valid_seen": 0.6, "valid_unseen": 0.44}, {"valid_seen": 0.6, "valid_unseen": 0.5}, T)
    assert not d.promoted and len(d.checks) == 4
    assert d.reasons == ["unseen success 44.0% regresses more than 5.0% below the champion's 50.0%"]
    # exactly at the tolerance is not a regression; exactly at a threshold passes
    d = decide({"valid_seen": 0.5, "valid_unseen": 0.45}, {"valid_seen": 0.55, "valid_unseen": 0.5}, T)
    assert d.promoted, d.reasons


def _model(tmp_path: Path, i: int) -> Path:
    d = tmp_path / f"model{i}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "i": i}))
    (d / "model.safetensors").write_bytes(os.urandom(256))
    (d / "experience.json").write_text("{}")
    return d


CURVE = [{"update": u, "success": 0.1 * u, "diversity_weight": 1 - 0.1 * u, "invalid_rate": 0.5 - 0.1 * u,
          "calls_per_episode": {"track": 3 - u, "commit": 2.5, "recall": 1, "note": 2 - 0.5 * u}} for u in range(4)]


def test_gate_registers_promotes_and_never_moves_the_champion_on_a_rejection(mlflow_store, tmp_path):
    c = tracking.client(tmp_path)
    exp = tracking.experiment_id(c, tmp_path)
    name = "agent-test"

    def candidate(i, seen, unseen, md5=None):
        run = c.create_run(exp, run_name=f"promote-{i}")
        return run.info.run_id, promotion.gate(c, name, run.info.run_id, _model(tmp_path, i) if md5 is None else tmp_path / f"model{md5}",
                                               f"md5-{md5 or i}", _summary(seen, unseen), T, CURVE, tmp_path / f"report{i}")

    def champion():
        return str(c.get_model_version_by_alias(name, "champion").version)

    _, d1 = candidate(1, 0.6, 0.5)
    assert d1.promoted and d1.version == "1" and champion() == "1"

    r2, d2 = candidate(2, 0.3, 0.5)  # misses the seen threshold
    assert not d2.promoted and champion() == "1" and str(c.get_model_version_by_alias(name, "challenger").version) == "2"
    tags = c.get_model_version(name, "2").tags
    assert tags["decision"] == "rejected" and "seen success 30.0% is below the threshold 50.0%" in tags["decision.reasons"]
    assert tags["check.seen_success"].endswith("FAIL") and tags["check.unseen_success"].endswith("pass")
    assert tags["decision.champion_before"] == "1" and tags["dvc_md5"] == "md5-2"

    _, d3 = candidate(3, 0.62, 0.42)  # above both thresholds, but unseen regresses past the tolerance
    assert not d3.promoted and champion() == "1"
    assert "regresses" in c.get_model_version(name, "3").tags["decision.reasons"]

    _, d4 = candidate(4, 0.7, 0.55)
    assert d4.promoted and champion() == "4"

    _, again = candidate(5, 0.1, 0.1, md5=4)  # the same model (same DVC hash) again: nothing new is decided
    assert again.reused and again.version == "4" and again.promoted
    assert len(c.search_model_versions(f"name='{name}'")) == 4 and champion() == "4"

    md = (tmp_path / "report2" / "promotion.md").read_text()
    assert "REJECTED" in md and "| valid_seen | champion |" in md and "![annealing](annealing.png)" in md
    assert (tmp_path / "report2" / "annealing.png").read_bytes()[:4] == b"\x89PNG"
    logged = {a.path for a in c.list_artifacts(r2, "promotion")}
    assert {"promotion/promotion.md", "promotion/annealing.png", "promotion/decision.json"} <= logged
    assert {a.path for a in c.list_artifacts(r2, "model")} >= {"model/config.json", "model/model.safetensors"}

    rows = promotion.promotions(c, "agent-")
    assert [r["version"] for r in rows] == [4, 3, 2, 1]
    assert rows[0]["aliases"] == "challenger,champion" and rows[1]["aliases"] == "" and rows[3]["decision"] == "promoted"

    out = subprocess.run([sys.executable, "-m", "evoharness.cli", "promotions", "--model", "agent-"], cwd=tmp_path,
                         capture_output=True, text=True, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "rejected" in lines[2] and "regresses" in lines[2] and "champion" in lines[1]


def test_params_promotion_section_is_validated(tmp_path):
    p = tmp_path / "params.yaml"
    p.write_text("promotion:\n  thresholds:\n    tiny-cpu: {min_seen: 1.5, min_unseen: 0}\n")
    with pytest.raises(EvoError, match=r"promotion.thresholds.tiny-cpu.min_seen: .*1.5"):
        promotion.load_promotion(p, "tiny-cpu")
    p.write_text("promotion:\n  thresholds:\n    other: {min_seen: 0.5, min_unseen: 0.4}\n")
    with pytest.raises(EvoError, match="no entry for profile 'tiny-cpu'"):
        promotion.load_promotion(p, "tiny-cpu")
    pp, t = promotion.load_promotion(Path(__file__).resolve().parents[1] / "params.yaml", "tiny-cpu")
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
