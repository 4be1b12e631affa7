"""The GRPO check's own logic (bench/grpo_check.py): its pass rule, its windows, the games it picks,
and its refusal to mix parts made from other inputs. The check itself runs for real (README)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("grpo_check", ROOT / "bench" / "grpo_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_windows_and_the_pass_rule(check):
    rows = [{"success": s} for s in [0.25] * 5 + [0.5] * 5 + [0.625] * 5]
    w = check.windows(rows, 5, 16)
    assert [(u, p) for u, p, _ in w] == [(0, 0.25), (5, 0.5), (10, 0.625)]
    assert w[0][2] == pytest.approx((0.25 * 0.75 / 80) ** 0.5)  # 5 updates x 16 episodes
    flat = check.windows([{"success": 0.5}] * 15, 5, 16)
    assert check.verdict(w, flat)["pass"]  # +37.5 points, the control unmoved
    assert not check.verdict(w, flat, need=0.40)["pass"]
    short = check.windows(rows[:10] + [{"success": 0.54}] * 5, 5, 16)
    v = check.verdict(short, flat)
    assert v["rise"] == pytest.approx(0.29) and not v["pass"]  # 29 points is not 30
    drifting = check.windows([{"success": 0.3}] * 5 + [{"success": 0.5}] * 5 + [{"success": 0.6}] * 5, 5, 16)
    v = check.verdict(w, drifting)
    assert v["drift"] == pytest.approx(0.3) and v["drift"] > v["noise"] and not v["pass"]  # the control moved: no pass


def test_games_picked_have_a_signal_and_room_to_rise(check):
    wins = {"a": [0, 0, 0, 0], "b": [1, 1, 1, 1], "c": [1, 0, 0, 0], "d": [1, 1, 0, 0], "e": [0, 0, 0, 1], "f": [1, 1, 1, 0]}
    assert [d["game"] for d in check.choose(wins, 3, 0.25)] == ["c", "e", "d"]  # never 0/4 or 4/4; closest to 1/4, ties by id
    assert [d["game"] for d in check.choose(wins, 2, 0.75)] == ["f", "d"]
    with pytest.raises(SystemExit, match=r"only 4 training games .* \(need 5\); overall success 45.8%"):
        check.choose(wins, 5, 0.25)


def test_parts_made_from_other_inputs_are_refused_not_mixed(check, tmp_path):
    inputs = {"selection": {"sft": "w1", "rollouts": 4}, "runs": {"updates": 40, "lr": 2e-4}}
    out = tmp_path / "check"
    assert check.stale_parts(out, inputs, False, False) == []  # nothing there yet
    out.mkdir()
    (out / "selection").mkdir()
    (out / "grpo.jsonl").write_text("{}\n")
    (out / "inputs.json").write_text(json.dumps(inputs))
    assert check.stale_parts(out, inputs, False, False) == []  # the same inputs: everything reused
    other_runs = {**inputs, "runs": {"updates": 30, "lr": 2e-4}}
    with pytest.raises(SystemExit, match=r"whose runs had other inputs .* pass --rerun \(keeps the selection\) or --fresh"):
        check.stale_parts(out, other_runs, False, False)
    assert sorted(x.name for x in check.stale_parts(out, other_runs, False, True)) == ["grpo.jsonl"]  # --rerun keeps the selection
    other_sft = {**inputs, "selection": {"sft": "w2", "rollouts": 4}}
    with pytest.raises(SystemExit, match=r"whose selection had other inputs .* pass --fresh to replace it"):
        check.stale_parts(out, other_sft, False, False)
    with pytest.raises(SystemExit, match=r"holds no selection of these inputs"):
        check.stale_parts(out, other_sft, False, True)
    assert sorted(x.name for x in check.stale_parts(out, other_sft, True, False)) == ["grpo.jsonl", "inputs.json", "selection"]
    (out / "inputs.json").write_text("{not json")
    with pytest.raises(SystemExit, match=r"\(or unrecorded ones\)"):  # an unreadable stamp is not read as a match
        check.stale_parts(out, inputs, False, False)
    assert (out / "selection").is_dir() and (out / "grpo.jsonl").exists()  # a refusal removes nothing
