"""What the project's vLLM engines need: the decoding constraint inside the engine, and on a CPU weights that
TRL's per-update sync can reach.

The constraint: ``constrain.ActionConstraint``, the same token-level grammar the model's own decoder and the
GRPO trainer apply, as a vLLM logits processor.

A regular expression would count characters: vLLM may then spell an admissible command with tokens the
grammar never allows (``desk`` as ``d``, ``esk``), and the trainer, which replays the grammar on the
sampled tokens, would score those at minus infinity. With this processor both backends sample from one
distribution, and vLLM's processed log-probs (``logprobs_mode="processed_logprobs"``, what TRL's colocate
mode asks for) are the trainer's. Imported only where vLLM is installed; an engine takes the class as
``LLM(logits_processors=[ConstraintLogitsProcessor])`` and a request names its constraint in
``SamplingParams.extra_args[KEY]``.

The weights: vLLM's CPU backend repacks each linear layer's weight for its GEMM kernels and frees the
original, so TRL's colocate sync (``model.load_weights`` every update) fails on it ("Attempted to load
weight into parameter (torch.Size([0]))"). ``reloadable_weights`` makes an engine built inside it keep plain
weights on the CPU, which the sync then reaches. GPUs keep their weights: nothing changes there.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from evoharness.agent.policies.constrain import ActionConstraint

KEY = "evoharness_constraint"  # extra_args[KEY] = [admissible, verbs, after, budget]


class ConstraintLogitsProcessor(AdapterLogitsProcessor):
    """Masks, for each constrained request, every token its ``ActionConstraint`` does not allow after the
    tokens it has written so far (the tokenizer is the engine's own)."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        super().__init__(vllm_config, device, is_pin_memory)
        from transformers import AutoTokenizer

        mc = vllm_config.model_config
        self.tok = AutoTokenizer.from_pretrained(mc.tokenizer, revision=mc.tokenizer_revision)
        self._cache: dict[tuple, ActionConstraint] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it changes which token is most likely: greedy decoding must apply it too

    def new_req_logits_processor(self, params):
        spec = (params.extra_args or {}).get(KEY)
        if spec is None:
            return None
        admissible, verbs, after, budget = tuple(spec[0]), tuple(spec[1]), str(spec[2]), int(spec[3])
        key = (admissible, verbs, after, budget)
        c = self._cache.get(key)
        if c is None:
            if len(self._cache) > 4096:
                self._cache.clear()
            c = self._cache[key] = ActionConstraint(self.tok, admissible, verbs, budget, after)
        if not c.active:
            return None

        def apply(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            allowed = c.mask(list(output_ids)).to(logits.device)
            n = min(allowed.numel(), logits.shape[-1])
            keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
            keep[:n] = allowed[:n]  # rows past the tokenizer (a padded vocabulary) are never allowed
            return logits.masked_fill(~keep, float("-inf"))

        return apply


@contextmanager
def reloadable_weights(device: str):
    """While an engine is built on the CPU: its linear layers compute with ``torch.nn.functional.linear`` on
    the weights they hold instead of a repacked copy, so that loading new weights later changes what it
    computes. A no-op for a CUDA engine."""
    if device != "cpu":
        yield
        return
    from vllm.model_executor.layers import utils

    packed = utils.dispatch_cpu_unquantized_gemm

    def plain(layer, remove_weight: bool) -> None:
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    utils.dispatch_cpu_unquantized_gemm = plain
    try:
        yield
    finally:
        utils.dispatch_cpu_unquantized_gemm = packed
