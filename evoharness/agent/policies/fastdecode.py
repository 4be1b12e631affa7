"""One decoding step of a Qwen3 model without transformers' per-call machinery.

On CPU a small model's decoding step is almost all fixed cost: for the tiny profile (2 layers, width
96) transformers spends about 5 ms per step on mask building, cache concatenation (the whole KV is
copied every step) and module dispatch, for a few hundred microseconds of arithmetic. ``Qwen3Step``
runs the same arithmetic on the model's own parameters (read live, never copied: under GRPO they are
the weights being trained, and under ZeRO-3 those gathered for generation) with a KV buffer
allocated once per batch. The prompt itself is still prefilled by the model's own forward.

It is the same function as the model's forward up to float rounding (``tests/test_fastdecode.py``
compares logits and greedy tokens against transformers'); ``supports(model)`` says when it applies:
a plain ``Qwen3ForCausalLM`` with full attention and default RoPE. Anything else (a PEFT wrapper,
another architecture, sliding windows) decodes through transformers as before.
"""

from __future__ import annotations

import torch


def supports(model) -> bool:
    cfg = getattr(model, "config", None)
    if type(model).__name__ != "Qwen3ForCausalLM" or cfg is None:
        return False
    rope = getattr(cfg, "rope_parameters", None) or {}
    return (
        rope.get("rope_type", "default") == "default"
        and not getattr(cfg, "use_sliding_window", False)
        and all(t == "full_attention" for t in (getattr(cfg, "layer_types", None) or ["full_attention"]))
        and not getattr(cfg, "attention_bias", False)
        and getattr(cfg, "hidden_act", "silu") == "silu"
    )


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return w * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Qwen3Step:
    """KV buffers for one batch and ``step(tokens)``: the next-token logits of every live row.

    ``start(past, attention_mask, last_pos, extra)`` takes the prefill's cache (transformers'
    ``DynamicCache``) into buffers with room for ``extra`` more tokens; ``keep(rows)`` drops finished
    rows, as ``DynamicCache.batch_select_indices`` did."""

    def __init__(self, model):
        cfg = model.config
        self.model = model
        self.eps = cfg.rms_norm_eps
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.groups = self.heads // self.kv_heads
        self.scaling = self.head_dim**-0.5
        base = cfg.rope_parameters["rope_theta"]
        self.inv_freq = 1.0 / (base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float) / self.head_dim))

    def start(self, past, attention_mask: torch.Tensor, last_pos: torch.Tensor, extra: int) -> None:
        n, width = attention_mask.shape
        self.len = width
        self.mask = torch.zeros((n, width + extra), dtype=torch.bool, device=attention_mask.device)
        self.mask[:, :width] = attention_mask.bool()
        self.pos = last_pos.clone()
        self.k, self.v = [], []
        for layer in past.layers:
            k = layer.keys.new_empty((n, self.kv_heads, width + extra, self.head_dim))
            v = layer.values.new_empty((n, self.kv_heads, width + extra, self.head_dim))
            k[:, :, :width] = layer.keys
            v[:, :, :width] = layer.values
            self.k.append(k)
            self.v.append(v)

    def keep(self, rows: torch.Tensor) -> None:
        self.mask, self.pos = self.mask[rows], self.pos[rows]
        self.k = [k[rows] for k in self.k]
        self.v = [v[rows] for v in self.v]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (float32) after feeding one token per live row."""
        m = self.model.model
        n, t = tokens.size(0), self.len
        self.pos = self.pos + 1
        self.mask[:, t] = True
        self.len = t + 1
        x = m.embed_tokens(tokens)  # (n, hidden)
        freqs = self.pos[:, None].float() * self.inv_freq.to(x.device)
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
        bias = torch.zeros((n, 1, 1, t + 1), dtype=x.dtype, device=x.device).masked_fill_(~self.mask[:, None, None, : t + 1], float("-inf"))
        for i, layer in enumerate(m.layers):
            a = layer.self_attn
            h = _rms(x, layer.input_layernorm.weight, self.eps)
            q = _rms(torch.nn.functional.linear(h, a.q_proj.weight).view(n, self.heads, self.head_dim), a.q_norm.weight, self.eps)
            k = _rms(torch.nn.functional.linear(h, a.k_proj.weight).view(n, self.kv_heads, self.head_dim), a.k_norm.weight, self.eps)
            v = torch.nn.functional.linear(h, a.v_proj.weight).view(n, self.kv_heads, self.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self.k[i][:, :, t] = k
            self.v[i][:, :, t] = v
            keys, vals = self.k[i][:, :, : t + 1], self.v[i][:, :, : t + 1]
            # grouped-query attention: the query heads of one KV head attend together
            s = torch.matmul(q.view(n, self.kv_heads, self.groups, self.head_dim), keys.transpose(2, 3)) * self.scaling + bias
            p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
            o = torch.matmul(p, vals).reshape(n, self.heads * self.head_dim)
            x = x + torch.nn.functional.linear(o, a.o_proj.weight)
            h = _rms(x, layer.post_attention_layernorm.weight, self.eps)
            mlp = layer.mlp
            g = torch.nn.functional.linear(h, mlp.gate_proj.weight)
            x = x + torch.nn.functional.linear(torch.nn.functional.silu(g) * torch.nn.functional.linear(h, mlp.up_proj.weight), mlp.down_proj.weight)
        x = _rms(x, m.norm.weight, self.eps)
        return torch.nn.functional.linear(x, self.model.lm_head.weight).float()
