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

import json
import random
import threading
import time
from collections import Counter
from pathlib import Path

from evoharness.alfworld.games import Game, list_games
from evoharness.envpool import EnvPool
from evoharness.episode import EpisodeConfig, Privileged, TurnView, run_episode
from evoharness.errors import EvoError
from evoharness.harness.consolidate import consolidate
from evoharness.harness.experience import Experience
from evoharness.harness.workspace import META_VERBS, HarnessConfig
from evoharness.reward import RewardConfig, diversity_weight
from evoharness.training.profiles import Profile


class RecordingPolicy:
    """Samples with the live weights and keeps each turn's token ids and logprobs."""

    name = "grpo-rollout"

    def __init__(self, sampler, seed: int):
        self.sampler, self.seed = sampler, seed
        self.turns: list = []

    def fingerprint(self) -> str:
        return f"grpo:{self.seed}"

    def reset(self, seed: int) -> None:
        self.turns = []

    def act(self, prompt: str, view: TurnView, privileged: Privileged) -> str:
        s = self.sampler(prompt, seed=self.seed * 1000 + len(self.turns), view=view)
        self.turns.append(s)
        return s.text


def group_blocks(prompts: list[str], num_generations: int) -> list[str]:
    """The games of a batch, in order: TRL repeats each prompt in a contiguous block (or passes it once)."""
    games, i = [], 0
    while i < len(prompts):
        j = i
        while j < len(prompts) and prompts[j] == prompts[i] and j - i < num_generations:
            j += 1
        games.append(prompts[i])
        i = j
    return games


