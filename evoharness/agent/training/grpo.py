"""Cost-aware GRPO with TRL's GRPOTrainer and its ``rollout_func``.

Why ``rollout_func`` and not ``environment_factory``: an ALFWorld episode is many turns, each with
its own standalone prompt built by ``build_prompt`` (the same bytes as SFT and evaluation), and
its reward is only known at the end. ``environment_factory`` exposes the environment as tools
inside one growing chat, which would change the prompt format; ``rollout_func`` lets the episode
engine and the environment workers play whole episodes with the live weights.

A group is ``rollouts`` episodes of the same game. From each episode ``turns_per_rollout`` turns are
drawn as training rows, all carrying the episode's reward, so a group holds
``rollouts × turns_per_rollout`` rows (GRPO's ``num_generations``); normalising advantages over the
group is normalising over its episodes. Only the tokens the policy chose carry the loss: those the
decoding constraint forced are masked (``env_mask``). Meta-actions are charged a step. The Experience bank is
read-only during a batch and consolidated between batches.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from pathlib import Path

from evoharness.agent.alfworld.games import list_games
from evoharness.agent.envpool import EnvPool
from evoharness.agent.harness.experience import Experience
from evoharness.agent.harness.workspace import HarnessConfig
from evoharness.agent.reward import RewardConfig
from evoharness.agent.training.grpo_rollouts import Rollouts
from evoharness.agent.training.grpo_trainer import colocated_engines_constrained, constrained_trainer_class
from evoharness.agent.training.profiles import Profile, rows_per_step
from evoharness.core import atomic
from evoharness.core.errors import EvoError


def episode_reward(prompts, completions, episode_reward, **kwargs):
    """The composite cost-aware reward, computed by the episode engine at the episode's end; None
    for the rows of a dropped group (an episode that errored even when played again)."""
    return [None if r is None else float(r) for r in episode_reward]


def _curve_rows(path: Path) -> list[str]:
    """The running curve's rows; a last line torn by a kill (appended, not yet whole) is left out, any
    other unreadable line is an error naming the file."""
    lines = [x for x in (path.read_text().splitlines() if path.exists() else []) if x.strip()]
    rows = []
    for i, x in enumerate(lines):
        try:
            json.loads(x)
        except ValueError:
            if i == len(lines) - 1:
                break
            raise EvoError(f"{path}: line {i + 1} is not a JSON row (the curve is corrupt; delete the checkpoints to start over)") from None
        rows.append(x)
    return rows


def train_grpo(games_root: Path, sft_dir: Path, bank_path: Path | None, out_dir: Path, profile: Profile, reward: RewardConfig,
               seed: int = 0, workers: int = 2, steps: int | None = None, checkpoints: Path | None = None,
               curve: Path | None = None, timing: Path | None = None, root: Path | None = None, order: list[str] | None = None,
               harness: HarnessConfig | None = None, consolidator: str = "rules") -> dict:
    """Train and save the model and its evolved bank to ``out_dir``; the per-step curve goes to
    ``curve`` (a DVC plot), checkpoints to a folder that survives a kill. With LoRA the adapter is
    trained on the SFT model and merged into it at the end (``<out>/adapter`` beside the full model).
    ``order``: the training games, slot by slot (default: drawn at random from every training game);
    ``harness``: the workspace the rollouts act through (default inline, all modules: the ablations
    switch a module off, plain GRPO uses env_only); ``consolidator``: who edits the bank between batches
    (``consolidate.make_consolidator``: rules, an OpenAI-compatible endpoint, a local model)."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from evoharness.agent.training import distributed as dist
    from evoharness.agent.training import shared_head
    from evoharness.agent.training.checkpoint import check_checkpoint, load_for_training, run_loss, weights_digest
    from evoharness.agent.training.sft import checkpoint_key, file_digest, keyed_checkpoints, last_checkpoint, save_trained

    g = profile.grpo
    root = Path(root or Path.cwd())
    sft_dir = check_checkpoint(Path(sft_dir), "grpo: SFT model")
    if bank_path is not None and not Path(bank_path).exists():
        raise EvoError(f"grpo: experience bank {bank_path} does not exist")
    out_dir = Path(out_dir)
    ckroot = Path(checkpoints) if checkpoints else out_dir.parent / f"{out_dir.name}-checkpoints"
    curve = Path(curve) if curve else out_dir.parent / f"{out_dir.name}-curve.jsonl"
    torch.set_num_threads(max(1, profile.sft.threads))
    games = {x.id: x for x in list_games(games_root, "train") if not x.error}
    if not games:
        raise EvoError(f"grpo: no training games under {games_root}")
    step = rows_per_step(profile)
    key_parts = dict(grpo=g.model_dump(exclude={"steps"}), sft=weights_digest(sft_dir), seed=seed, reward=reward, processes=profile.num_processes,
                     bank=file_digest(Path(bank_path)) if bank_path else None, games=sorted(games),
                     order=hashlib.sha256(json.dumps(order).encode()).hexdigest()[:12], harness=(harness or HarnessConfig()).model_dump(),
                     **({"consolidator": consolidator} if consolidator != "rules" else {}))
    ckpts = ckroot / checkpoint_key(**key_parts)
    n_steps = steps if steps is not None else g.steps
    if order is None:
        rng = random.Random(seed)
        ids = sorted(games)
        order = [rng.choice(ids) for _ in range(n_steps * g.games_per_step)]
    else:
        unknown = sorted(set(order) - set(games))
        if unknown or len(order) < n_steps * g.games_per_step:
            raise EvoError(f"grpo: the game order names {len(unknown)} unknown game(s) ({unknown[:2]}) or has fewer than "
                           f"{n_steps * g.games_per_step} slots ({len(order)})")
    harness = harness or HarnessConfig()
    cfg = dist.training_args(
        GRPOConfig, profile, root,
        output_dir=str(ckpts),
        num_generations=step["group_rows"],
        per_device_train_batch_size=step["micro_batch"],
        gradient_accumulation_steps=step["grad_accum"],
        steps_per_generation=step["grad_accum"],  # one generation per optimizer step: the step's games, once
        max_steps=n_steps,
        learning_rate=g.learning_rate,
        lr_scheduler_type=g.scheduler,
        beta=g.beta,
        scale_rewards=g.scale_rewards,
        temperature=g.temperature,
        max_completion_length=g.max_new_tokens,
        logging_steps=1,
        save_strategy="steps",
        save_steps=g.save_steps,
        save_total_limit=2,
        report_to=[],
        seed=seed,
        bf16=g.bf16,
        gradient_checkpointing=g.gradient_checkpointing,
        use_vllm=profile.generation == "vllm",
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=g.vllm_gpu_memory_utilization,
        vllm_max_model_length=g.vllm_max_model_length or None,
        shuffle_dataset=False,
        disable_tqdm=True,
        log_completions=False,
    )
    main = dist.is_main()
    if main:
        keyed_checkpoints(ckroot, **key_parts)
    dist.wait_for_everyone()
    resume = last_checkpoint(ckpts)
    banks = ckpts / "banks"
    bank = Experience.load_or_seed(bank_path)
    if resume is not None:  # the bank as it was when that checkpoint's last update had consolidated
        done = int(Path(resume).name.split("-")[-1])
        saved = banks / f"after-u{done - 1}.json"
        if saved.exists():
            bank = Experience.load(saved)
    # The curve grows beside the checkpoints (DVC removes the stage's outputs before a rerun, a kill
    # leaves rows past the last checkpoint): a resumed run keeps what its checkpoint covers, and the
    # output is written once, at the end.
    running_curve = ckpts / "curve.jsonl"
    if main:
        curve.parent.mkdir(parents=True, exist_ok=True)
        banks.mkdir(parents=True, exist_ok=True)
        kept = [] if resume is None else [x for x in _curve_rows(running_curve) if json.loads(x)["update"] < int(Path(resume).name.split("-")[-1])]
        atomic.write_text(running_curve, "".join(x + "\n" for x in kept))
    tok = AutoTokenizer.from_pretrained(sft_dir)
    model, loaded_partitioned, peft_config = load_for_training(sft_dir, profile.base.dtype, g.lora, g.lora_r, g.lora_alpha)
    with EnvPool(min(profile.episode_workers, step["games_per_process"] * g.rollouts)) as pool:
        from evoharness.agent.harness.consolidate import make_consolidator

        rollouts = Rollouts(games, profile, bank, pool, tok, out_dir, reward, seed, running_curve, banks if main else None, harness,
                            make_consolidator(consolidator) if main else None)
        # Constrained samples are scored under the constraint they were drawn with, from either backend.
        Trainer = constrained_trainer_class() if profile.decoding == "constrained" else GRPOTrainer
        with colocated_engines_constrained(profile):
            trainer = Trainer(model=model, reward_funcs=[episode_reward], args=cfg, train_dataset=Dataset.from_dict({"prompt": order}),
                              processing_class=tok, rollout_func=rollouts, peft_config=peft_config)
        trainer.constraint_budget = g.max_new_tokens
        if dist.single_process(profile) and not g.lora:  # the prompts' system text runs once per batch (shared_head's docstring)
            for m in (trainer.model, trainer.ref_model):
                if m is not None:
                    shared_head.install(m)
        t0 = time.time()
        result = trainer.train(resume_from_checkpoint=resume)
        wall = time.time() - t0
    save_trained(trainer, tok, sft_dir, out_dir, g.lora)
    if main:
        rollouts.bank.save(out_dir / "experience.json")
        atomic.write_text(curve, running_curve.read_text())
    dist.wait_for_everyone()
    rows = [json.loads(x) for x in curve.read_text().splitlines() if x.strip()] if curve.exists() else []
    episodes = sum(c["episodes"] for c in rows)
    if timing and main:
        Path(timing).parent.mkdir(parents=True, exist_ok=True)
        Path(timing).write_text(json.dumps({"seconds": round(wall, 1), "episodes_per_min": round(60 * episodes / max(wall, 1e-6), 2)}))
    slim = lambda r: {k: v for k, v in r.items() if k not in ("processes", "bank_digests")} if r else None  # noqa: E731
    return {"steps": int(result.global_step), "episodes": episodes, "train_loss": run_loss(trainer, result, resume is not None),
            "rows_per_step": step["rows"], "launch": dist.describe(trainer.accelerator, loaded_partitioned), "lora": g.lora,
            "first": slim(rows[0] if rows else None), "last": slim(rows[-1] if rows else None), "resumed_from": Path(resume).name if resume else None}
