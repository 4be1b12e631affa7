"""A local Hugging Face causal LM as a policy (greedy or sampled), and the ``Sampler`` that GRPO
rollouts use with the live training weights. Both render prompts with ``chat_format.render``."""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from pathlib import Path

from evoharness.chat_format import render
from evoharness.episode import Privileged, TurnView
from evoharness.errors import PolicyError

_MODELS: dict[str, tuple] = {}
_LOAD_LOCK = threading.Lock()


POINTER = "pointer.json"


def write_pointer(out: Path, target: Path) -> None:
    """A pretrained base stays where it is; the stage's output records where (and which config)."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    cfg = (target / "config.json").read_text()
    (out / POINTER).write_text(json.dumps({"path": str(target.resolve()), "config_sha256": hashlib.sha256(cfg.encode()).hexdigest()}))


def resolve_checkpoint(path: str | Path) -> Path:
    import json

    p = Path(path)
    if (p / POINTER).exists():
        return Path(json.loads((p / POINTER).read_text())["path"])
    return p


def load(path: str):
    path = str(resolve_checkpoint(path))
    with _LOAD_LOCK:
        if path not in _MODELS:
            p = Path(path)
            if not (p / "config.json").exists():
                raise PolicyError(f"hf policy: {path} is not a Hugging Face checkpoint (no config.json)")
            from transformers import AutoModelForCausalLM, AutoTokenizer

            tok = AutoTokenizer.from_pretrained(path)
            model = AutoModelForCausalLM.from_pretrained(path)
            model.eval()
            _MODELS[path] = (tok, model, threading.Lock())
        return _MODELS[path]


_DIGESTS: dict[tuple, str] = {}


def weights_digest(path: str | Path) -> str:
    """Identifies a checkpoint's weights: every (sharded) safetensors file's name and size and a hash
    of its first and last MiB, plus config.json. Cached per file state, so an episode pays nothing."""
    p = resolve_checkpoint(path)
    files = sorted(p.glob("*.safetensors")) + [p / "config.json"]
    key = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.exists())
    if key not in _DIGESTS:
        h = hashlib.sha256()
        for f in files:
            if not f.exists():
                continue
            size = f.stat().st_size
            with open(f, "rb") as fh:
                h.update(f"{f.name}:{size}".encode())
                h.update(fh.read(1 << 20))
                if size > 2 << 20:
                    fh.seek(-(1 << 20), 2)
                    h.update(fh.read())
        _DIGESTS[key] = h.hexdigest()[:16]
    return _DIGESTS[key]


def stop_ids(tok) -> list[int]:
    """End of turn, and ``</action>`` when the tokenizer has it as one token: nothing after the
    action is parsed, so generating past it only costs time (and can break the one-tag format)."""
    ids = [tok.eos_token_id]
    end = tok.convert_tokens_to_ids("</action>")
    if isinstance(end, int) and end != tok.unk_token_id and end not in ids:
        ids.append(end)
    return ids


@dataclass
class Sample:
    text: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]


class Sampler:
    """Generate one response for a prompt; serialised by a lock (episodes run in threads)."""

    def __init__(self, model, tok, sample: bool, temperature: float, max_new_tokens: int, lock: threading.Lock | None = None,
                 constrained: bool = True):
        self.model, self.tok = model, tok
        self.sample, self.temperature, self.max_new_tokens = sample, temperature, max_new_tokens
        self.lock = lock or threading.Lock()
        self.constrained = constrained

    def __call__(self, prompt: str, seed: int | None = None, view: TurnView | None = None) -> Sample:
        """One response; with ``view`` and ``constrained``, decoded under ``constrain.ActionConstraint``
        (the logprobs are then those of the distribution actually sampled from)."""
        import torch

        text = render(self.tok, prompt)
        ids = self.tok(text, return_tensors="pt", add_special_tokens=False)
        kwargs = dict(max_new_tokens=self.max_new_tokens, do_sample=self.sample, pad_token_id=self.tok.pad_token_id,
                      eos_token_id=stop_ids(self.tok), output_scores=True, return_dict_in_generate=True)
        if self.constrained and view is not None:
            from evoharness.policies.constrain import prefix_fn

            fn = prefix_fn(self.tok, view.admissible, view.verbs, ids["input_ids"].shape[1], self.max_new_tokens)
            if fn is not None:
                kwargs["prefix_allowed_tokens_fn"] = fn
        if self.sample:
            kwargs.update(temperature=self.temperature, top_k=0, top_p=1.0)
        with self.lock, torch.no_grad():
            if seed is not None:
                torch.manual_seed(seed)
            out = self.model.generate(**ids.to(self.model.device), **kwargs)
        n = ids["input_ids"].shape[1]
        comp = out.sequences[0, n:].tolist()
        logps = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, comp)]
        return Sample(self.tok.decode(comp, skip_special_tokens=True), ids["input_ids"][0].tolist(), comp, logps)


class VLLMServerSampler:
    """The same interface as ``Sampler``, generating on TRL's vLLM server (``trl vllm-serve``), whose
    weights the trainer syncs before each batch of rollouts. Same rendering, same stop tokens."""

    def __init__(self, client, tok, temperature: float, max_new_tokens: int, lock: threading.Lock | None = None):
        self.client, self.tok = client, tok
        self.temperature, self.max_new_tokens = temperature, max_new_tokens
        self.lock = lock or threading.Lock()

    def __call__(self, prompt: str, seed: int | None = None, view: TurnView | None = None) -> Sample:
        """Unconstrained: the server decodes freely (``view`` is accepted for the interface)."""
        text = render(self.tok, prompt)
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        kwargs = {"stop_token_ids": stop_ids(self.tok)}
        if seed is not None:
            kwargs["seed"] = int(seed)
        with self.lock:
            out = self.client.generate(prompts=[ids], n=1, temperature=self.temperature, max_tokens=self.max_new_tokens, logprobs=0,
                                       generation_kwargs=kwargs)
        comp = list(out["completion_ids"][0])
        logps = [float(lp[0]) if isinstance(lp, (list, tuple)) else float(lp) for lp in out["logprobs"][0]]
        return Sample(self.tok.decode(comp, skip_special_tokens=True), list(ids), comp, logps)


def vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


_GENERATORS: dict[tuple, object] = {}


def generator(path: str, sample: bool, temperature: float, max_new_tokens: int, constrained: bool):
    """One ``BatchedGenerator`` per checkpoint and decoding setting, shared by every episode thread."""
    from evoharness.policies.batched import BatchedGenerator

    key = (str(resolve_checkpoint(path)), sample, temperature, max_new_tokens, constrained)
    with _LOAD_LOCK:
        g = _GENERATORS.get(key)
    if g is None:
        tok, model, _ = load(path)
        with _LOAD_LOCK:
            g = _GENERATORS.setdefault(key, BatchedGenerator(model, tok, sample, temperature, max_new_tokens, constrained))
    return g


class HFPolicy:
    def __init__(self, path: str, sample: bool = False, temperature: float = 1.0, max_new_tokens: int = 96, constrained: bool = True):
        if not path:
            raise PolicyError("hf policy needs path=<checkpoint folder>")
        self.path, self.sample, self.temperature, self.max_new_tokens = path, sample, temperature, max_new_tokens
        self.constrained = constrained
        self.name = f"hf:{Path(path).name}"
        self.seed = 0
        self.calls = 0

    def fingerprint(self) -> str:
        decoding = "constrained" if self.constrained else "free"
        return f"hf:v2:{weights_digest(self.path)}:{self.sample}:{self.temperature}:{self.max_new_tokens}:{decoding}"

    def reset(self, seed: int) -> None:
        self.seed, self.calls = seed, 0

    def act(self, prompt: str, view: TurnView, privileged: Privileged) -> str:
        sampler = generator(self.path, self.sample, self.temperature, self.max_new_tokens, self.constrained)
        self.calls += 1
        return sampler(prompt, seed=(self.seed * 100_003 + self.calls) if self.sample else None, view=view).text
