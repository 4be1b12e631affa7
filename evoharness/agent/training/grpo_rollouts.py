"""GRPO's rollouts: each batch's groups (``rollouts`` episodes of one game) played on the real engine with the live
weights, their turns drawn as training rows carrying the episode's reward, the Experience bank consolidated between
batches (on the main process only), and on vLLM the check that the engine holds the trained weights after each sync."""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

from evoharness.agent.alfworld.games import Game
from evoharness.agent.chat_format import render
from evoharness.agent.envpool import EnvPool
from evoharness.agent.episode import EpisodeConfig, Privileged, TurnView, bank_digest, run_episode
from evoharness.agent.harness.consolidate import consolidate
from evoharness.agent.harness.experience import Experience
from evoharness.agent.harness.workspace import META_VERBS, HarnessConfig
from evoharness.agent.policies.batched import constraint_spec
from evoharness.agent.reward import RewardConfig, diversity_weight
from evoharness.agent.training.grpo_trainer import decision_mask, engine_gap, policy_logps
from evoharness.agent.training.profiles import Profile, rows_per_step
from evoharness.core.errors import EvoError


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
        s.constraint = constraint_spec(view)  # what the trainer re-applies to score it
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


def stable_seed(*parts) -> int:
    """A seed from its parts, the same in every process and run (Python's ``hash`` of a string is
    salted per process)."""
    return int(hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:8], 16) % (2**31)