class Rollouts:
    """The ``rollout_func``: plays the groups and returns TRL's rows plus the episode rewards."""

    def __init__(self, games: dict[str, Game], profile: Profile, bank: Experience, pool: EnvPool, tok, out_dir: Path, reward: RewardConfig,
                 seed: int = 0, curve: Path | None = None):
        self.games, self.profile, self.bank, self.pool, self.tok = games, profile, bank, pool, tok
        self.out_dir, self.reward, self.seed = Path(out_dir), reward, seed
        self.curve = Path(curve) if curve else self.out_dir / "curve.jsonl"
        self.lock = threading.Lock()
        self.calls = 0

    def __call__(self, prompts: list[str], trainer) -> dict:
        from evoharness.policies.batched import BatchedGenerator

        g = self.profile.grpo
        n_gen = g.rollouts * g.turns_per_rollout
        model = trainer.accelerator.unwrap_model(trainer.model)
        was_training = model.training
        model.eval()
        if getattr(trainer, "use_vllm", False):
            from evoharness.policies.hf import VLLMServerSampler

            sampler = VLLMServerSampler(trainer.vllm_generation.vllm_client, self.tok, g.temperature, g.max_new_tokens, self.lock)
        else:
            sampler = BatchedGenerator(model, self.tok, True, g.temperature, g.max_new_tokens, self.profile.decoding == "constrained")
        u = int(trainer.state.global_step)
        cfg = EpisodeConfig(max_steps=g.max_steps_per_episode, harness=HarnessConfig(mode="inline", charge_meta_actions=g.charge_meta_actions),
                            reward=self.reward, update=u)
        blocks = group_blocks(list(prompts), n_gen)
        for gid in blocks:
            if gid not in self.games:
                raise EvoError(f"grpo: prompt {gid!r} is not a training game id")
        jobs = [(gid, r) for gid in blocks for r in range(g.rollouts)]

        def play(worker, job):
            gid, r = job
            seed = hash((self.seed, self.calls, gid, r)) % (2**31)
            pol = RecordingPolicy(sampler, seed)
            traj = run_episode(worker, self.games[gid], pol, cfg, self.bank, seed)
            return traj, pol.turns

        results = self.pool.map(play, jobs)
        model.train(was_training)
        self.calls += 1
        rows = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [], "episode_reward": [], "episode_won": []}
        rng = random.Random(f"{self.seed}/{u}/{self.calls}")
        for (traj, turns) in results:
            r = float(traj.reward["total"])
            if not turns:  # an errored episode still fills its rows, with its (zero-success) reward
                continue
            for k in range(g.turns_per_rollout):
                s = turns[rng.randrange(len(turns))] if len(turns) < g.turns_per_rollout else turns[sorted(rng.sample(range(len(turns)), g.turns_per_rollout))[k]]
                rows["prompt_ids"].append(s.prompt_ids)
                rows["completion_ids"].append(s.completion_ids or [self.tok.eos_token_id])
                rows["logprobs"].append(s.logprobs or [0.0])
                rows["env_mask"].append(decision_mask(s.logprobs or [0.0]))
                rows["episode_reward"].append(r)
                rows["episode_won"].append(bool(traj.outcome["won"]))
        expected = len(blocks) * n_gen
        if len(rows["prompt_ids"]) != expected:
            raise EvoError(f"grpo: {expected - len(rows['prompt_ids'])} rows missing: every rollout errored before its first turn ({results[0][0].error})")
        trajs = [t.to_json() for t, _ in results]
        edits = consolidate(self.bank, trajs)  # between batches: the bank was frozen while they ran
        self.bank.save(self.out_dir / "experience.json")
        self._log(u, trajs, edits)
        return rows

    def _log(self, u: int, trajs: list[dict], edits: list[dict]) -> None:
        ok = [t for t in trajs if not t.get("error")]
        n = max(len(ok), 1)
        comps = ("success", "efficiency", "diversity", "repeats", "invalid", "total")
        turns = sum(t["outcome"]["turns"] for t in ok)
        rec = {
            "update": u,
            "episodes": len(trajs),
            "errored": len(trajs) - len(ok),
            "reward": {c: round(sum(t["reward"][c] for t in ok) / n, 4) for c in comps},
            "diversity_weight": round(diversity_weight(u, self.reward), 4),
            "success": round(sum(t["outcome"]["won"] for t in ok) / n, 4),
            "calls_per_episode": {v: round(sum(t["outcome"]["calls"][v] for t in ok) / n, 3) for v in META_VERBS},
            "invalid_rate": round(sum(t["outcome"]["invalid"] for t in ok) / max(turns, 1), 4),
            "episode_length": round(sum(t["outcome"]["steps"] for t in ok) / n, 2),
            "bank_edits": dict(Counter(e["op"] for e in edits if str(e.get("result", "")).startswith("applied"))),
        }
        with open(self.curve, "a") as f:
            f.write(json.dumps(rec) + "\n")


def decision_mask(logprobs: list[float]) -> list[int]:
    """TRL's ``env_mask`` for a completion: 0 where the token had probability 1 under the constrained
    distribution it was sampled from (log-probability exactly 0), 1 elsewhere. Such a token was forced
    by the constraint (the reply's ``<think>``, ``</think><action>``, the rest of a command once it is
    determined): no decision, so no advantage should flow through it, since pushing its unconstrained
    probability up or down only changes what the constraint overrides. (A free choice made with
    certainty in float32 is masked too; its gradient is zero anyway.)"""
    return [0 if lp == 0.0 else 1 for lp in logprobs]


def episode_reward(prompts, completions, episode_reward, **kwargs):
    """The composite cost-aware reward, computed by the episode engine at the episode's end."""
    return [float(r) for r in episode_reward]


