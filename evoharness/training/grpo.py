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
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

from evoharness import atomic
from evoharness.alfworld.games import Game, list_games
from evoharness.chat_format import render
from evoharness.envpool import EnvPool
from evoharness.episode import EpisodeConfig, Privileged, TurnView, bank_digest, run_episode
from evoharness.errors import EvoError
from evoharness.harness.consolidate import consolidate
from evoharness.harness.experience import Experience
from evoharness.harness.workspace import META_VERBS, HarnessConfig
from evoharness.reward import RewardConfig, diversity_weight
from evoharness.policies.batched import constraint_spec
from evoharness.training.profiles import Profile, rows_per_step


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
        from evoharness.policies.batched import BatchedGenerator, VLLMGenerator

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
        gap = engine_gap(trainer.vllm_generation.llm, ids, reply, lambda x: _policy_logps(trainer, x, len(reply), unwrap_model_for_generation))
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
        from evoharness.policies.batched import Sample

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


def constraint_masks(tok, completions: list[list[int]], specs: list, budget: int, width: int, vocab: int):
    """Per row and completion position, the tokens the decoding constraint allowed there (the same
    ``ActionConstraint`` the sampler used, replayed on the row's own prefix): a (rows, width, vocab)
    bool tensor, all True for an unconstrained row and past a row's end."""
    import torch

    from evoharness.policies.constrain import ActionConstraint

    masks = torch.ones((len(completions), width, vocab), dtype=torch.bool)
    cache: dict = {}
    for i, (comp, spec) in enumerate(zip(completions, specs)):
        if spec is None:
            continue
        key = (tuple(spec[0]), tuple(spec[1]), spec[2] if len(spec) > 2 else "")
        c = cache.get(key) or cache.setdefault(key, ActionConstraint(tok, key[0], key[1], budget, key[2]))
        if not c.active:
            continue
        for j in range(min(len(comp), width)):
            masks[i, j] = c.mask(list(comp[:j]))
    return masks


def constrained_logps(model, input_ids, attention_mask, logits_to_keep: int, masks, temperature: float, batch_size: int | None = None,
                      compute_entropy: bool = False):
    """Log-probabilities (and entropies) of the completion tokens under the distribution the rollouts
    sampled from: the model's logits over temperature, renormalised over the tokens the constraint
    allowed. The loss then moves probability only among moves the policy can make."""
    import torch

    bs = batch_size or input_ids.size(0)
    logps, ents = [], []
    for start in range(0, input_ids.size(0), bs):
        ids, am = input_ids[start : start + bs], attention_mask[start : start + bs]
        # the model projects only the positions scored (the prompt's logits were most of the head's cost)
        logits = model(input_ids=ids, attention_mask=am, logits_to_keep=logits_to_keep + 1, use_cache=False).logits[:, :-1, :].float() / temperature
        m = masks[start : start + bs].to(logits.device)[..., : logits.size(-1)]
        logp = torch.log_softmax(logits.masked_fill(~m, float("-inf")), dim=-1)
        logps.append(logp.gather(-1, ids[:, -logits_to_keep:].unsqueeze(-1)).squeeze(-1))
        if compute_entropy:
            ents.append(-(logp.exp() * logp.masked_fill(~m, 0.0)).sum(-1))
    return torch.cat(logps), (torch.cat(ents) if compute_entropy else None)


@contextmanager
def colocated_engines_constrained(profile: Profile):
    """While the trainer is built: TRL's colocate mode makes each process's vLLM engine itself
    (``trl.generation.vllm_generation.LLM``) and takes no logits processors, so for that while the name
    makes engines with the project's constraint (``vllm_engine``), in the profile's dtype, eager on CPU, with
    weights TRL's sync can reload."""
    if profile.generation != "vllm":
        yield
        return
    import trl.generation.vllm_generation as vg

    from evoharness.policies.vllm_engine import ConstraintLogitsProcessor, reloadable_weights

    made = vg.LLM

    def engine(*args, **kwargs):
        kwargs.setdefault("logits_processors", [ConstraintLogitsProcessor])
        kwargs.setdefault("dtype", profile.base.dtype)
        if profile.device == "cpu":
            kwargs.setdefault("enforce_eager", True)  # no graph compile on a CPU
        return made(*args, **kwargs)

    vg.LLM = engine
    try:
        with reloadable_weights(profile.device):  # the sync after every update must reach what the engine computes with
            yield
    finally:
        vg.LLM = made