class Rollouts:
    """The ``rollout_func``: plays this process's groups and returns TRL's rows plus the episode
    rewards. Under ``accelerate launch`` each process receives its own share of the step's games
    (whole groups: ``profiles.rows_per_step``); generation runs on parameters gathered for it (or
    on the process's own vLLM engine), so no process waits on another while episodes run. After the
    batch the trajectories of every process go to the main one, which consolidates the bank once
    and sends it back: every process starts the next batch with the same bank."""

    REPLAYS = 1  # an errored episode is played again this many times; a group still errored is dropped

    def __init__(self, games: dict[str, Game], profile: Profile, bank: Experience, pool: EnvPool, tok, out_dir: Path, reward: RewardConfig,
                 seed: int = 0, curve: Path | None = None, banks: Path | None = None, harness: HarnessConfig | None = None, consolidator=None):
        self.games, self.profile, self.bank, self.pool, self.tok = games, profile, bank, pool, tok
        self.consolidator = consolidator  # None: rules; else an endpoint (``consolidate.make_consolidator``)
        self.harness = (harness or HarnessConfig()).model_copy(update={"charge_meta_actions": profile.grpo.charge_meta_actions})
        self.out_dir, self.reward, self.seed = Path(out_dir), reward, seed
        self.curve = Path(curve) if curve else self.out_dir / "curve.jsonl"
        self.banks = Path(banks) if banks else None  # the bank after each update, for a resumed run
        self.calls = 0
        self.sync_gap: float | None = None  # the last weight-sync check's gap (generation: vllm)

    @contextmanager
    def generator(self, trainer):
        """The sampler this batch's episodes share, on the live weights."""
        from evoharness.agent.policies.batched import BatchedGenerator, VLLMGenerator

        g, constrained = self.profile.grpo, self.profile.decoding == "constrained"
        if self.profile.generation == "vllm":  # TRL's colocated engine, weights synced before this call
            yield VLLMGenerator(trainer.vllm_generation.llm, self.tok, True, g.temperature, g.max_new_tokens, constrained)
            return
        from trl.models.utils import unwrap_model_for_generation

        with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator, gather_deepspeed3_params=True) as model:
            was_training = model.training
            model.eval()
            try:
                yield BatchedGenerator(model, self.tok, True, g.temperature, g.max_new_tokens, constrained)
            finally:
                model.train(was_training)

    def __call__(self, prompts: list[str], trainer) -> dict:
        from accelerate.utils import broadcast_object_list, gather_object

        g = self.profile.grpo
        step = rows_per_step(self.profile)
        n_gen = step["group_rows"]
        acc = trainer.accelerator
        rank = acc.process_index
        u = int(trainer.state.global_step)
        cfg = EpisodeConfig(max_steps=g.max_steps_per_episode, harness=self.harness, reward=self.reward, update=u)
        blocks = group_blocks(list(prompts), n_gen)
        for gid in blocks:
            if gid not in self.games:
                raise EvoError(f"grpo: prompt {gid!r} is not a training game id")
        if len(blocks) != step["games_per_process"] or len(prompts) != step["rows_per_process"]:
            raise EvoError(f"grpo: process {rank} got {len(blocks)} games in {len(prompts)} rows, expected {step['games_per_process']} in "
                           f"{step['rows_per_process']} (profiles.rows_per_step)")
        first_slot = rank * step["games_per_process"]  # the step's games in order, whichever process plays them

        def play(worker, job):
            k, gid, r, attempt = job
            seed = stable_seed(self.seed, u, first_slot + k, r, attempt)
            pol = RecordingPolicy(sampler, seed)
            traj = run_episode(worker, self.games[gid], pol, cfg, self.bank if self.harness.mode != "env_only" else None, seed)
            return traj, pol.turns

        if self.profile.generation == "vllm":
            self.sync_gap = self.check_engine(trainer)
        jobs = [(k, gid, r, 0) for k, gid in enumerate(blocks) for r in range(g.rollouts)]
        with self.generator(trainer) as sampler:
            results = self.pool.map(play, jobs, around=sampler.session)
            for attempt in range(1, self.REPLAYS + 1):  # an errored reset or worker: play that episode again
                again = [i for i, (t, _) in enumerate(results) if t.error]
                if not again:
                    break
                for i, res in zip(again, self.pool.map(play, [(*jobs[i][:3], attempt) for i in again], around=sampler.session)):
                    results[i] = res
        self.calls += 1
        rows = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [], "episode_reward": [], "episode_won": [], "constraint": []}
        constrained = self.profile.decoding == "constrained"
        rng = random.Random(f"{self.seed}/{u}/{rank}")
        dropped = []
        for k, gid in enumerate(blocks):
            group = results[k * g.rollouts : (k + 1) * g.rollouts]
            ok = not any(t.error or not turns for t, turns in group)
            if not ok:
                dropped.append(gid)
            for traj, turns in group:
                r = float(traj.reward["total"]) if ok else None  # None: TRL leaves the row out of the baseline, advantage 0
                for s in self._rows(turns, g.turns_per_rollout, rng):
                    rows["prompt_ids"].append(s.prompt_ids)
                    rows["completion_ids"].append(s.completion_ids or [self.tok.eos_token_id])
                    rows["logprobs"].append(s.logprobs or [0.0])
                    rows["env_mask"].append(decision_mask(s.logprobs or [0.0]) if ok else [0] * len(s.completion_ids or [0]))
                    rows["episode_reward"].append(r)
                    rows["episode_won"].append(bool(traj.outcome.get("won")))
                    rows["constraint"].append(getattr(s, "constraint", None) if constrained and s.completion_ids else None)
        if len(rows["prompt_ids"]) != len(prompts):
            raise EvoError(f"grpo: process {rank} built {len(rows['prompt_ids'])} rows for {len(prompts)} prompts")
        trajs = [t.to_json() for t, _ in results]
        mine = {"rank": rank, "games": blocks, "rows": len(prompts), "dropped": dropped,
                "group_rewards": [rows["episode_reward"][k * n_gen : (k + 1) * n_gen] for k in range(len(blocks))]}
        everyone = gather_object([{"trajs": trajs, **mine}])
        if acc.is_main_process:
            all_trajs = [t for part in everyone for t in part["trajs"]]
            edits = consolidate(self.bank, all_trajs, self.consolidator, lambda m: print(f"grpo update {u}: {m}", flush=True))  # between batches
            shared = [self.bank.to_json()]
        else:
            all_trajs, edits, shared = [], [], [None]
        shared = broadcast_object_list(shared, from_process=0)
        if not acc.is_main_process:
            self.bank = Experience.from_json(shared[0])
        digests = gather_object([bank_digest(self.bank)])
        if acc.is_main_process:
            if self.banks is not None:
                self.bank.save(self.banks / f"after-u{u}.json")
            self._log(u, all_trajs, edits, [{k: v for k, v in part.items() if k != "trajs"} for part in everyone], digests)
        return rows

    SYNC_TOLERANCE = 0.05  # nats, mean over the probe's tokens: bf16 kernels differ by about 7e-4 on the toy, other weights by far more

    def check_engine(self, trainer) -> float:
        """After TRL synced the weights into this process's vLLM engine: the engine's log-probs for a fixed
        probe (prompt and reply) against the trained policy's (LoRA unmerged, gathered under ZeRO-3). Every
        process checks its own engine; all stop with one line if any engine is off (an engine whose weights
        were never loaded, or were dropped by sleep mode and not loaded again). Returns the largest gap,
        which the curve records. Updates smaller than bf16's rounding cannot be seen this way."""
        from accelerate.utils import gather_object
        from trl.models.utils import unwrap_model_for_generation

        prompt = render(self.tok, "OBJECTIVE: put a clean mug in the coffeemachine.\nADMISSIBLE COMMANDS: go to countertop 1 | look")
        ids = self.tok(prompt, add_special_tokens=False)["input_ids"]
        reply = self.tok("<think>The mug may be on the countertop.</think>\n<action>go to countertop 1</action>", add_special_tokens=False)["input_ids"]
        gap = engine_gap(trainer.vllm_generation.llm, ids, reply, lambda x: policy_logps(trainer, x, len(reply), unwrap_model_for_generation))
        gaps = gather_object([gap])
        worst = max(gaps)
        if not worst <= self.SYNC_TOLERANCE:  # NaN fails too
            raise EvoError(f"grpo: update {int(trainer.state.global_step)}: the vLLM engine disagrees with the trained policy on the probe "
                           f"(mean |log p gap| {worst:.3g} > {self.SYNC_TOLERANCE} nats, per process {[round(x, 4) for x in gaps]}): the weights "
                           "TRL synced into vLLM are not the trained ones")
        return worst

    @staticmethod
    def _rows(turns: list, k: int, rng: random.Random) -> list:
        """``k`` of an episode's turns as training rows (with repeats when it had fewer), or k empty
        placeholders for an episode that errored before its first turn (masked out)."""
        from evoharness.agent.policies.batched import Sample

        if not turns:
            return [Sample("", [0], [], []) for _ in range(k)]
        if len(turns) < k:
            return [turns[rng.randrange(len(turns))] for _ in range(k)]
        return [turns[i] for i in sorted(rng.sample(range(len(turns)), k))]

    def _log(self, u: int, trajs: list[dict], edits: list[dict], processes: list[dict], digests: list[str]) -> None:
        ok = [t for t in trajs if not t.get("error")]
        n = max(len(ok), 1)
        comps = ("success", "efficiency", "diversity", "repeats", "invalid", "total")
        turns = sum(t["outcome"]["turns"] for t in ok)
        rec = {
            "update": u,
            "episodes": len(trajs),
            "errored": len(trajs) - len(ok),
            "dropped_groups": sum(len(p["dropped"]) for p in processes),
            "reward": {c: round(sum(t["reward"][c] for t in ok) / n, 4) for c in comps},
            "diversity_weight": round(diversity_weight(u, self.reward), 4),
            "success": round(sum(t["outcome"]["won"] for t in ok) / n, 4),
            "calls_per_episode": {v: round(sum(t["outcome"]["calls"][v] for t in ok) / n, 3) for v in META_VERBS},
            "invalid_rate": round(sum(t["outcome"]["invalid"] for t in ok) / max(turns, 1), 4),
            "episode_length": round(sum(t["outcome"]["steps"] for t in ok) / n, 2),
            "bank_edits": dict(Counter(e["op"] for e in edits if str(e.get("result", "")).startswith("applied"))),
            "bank_replies_refused": sum(e.get("op") == "none" for e in edits),
            "bank_updates": self.bank.updates,
            **({"engine_sync_gap": round(self.sync_gap, 6)} if self.sync_gap is not None else {}),
            "bank_digests": digests,
            "processes": processes,
        }
        with open(self.curve, "a") as f:
            f.write(json.dumps(rec) + "\n")