def train_grpo(games_root: Path, sft_dir: Path, bank_path: Path | None, out_dir: Path, profile: Profile, reward: RewardConfig,
               seed: int = 0, workers: int = 2, steps: int | None = None, checkpoints: Path | None = None,
               curve: Path | None = None, timing: Path | None = None) -> dict:
    """Train and save the model and its evolved bank to ``out_dir``; the per-step curve goes to
    ``curve`` (a DVC plot), checkpoints to a folder that survives a kill."""
    import torch
    from datasets import Dataset

    from evoharness.training.sft import last_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    g = profile.grpo
    if not (Path(sft_dir) / "config.json").exists():
        raise EvoError(f"grpo: {sft_dir} is not a Hugging Face checkpoint (no config.json)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpts = Path(checkpoints) if checkpoints else out_dir.parent / f"{out_dir.name}-checkpoints"
    from evoharness.policies.hf import weights_digest
    from evoharness.training.sft import file_digest, keyed_checkpoints

    curve = Path(curve) if curve else out_dir.parent / f"{out_dir.name}-curve.jsonl"
    curve.parent.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, profile.sft.threads))
    games = {x.id: x for x in list_games(games_root, "train") if not x.error}
    if not games:
        raise EvoError(f"grpo: no training games under {games_root}")
    ckpts = keyed_checkpoints(ckpts, grpo=g.model_dump(exclude={"steps"}), sft=weights_digest(sft_dir), seed=seed, reward=reward,
                              bank=file_digest(Path(bank_path)) if bank_path else None, games=sorted(games))
    n_steps = steps if steps is not None else g.steps
    rng = random.Random(seed)
    ids = sorted(games)
    order = [rng.choice(ids) for _ in range(n_steps * g.games_per_step)]
    tok = AutoTokenizer.from_pretrained(sft_dir)
    model = AutoModelForCausalLM.from_pretrained(sft_dir, dtype=torch.bfloat16 if g.bf16 else torch.float32)
    bank = Experience.load_or_seed(bank_path)
    n_gen = g.rollouts * g.turns_per_rollout
    from evoharness.policies.hf import vllm_installed

    use_vllm = g.use_vllm and vllm_installed()
    if g.use_vllm and not use_vllm:
        print("grpo: use_vllm is set but vllm is not installed: rollouts generate with transformers", flush=True)
    cfg = GRPOConfig(
        output_dir=str(ckpts),
        num_generations=n_gen,
        per_device_train_batch_size=n_gen,
        gradient_accumulation_steps=g.games_per_step,
        steps_per_generation=g.games_per_step,
        max_steps=n_steps,
        learning_rate=g.learning_rate,
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
        use_vllm=use_vllm,
        vllm_mode=g.vllm_mode,
        use_cpu=not torch.cuda.is_available(),
        shuffle_dataset=False,
        disable_tqdm=True,
        log_completions=False,
    )
    with EnvPool(min(profile.episode_workers, g.games_per_step * g.rollouts)) as pool:
        resume = last_checkpoint(ckpts)
        if resume is None:
            curve.unlink(missing_ok=True)  # a fresh run: the curve restarts; a resumed run appends
        rollouts = Rollouts(games, profile, bank, pool, tok, out_dir, reward, seed, curve)
        trainer = GRPOTrainer(model=model, reward_funcs=[episode_reward], args=cfg, train_dataset=Dataset.from_dict({"prompt": order}),
                              processing_class=tok, rollout_func=rollouts)
        t0 = time.time()
        result = trainer.train(resume_from_checkpoint=resume)
        wall = time.time() - t0
    trainer.save_model(str(out_dir))
    tok.save_pretrained(str(out_dir))
    rows = [json.loads(x) for x in curve.read_text().splitlines()] if curve.exists() else []
    episodes = sum(c["episodes"] for c in rows)
    if timing:
        Path(timing).parent.mkdir(parents=True, exist_ok=True)
        Path(timing).write_text(json.dumps({"seconds": round(wall, 1), "episodes_per_min": round(60 * episodes / max(wall, 1e-6), 2)}))
    return {"steps": int(result.global_step), "episodes": episodes, "train_loss": round(float(result.training_loss), 4),
            "first": rows[0] if rows else None, "last": rows[-1] if rows else None, "resumed_from": Path(resume).name if resume else None}
