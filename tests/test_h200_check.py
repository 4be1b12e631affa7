"""bench/h200_check.py, the GPU box's check, at toy size on CPU: it runs without the project's other
dependencies (the GPU image has torch, transformers, accelerate and peft), prints each figure as it is
measured, and counts LoRA's model FLOPs the standard way."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "h200_check.py"

# Run the script with pydantic and the project's other packages unimportable (yaml stays: huggingface_hub needs it).
BLOCKED = ("pydantic", "pydantic_core", "mlflow", "prefect", "dvc", "great_expectations", "alfworld", "textworld", "trl")
RUNNER = ("import runpy, sys\n"
          f"for m in {BLOCKED!r}: sys.modules[m] = None\n"
          "sys.argv = ['h200_check.py'] + sys.argv[1:]\n"
          f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n")


def load():
    spec = importlib.util.spec_from_file_location("h200_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_runs_tiny_with_only_the_gpu_images_packages(tmp_path):
    out = tmp_path / "h200.json"
    r = subprocess.run([sys.executable, "-c", RUNNER, "--tiny", "--out", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    keys = [ln.split("  ")[0] for ln in lines]
    # printed in the order measured, SFT before the rollouts, every figure present
    assert keys.index("SFT tokens/s") < keys.index("rollout replies/s (hf)") < keys.index("wall s")
    assert any(k.startswith("SFT MFU") for k in keys) and any(k.startswith("SFT HFU") for k in keys)
    got = json.loads(out.read_text())
    assert got["sft"]["tokens_per_s"] > 0 and got["generation"]["replies_per_s"] > 0 and got["generation"]["new_tokens"] > 0
    assert got["sft"]["hfu"] >= got["sft"]["mfu"] > 0
    if importlib.util.find_spec("vllm") is None:
        assert got["vllm"] is None and "vllm is not installed" in r.stdout
    else:
        assert got["vllm"]["replies_per_s"] > 0, got["vllm"]


def test_lora_flops_are_the_standard_count():
    m = load()
    n, t, layers, d = 7_000_000_000, 4096, 36, 4096
    model, hardware = m.lora_flops(n, t, layers, d)
    attn_fwd = 2 * layers * t * t * d  # causal: half of QK^T and AV's 4·T²·d per layer
    assert model == 4 * n * t + 3 * attn_fwd  # forward 2NT + backward through the activations 2NT; attention forward + backward
    assert hardware == 6 * n * t + 4 * attn_fwd  # plus gradient checkpointing's second forward
    # the old count (6NT + 3·L·T²·d) read recompute as model work: about 1.35x too high for the 8B at 4,096 tokens
    old = 6 * n * t + 6 * layers * t * t * d / 2
    assert 1.3 < old / model < 1.45
