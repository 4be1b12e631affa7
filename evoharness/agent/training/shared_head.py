"""Training forwards that encode the rows' shared head once per batch.

Every prompt of the tiny profile begins with the same system text (about 147 of 380 tokens), so a
training batch of 16 rows runs those tokens through the model 16 times. ``install(model)`` makes the
model's backbone run them once: the head as a batch of one (with gradients), its keys and values
broadcast to every row, then each row's own tokens on top of them. Gradients of the head sum over
the rows through the broadcast, so it is the same function and the same gradient as the plain
forward up to float rounding (``tests/test_training.py`` compares losses and gradients).

It engages only on the training path: a call with ``input_ids``, no cache (``use_cache=False``, as
TRL's SFT and GRPO losses and ``constrained_logps`` call it), no positions, at least two rows that
share ``MIN_SHARED`` or more leading real tokens. Left padding (GRPO's prompts) is moved behind the
head for the forward and the hidden states come back in the caller's own layout. Generation, a
single row and anything else go through the backbone unchanged. ``applies(model)`` restricts it to
a plain single-process ``Qwen3ForCausalLM`` (no PEFT, no DeepSpeed, no gradient checkpointing)."""

from __future__ import annotations

import types

MIN_SHARED = 16


def applies(model) -> bool:
    from evoharness.agent.policies.fastdecode import supports

    checkpointing = getattr(model, "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else
                            "is_gradient_checkpointing", False)
    return supports(model) and not checkpointing and not hasattr(model, "hf_device_map")


def install(model) -> bool:
    """Route the backbone's training forwards through the shared head; False (nothing changed) where
    it does not apply. Idempotent; never saved with the model (an instance attribute)."""
    if not applies(model):
        return False
    backbone = model.model
    if getattr(backbone, "_shared_head_installed", False):
        return True
    original = backbone.forward

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None, use_cache=None,
                **kwargs):
        if (use_cache is False and past_key_values is None and inputs_embeds is None and position_ids is None and input_ids is not None
                and input_ids.dim() == 2 and input_ids.size(0) > 1 and not kwargs.get("output_hidden_states")
                and not kwargs.get("output_attentions")):
            out = shared_forward(original, self.config, input_ids, attention_mask, **kwargs)
            if out is not None:
                return out
        return original(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
                        inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)

    backbone.forward = types.MethodType(forward, backbone)
    backbone._shared_head_installed = True
    return True


def head_length(input_ids, mask, starts) -> int:
    """How many real tokens every row shares from its first real one, leaving each row at least one
    of its own; 0 when fewer than ``MIN_SHARED``."""
    import torch

    lengths = mask.sum(-1)
    probe = int(lengths.min()) - 1
    if probe < MIN_SHARED:
        return 0
    cols = starts[:, None] + torch.arange(probe, device=input_ids.device)[None, :]
    aligned = input_ids.gather(1, cols)
    same = (aligned == aligned[:1]).all(0)
    # every row's first ``probe`` columns from its start are real: padding is only before or after them
    if not bool(mask.gather(1, cols).all()):
        return 0
    h = int(same.long().cumprod(0).sum())
    return h if h >= MIN_SHARED else 0


def shared_forward(backbone_forward, config, input_ids, attention_mask, **kwargs):
    """The backbone's output for the batch, the head encoded once; None when the rows share too little
    (the caller then runs the plain forward)."""
    import torch
    from transformers import DynamicCache
    from transformers.modeling_outputs import BaseModelOutputWithPast

    b, width = input_ids.shape
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.to(input_ids.dtype)
    if mask.dim() != 2:
        return None
    # rows hold one contiguous run of real tokens: [left padding | tokens | right padding]
    real = mask.bool()
    starts = (mask.cumsum(-1) == 0).sum(-1)
    ends = starts + mask.sum(-1)
    runs = torch.arange(width, device=input_ids.device)[None, :]
    if not bool(((runs >= starts[:, None]) & (runs < ends[:, None]) == real).all()):
        return None
    h = head_length(input_ids, mask, starts)
    if not h:
        return None
    head = input_ids[0, int(starts[0]) : int(starts[0]) + h]
    # The forward's layout: [head | each row's left padding | its tokens after the head | right padding]. A row's
    # columns from start + h on keep their own index; its left padding moves behind the head.
    j = torch.arange(width - h, device=input_ids.device)[None, :].expand(b, -1)
    src = torch.where(j < starts[:, None], j, j + h)
    rest_ids = input_ids.gather(1, src)
    rest_mask = mask.gather(1, src)
    full_mask = torch.cat([mask.new_ones((b, h)), rest_mask], 1)
    position_ids = h + (rest_mask.cumsum(-1) - 1).clamp(min=0)
    head_out = backbone_forward(input_ids=head[None], use_cache=True, **kwargs)
    cache = DynamicCache(config=config)
    for li, layer in enumerate(head_out.past_key_values.layers):
        cache.update(layer.keys.expand(b, -1, -1, -1), layer.values.expand(b, -1, -1, -1), li)
    rest = backbone_forward(input_ids=rest_ids, attention_mask=full_mask, position_ids=position_ids, past_key_values=cache, use_cache=True,
                            **kwargs)
    laid = torch.cat([head_out.last_hidden_state.expand(b, -1, -1), rest.last_hidden_state], 1)
    # back to the caller's layout: left padding (h + col), the head (col - start), the rest (col)
    col = torch.arange(width, device=input_ids.device)[None, :].expand(b, -1)
    back = torch.where(col < starts[:, None], col + h, torch.where(col < starts[:, None] + h, col - starts[:, None], col))
    hidden = laid.gather(1, back[..., None].expand(-1, -1, laid.size(-1)))
    return BaseModelOutputWithPast(last_hidden_state=hidden)
