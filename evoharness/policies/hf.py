"""A local Hugging Face causal LM as a policy (greedy or sampled). Weights load once per process."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

from evoharness.chat_format import render
from evoharness.episode import Privileged, TurnView
from evoharness.errors import PolicyError

_MODELS: dict[str, tuple] = {}
_LOCK = threading.Lock()


def load(path: str):
    with _LOCK:
        if path not in _MODELS:
            p = Path(path)
            if not (p / "config.json").exists():
                raise PolicyError(f"hf policy: {path} is not a Hugging Face checkpoint (no config.json)")
            from transformers import AutoModelForCausalLM, AutoTokenizer

            tok = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path)
            model.eval()
            _MODELS[path] = (tok, model)
        return _MODELS[path]


class HFPolicy:
    def __init__(self, path: str, sample: bool = False, temperature: float = 1.0, max_new_tokens: int = 96):
        if not path:
            raise PolicyError("hf policy needs path=<checkpoint folder>")
        self.path, self.sample, self.temperature, self.max_new_tokens = path, sample, temperature, max_new_tokens
        self.name = f"hf:{Path(path).name}"
        self.seed = 0
        self.calls = 0

    def fingerprint(self) -> str:
        cfg = Path(self.path) / "model.safetensors"
        digest = hashlib.sha256(cfg.read_bytes()).hexdigest()[:12] if cfg.exists() else "nohash"
        return f"hf:v1:{digest}:{self.sample}:{self.temperature}:{self.max_new_tokens}"

    def reset(self, seed: int) -> None:
        self.seed, self.calls = seed, 0

    def act(self, prompt: str, view: TurnView, privileged: Privileged) -> str:
        import torch

        tok, model = load(self.path)
        text = render(tok, prompt)
        ids = tok(text, return_tensors="pt", add_special_tokens=False)
        kwargs = dict(max_new_tokens=self.max_new_tokens, do_sample=self.sample, pad_token_id=tok.pad_token_id or tok.eos_token_id)
        if self.sample:
            kwargs["temperature"] = self.temperature
            torch.manual_seed(hash((self.seed, self.calls)) % (2**31))
        self.calls += 1
        with _LOCK, torch.no_grad():
            out = model.generate(**ids, **kwargs)
        return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
