"""GRPO scores what it sampled: the trainer (a small subclass of TRL's GRPOTrainer) replays each row's decoding
constraint and computes the policy's, the old policy's and the reference's log-probabilities over the allowed tokens
only; colocated vLLM engines get the same constraint as a logits processor."""

from __future__ import annotations

from contextlib import contextmanager

from evoharness.agent.training.profiles import Profile


def constraint_masks(tok, completions: list[list[int]], specs: list, budget: int, width: int, vocab: int):
    """Per row and completion position, the tokens the decoding constraint allowed there (the same
    ``ActionConstraint`` the sampler used, replayed on the row's own prefix): a (rows, width, vocab)
    bool tensor, all True for an unconstrained row and past a row's end."""
    import torch

    from evoharness.agent.policies.constrain import ActionConstraint

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

    from evoharness.agent.policies.vllm_engine import ConstraintLogitsProcessor, reloadable_weights

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


def constrained_trainer_class():
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


def policy_logps(trainer, ids: list[int], n: int, unwrap):
    """The trained policy's log-probs of the last ``n`` of ``ids`` (every process takes part: under ZeRO-3
    the weights are gathered for it)."""
    import torch

    with unwrap(trainer.model_wrapped, trainer.accelerator, gather_deepspeed3_params=True) as model:
        x = torch.tensor([ids], device=trainer.accelerator.device)
        with torch.no_grad():
            logits = model(input_ids=x, use_cache=False).logits[0, -n - 1 : -1].float()
        return torch.log_softmax(logits, -1).gather(-1, x[0, -n:].unsqueeze(-1)).squeeze(-1)
