"""A local Hugging Face causal LM as a policy (greedy or sampled), decoded in batches across episode
threads (``policies.batched``: the model's own weights, or vLLM), and ``Sampler``, the one-prompt
reference the batched decoders are tested against. All render prompts with ``chat_format.render``."""

from __future__ import annotations

import threading
from pathlib import Path

from evoharness.agent.chat_format import render
from evoharness.agent.episode import Privileged, TurnView
from evoharness.agent.policies.batched import Sample, stop_ids
from evoharness.agent.training.checkpoint import load_dtype, resolve_checkpoint, weights_digest
from evoharness.core.errors import PolicyError

_MODELS: dict[str, tuple] = {}
_LOAD_LOCK = threading.Lock()


def load(path: str, device: str = "cpu", dtype: str = "float32"):
    """Tokenizer, model (eval mode, on ``device``) and a lock, once per checkpoint and placement."""
    path = str(resolve_checkpoint(path))
    dtype = load_dtype(path, dtype)
    key = f"{path}|{device}|{dtype}"
    with _LOAD_LOCK:
        if key not in _MODELS:
            p = Path(path)
            if not (p / "config.json").exists():
                raise PolicyError(f"hf policy: {path} is not a Hugging Face checkpoint (no config.json)")
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            try:
                tok = AutoTokenizer.from_pretrained(path)
                model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device)
            except Exception as e:  # a checkpoint that is not one (safetensors' own error is no OSError)
                if not isinstance(e, (OSError, ValueError, RuntimeError, KeyError, TypeError)) \
                        and type(e).__module__.split(".")[0] not in ("safetensors", "tokenizers", "transformers"):
                    raise
                why = " ".join(str(e).split())[:200] or type(e).__name__
                raise PolicyError(f"hf policy: cannot load the checkpoint {path} ({type(e).__name__}: {why}); re-make it or pull it with DVC") from None
            model.eval()
            _MODELS[key] = (tok, model, threading.Lock())
        return _MODELS[key]


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
            from evoharness.agent.policies.batched import constraint_spec
            from evoharness.agent.policies.constrain import prefix_fn

            adm, verbs, after = constraint_spec(view)
            fn = prefix_fn(self.tok, adm, verbs, ids["input_ids"].shape[1], self.max_new_tokens, after)
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


_GENERATORS: dict[tuple, object] = {}


_LLMS: dict[tuple, object] = {}


def _vllm_engine(path: str, dtype: str, device: str = "cuda"):
    """Evaluation's vLLM engine for a checkpoint (one GPU, or the CPU), made once per process (``release``
    frees it): the decoding constraint runs inside it, and its log-probs are those sampled from."""
    dtype = load_dtype(path, dtype)
    key = (path, dtype)
    with _LOAD_LOCK:
        if key not in _LLMS:
            from vllm import LLM

            from evoharness.agent.policies.vllm_engine import ConstraintLogitsProcessor

            # On the CPU the "GPU" share is of the machine's memory, which the evaluation's environment workers need too.
            _LLMS[key] = LLM(model=path, dtype=dtype, gpu_memory_utilization=0.85 if device == "cuda" else 0.3, seed=0,
                             logits_processors=[ConstraintLogitsProcessor], logprobs_mode="processed_logprobs",
                             enforce_eager=device == "cpu")  # CPU: no graph compile on 2 cores
        return _LLMS[key]


def release(path: str) -> int:
    """Free what this process holds for a checkpoint: its generators, its vLLM engine (shut down, its
    memory returned) and its loaded model. ``compare`` evaluates models one after another in one process,
    and vLLM refuses a second engine while the first holds its share of the GPU. Returns how many were freed."""
    import gc

    real = str(resolve_checkpoint(path))
    with _LOAD_LOCK:
        gens = [k for k in _GENERATORS if k[0] == real]
        engines = [_LLMS.pop(k) for k in [k for k in _LLMS if k[0] == real]]
        models = [k for k in _MODELS if k.split("|", 1)[0] == real]
        for k in gens:
            _GENERATORS.pop(k)
        for k in models:
            _MODELS.pop(k)
    for llm in engines:
        _shutdown_vllm(llm)
    del engines
    gc.collect()
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return len(gens) + len(models)