def _constrained_trainer_class():
    from trl import GRPOTrainer

    class ConstrainedGRPOTrainer(GRPOTrainer):
        """TRL's GRPOTrainer, scoring completions with the log-probabilities of the distribution the
        rollouts were sampled from (``constrained_logps``), for the policy, the old policy and the
        reference alike; rows without a constraint are scored as TRL scores them."""

        constraint_budget = 512

        def _generate(self, prompts):
            out = super()._generate(prompts)
            specs = out[5].get("constraint")
            comps = out[1]
            self._masks = None
            if specs and any(x is not None for x in specs):
                width = max(len(c) for c in comps)
                self._masks = constraint_masks(self.processing_class, comps, specs, self.constraint_budget, width, len(self.processing_class))
            self._active = self._masks
            return out

        def _generate_and_score_completions(self, inputs):
            self._masks = self._active = None
            try:
                out = super()._generate_and_score_completions(inputs)
            finally:
                self._active = None
            if self._masks is not None:
                out["constraint_mask"] = self._masks
            return out

        def _compute_loss(self, model, inputs):
            self._active = inputs.get("constraint_mask")
            try:
                return super()._compute_loss(model, inputs)
            finally:
                self._active = None

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
                                               compute_aux_loss=False, **kwargs):
            masks = getattr(self, "_active", None)
            if masks is None or masks.size(0) != input_ids.size(0) or compute_aux_loss or any(v is not None for v in kwargs.values()):
                return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy,
                                                                  compute_aux_loss, **kwargs)
            if masks.size(1) < logits_to_keep:  # completions padded wider than their longest row
                import torch

                masks = torch.cat([masks, masks.new_ones((masks.size(0), logits_to_keep - masks.size(1), masks.size(2)))], 1)
            with self.accelerator.autocast():
                logps, ents = constrained_logps(model, input_ids, attention_mask, logits_to_keep, masks[:, :logits_to_keep], self.temperature,
                                                batch_size, compute_entropy)
            return logps, ents, None

    return ConstrainedGRPOTrainer


def decision_mask(logprobs: list[float]) -> list[int]:
    """TRL's ``env_mask`` for a completion: 0 where the token had probability 1 under the constrained
    distribution it was sampled from (log-probability exactly 0), 1 elsewhere. Such a token was forced
    by the constraint (the reply's ``<think>``, ``</think><action>``, the rest of a command once it is
    determined): no decision, so no advantage should flow through it, since pushing its unconstrained
    probability up or down only changes what the constraint overrides. (A free choice made with
    certainty in float32 is masked too; its gradient is zero anyway.)"""
    return [0 if lp == 0.0 else 1 for lp in logprobs]


def engine_gap(llm, prompt_ids: list[int], reply_ids: list[int], policy_logps) -> float:
    """Mean absolute difference between a vLLM engine's log-probs of ``reply_ids`` after ``prompt_ids``
    (its prompt log-probs: the raw model, no sampling processors) and ``policy_logps(ids)``, the trained
    policy's for the same tokens."""
    import torch
    from vllm import SamplingParams

    ids = list(prompt_ids) + list(reply_ids)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0), use_tqdm=False)[0]
    eng = torch.tensor([float(step[t].logprob) for t, step in zip(ids[len(prompt_ids):], out.prompt_logprobs[len(prompt_ids):])])
    mine = policy_logps(ids).float().cpu()
    return float((eng - mine).abs().mean())


def _policy_logps(trainer, ids: list[int], n: int, unwrap):
    """The trained policy's log-probs of the last ``n`` of ``ids`` (every process takes part: under ZeRO-3
    the weights are gathered for it)."""
    import torch

    with unwrap(trainer.model_wrapped, trainer.accelerator, gather_deepspeed3_params=True) as model:
        x = torch.tensor([ids], device=trainer.accelerator.device)
        with torch.no_grad():
            logits = model(input_ids=x, use_cache=False).logits[0, -n - 1 : -1].float()
        return torch.log_softmax(logits, -1).gather(-1, x[0, -n:].unsqueeze(-1)).squeeze(-1)


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

    from evoharness.training import distributed as dist
    from evoharness.training import shared_head
    from evoharness.training.checkpoint import check_checkpoint, load_for_training, weights_digest
    from evoharness.training.sft import checkpoint_key, file_digest, keyed_checkpoints, last_checkpoint, save_trained

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
        from evoharness.harness.consolidate import make_consolidator

        rollouts = Rollouts(games, profile, bank, pool, tok, out_dir, reward, seed, running_curve, banks if main else None, harness,
                            make_consolidator(consolidator) if main else None)
        # Constrained samples are scored under the constraint they were drawn with, from either backend.
        Trainer = _constrained_trainer_class() if profile.decoding == "constrained" else GRPOTrainer
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
    return {"steps": int(result.global_step), "episodes": episodes, "train_loss": round(float(result.training_loss), 4),
            "rows_per_step": step["rows"], "launch": dist.describe(trainer.accelerator, loaded_partitioned), "lora": g.lora,
            "first": slim(rows[0] if rows else None), "last": slim(rows[-1] if rows else None), "resumed_from": Path(resume).name if resume else None}