def _shutdown_vllm(llm) -> None:
    """Stop an engine's core (its worker, its KV cache) now rather than when the garbage collector finds it."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    stop = getattr(core, "shutdown", None)
    if callable(stop):
        stop()


def generator(path: str, sample: bool, temperature: float, max_new_tokens: int, constrained: bool, backend: str = "hf",
              device: str = "cpu", dtype: str = "float32", top_p: float = 1.0):
    """One batched generator per checkpoint and decoding setting, shared by every episode thread:
    the model's own weights (``hf``) or a vLLM engine on it (``vllm``)."""
    from evoharness.agent.policies.batched import BatchedGenerator, VLLMGenerator

    key = (str(resolve_checkpoint(path)), sample, temperature, max_new_tokens, constrained, backend, device, dtype, top_p)
    with _LOAD_LOCK:
        g = _GENERATORS.get(key)
    if g is None:
        if backend == "vllm":
            from transformers import AutoTokenizer

            real = str(resolve_checkpoint(path))
            made = VLLMGenerator(_vllm_engine(real, dtype, device), AutoTokenizer.from_pretrained(real), sample, temperature, max_new_tokens,
                                 constrained, top_p=top_p)
        else:
            tok, model, _ = load(path, device, dtype)
            made = BatchedGenerator(model, tok, sample, temperature, max_new_tokens, constrained, top_p=top_p)
        with _LOAD_LOCK:
            g = _GENERATORS.setdefault(key, made)
    return g


class HFPolicy:
    def __init__(self, path: str, sample: bool = False, temperature: float = 1.0, max_new_tokens: int = 96, constrained: bool = True,
                 backend: str = "hf", device: str = "cpu", dtype: str = "float32", top_p: float = 1.0):
        if not path:
            raise PolicyError("hf policy needs path=<checkpoint folder>")
        if not 0.0 < top_p <= 1.0:
            raise PolicyError(f"hf policy: top_p must be in (0, 1] (got {top_p})")
        self.top_p = top_p
        self.path, self.sample, self.temperature, self.max_new_tokens = path, sample, temperature, max_new_tokens
        self.constrained, self.backend, self.device, self.dtype = constrained, backend, device, dtype
        self.name = f"hf:{Path(path).name}"
        self.seed = 0
        self.calls = 0

    def fingerprint(self) -> str:
        decoding = "constrained" if self.constrained else "free"
        backend = "" if self.backend == "hf" else f":{self.backend}"  # the same weights and decoding on another engine
        nucleus = f"/p{self.top_p}" if self.sample and self.top_p < 1.0 else ""  # part of the sampling setting (promotion reads it)
        return f"hf:v3:{weights_digest(self.path)}:{self.sample}:{self.temperature}{nucleus}:{self.max_new_tokens}:{decoding}{backend}"

    def reset(self, seed: int) -> None:
        self.seed, self.calls = seed, 0

    def session(self, key):
        """This episode thread's lockstep session with the shared decoder (``policies.batched``)."""
        return generator(self.path, self.sample, self.temperature, self.max_new_tokens, self.constrained, self.backend, self.device,
                         self.dtype, self.top_p).session(key)

    def act(self, prompt: str, view: TurnView, privileged: Privileged) -> str:
        sampler = generator(self.path, self.sample, self.temperature, self.max_new_tokens, self.constrained, self.backend, self.device,
                            self.dtype, self.top_p)
        self.calls += 1
        return sampler(prompt, seed=(self.seed * 100_003 + self.calls) if self.sample else None, view=view).text
