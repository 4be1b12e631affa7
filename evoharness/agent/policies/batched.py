"""Batched decoding for episodes that run in threads, on the policy's own weights or on vLLM.

Every episode thread asks for one response at a time. Decoding the waiting requests of all episodes
together costs little more than decoding one (on CPU a small model's cost per token is mostly fixed
overhead; on a GPU a batch fills it). A generator has the interface of ``hf.Sampler``: episode threads
queue their requests, and one decoder thread per generator, bound to the device of the thread that made
the generator (a new thread's CUDA device is 0, whatever its rank's is), collects a batch, decodes it
and hands each thread its own result. Generation never runs on an episode thread.

``BatchedGenerator`` decodes with a transformers model (left-padded, one KV cache); under ZeRO-3 it
runs on parameters gathered for generation (``unwrap_model_for_generation``), so its forward passes
need no collective and ranks with different episode lengths never wait on each other.
``VLLMGenerator`` hands the batch to a vLLM engine (one per process: colocated with training, or
evaluation's own), each row with its own seed and its constraint, applied by the engine token by token.

Each row is decoded under its own ``constrain.ActionConstraint`` and, when sampling, with its own
seeded generator, so a row's tokens do not depend on which others share its batch (up to float
rounding of batched matrix products in greedy ties).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from evoharness.agent.chat_format import render
from evoharness.agent.policies.constrain import ActionConstraint


@dataclass
class Sample:
    text: str
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    constraint: tuple | None = None  # (admissible, verbs) it was decoded under, when a rollout records it


def constraint_spec(view) -> tuple[tuple[str, ...], tuple[str, ...], str]:
    """What a turn's decoding constraint depends on: the admissible commands, the enabled verbs, the
    action of the turn before. The sampler and the trainer (which replays it) both take it from here."""
    return tuple(view.admissible), tuple(view.verbs), (view.last_actions[-1] if view.last_actions else "")


def stop_ids(tok) -> list[int]:
    """End of turn, and ``</action>`` when the tokenizer has it as one token: nothing after the
    action is parsed, so generating past it only costs time (and can break the one-tag format)."""
    ids = [tok.eos_token_id]
    end = tok.convert_tokens_to_ids("</action>")
    if isinstance(end, int) and end != tok.unk_token_id and end not in ids:
        ids.append(end)
    return ids


def _cuda_device() -> int | None:
    """This thread's CUDA device when CUDA is in use here, else None."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_device()


def nucleus(probs, top_p: float):
    """Top-p filtering of rows of probabilities: the smallest set of tokens holding ``top_p`` of each row's mass
    (the most likely first) keeps its probabilities, every other token gets 0 (``torch.multinomial`` renormalises)."""
    sp, si = probs.sort(-1, descending=True)
    drop = sp.cumsum(-1) - sp >= top_p
    return probs.scatter(-1, si, sp.masked_fill(drop, 0.0))


@dataclass
class _Request:
    ids: list[int]
    constraint: object  # the backend's: an ActionConstraint, a regex, or None
    seed: int | None
    key: object = None  # the session's order key (lockstep rounds), None outside a session
    done: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: BaseException | None = None


class Batcher:
    """The leader pattern over episode threads; a backend implements ``_decode(batch)``.

    Threads inside ``session(key)`` decode in lockstep rounds: a round is decoded once every
    session has its request in, rows in key order, in chunks of ``max_batch``. What shares a batch
    then depends only on which episodes are running, never on timing, so a rerun decodes the same
    batches and, on the same machine, the same tokens bit for bit (GRPO and evaluation are
    reproducible). Threads outside any session are batched with whoever asked within ``wait_s``.
    """

    ACTIVE_S = 5.0  # a thread that asked within this many seconds is expected in the next batch

    def __init__(self, tok, sample: bool, temperature: float, max_new_tokens: int, constrained: bool = True,
                 max_batch: int = 32, wait_s: float = 0.08, top_p: float = 1.0):
        self.tok = tok
        self.sample, self.temperature, self.max_new_tokens = sample, temperature, max_new_tokens
        self.top_p = top_p  # nucleus sampling (evaluation as the field samples: T = 1.0, top-p 0.9); 1.0: the whole distribution
        self.constrained, self.max_batch, self.wait_s = constrained, max_batch, wait_s
        self.stops = set(stop_ids(tok))
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self._cv = threading.Condition()
        self._pending: list[_Request] = []
        self._owner: threading.Thread | None = None
        self._device = _cuda_device()
        self.decoder_threads: set[int] = set()  # the threads that ran a decode (one per idle period; tested)
        self._seen: dict[int, float] = {}
        self._members: dict[int, object] = {}  # thread id -> session key
        self.batches = 0
        self.rows = 0

    @contextmanager
    def session(self, key):
        """This thread takes part in lockstep rounds until the block ends (see the class docstring)."""
        me = threading.get_ident()
        with self._cv:
            self._members[me] = key
            self._cv.notify_all()
        try:
            yield self
        finally:
            with self._cv:
                self._members.pop(me, None)
                self._cv.notify_all()

    # -- the Sampler interface -------------------------------------------------------------
    def __call__(self, prompt: str, seed: int | None = None, view=None):
        ids = self.tok(render(self.tok, prompt), add_special_tokens=False)["input_ids"]
        c = self._constraint(*constraint_spec(view)) if (self.constrained and view is not None) else None
        req = _Request(list(ids), c, seed)
        with self._cv:
            req.key = self._members.get(threading.get_ident())
            self._pending.append(req)
            self._seen[threading.get_ident()] = time.monotonic()
            if self._owner is None:
                self._owner = threading.Thread(target=self._serve, name="evoharness-decoder", daemon=True)
                self._owner.start()
            self._cv.notify_all()
        req.done.wait()
        if req.error is not None:
            raise req.error
        return req.result

    IDLE_S = 2.0  # the decoder thread ends after this long without a request (a new one starts on the next)

    def _serve(self) -> None:
        """The decoder thread: on the generator's device, batches of queued requests until idle."""
        if self._device is not None:
            import torch

            torch.cuda.set_device(self._device)
        self.decoder_threads.add(threading.get_ident())
        try:
            while True:
                with self._cv:
                    if not self._pending:
                        self._cv.wait(self.IDLE_S)
                        if not self._pending:
                            self._owner = None  # under the lock: the next request starts a new thread
                            return
                    batch = self._collect()
                if batch:
                    self._run(batch)
        except BaseException as e:  # every waiting thread gets the error, none hangs
            with self._cv:
                self._owner = None
                failed, self._pending = self._pending, []
            for r in failed:
                r.error = e
                r.done.set()
            raise

    def _constraint(self, admissible: tuple[str, ...], verbs: tuple[str, ...], after: str = ""):
        """What a row's decoding is constrained by (None: free), in the backend's terms."""
        c = ActionConstraint(self.tok, admissible, verbs, self.max_new_tokens, after)
        return c if c.active else None

    def _collect(self) -> list[_Request]:
        """Called holding the lock: the next batch. In lockstep, the whole round once every session's
        request is in (sorted by key); otherwise whoever asked within ``wait_s``."""
        if self._members:
            while True:
                keys = {r.key for r in self._pending if r.key is not None}
                if set(self._members.values()) <= keys:
                    break
                self._cv.wait(1.0)
                if not self._members:
                    break
            round_ = sorted((r for r in self._pending if r.key is not None), key=lambda r: r.key)
            round_ += [r for r in self._pending if r.key is None]  # a thread outside any session rides along
            self._pending = []
            return round_
        now = time.monotonic()
        self._seen = {k: t for k, t in self._seen.items() if now - t < self.ACTIVE_S}
        expected = min(len(self._seen), self.max_batch)
        deadline = now + self.wait_s
        while len(self._pending) < expected:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._cv.wait(left)
        batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
        return batch

    # -- decoding --------------------------------------------------------------------------
    def _run(self, batch: list[_Request]) -> None:
        for i in range(0, len(batch), self.max_batch):
            chunk = batch[i : i + self.max_batch]
            try:
                outs = self._decode(chunk)
            except BaseException as e:  # every waiting thread gets the error, none hangs
                for r in batch[i:]:
                    r.error = e
                    r.done.set()
                return
            self.batches += 1
            self.rows += len(chunk)
            for r, (comp, logps) in zip(chunk, outs):
                r.result = Sample(self.tok.decode(comp, skip_special_tokens=True), r.ids, comp, logps)
                r.done.set()

    def _decode(self, batch: list[_Request]) -> list[tuple[list[int], list[float]]]:
        raise NotImplementedError


class BatchedGenerator(Batcher):
    """Decodes with a transformers causal LM (the live training weights in GRPO).

    The weights must not change while a generator lives: it caches the keys and values of the prompts'
    shared head, which an optimizer step would leave stale. GRPO makes a new one for each batch of rollouts."""

    def __init__(self, model, tok, sample: bool, temperature: float, max_new_tokens: int, constrained: bool = True,
                 max_batch: int = 32, wait_s: float = 0.08, fast: bool = True, top_p: float = 1.0):
        super().__init__(tok, sample, temperature, max_new_tokens, constrained, max_batch, wait_s, top_p)
        self.model = model
        device = getattr(model, "device", None)
        if device is not None and device.type == "cuda":  # decode where the weights are
            self._device = device.index or 0
        from evoharness.agent.policies import fastdecode

        # Qwen3 steps skip transformers' per-call cost (fastdecode's docstring); other models decode through it
        self.stepper = fastdecode.Qwen3Step(model) if (fast and fastdecode.supports(model)) else None
        # The prompts' shared head (the system text, about half of a tiny-profile prompt) is encoded once per
        # generator, whose weights do not change while it lives (GRPO makes one per batch of rollouts).
        self.prefix = fast
        self._heads: dict[tuple[int, ...], list] = {}

    MIN_SHARED = 16  # fewer shared ids than this are not worth a head

    def _head(self, ids: list[int]) -> tuple[int, list]:
        """A head for prompts that all begin with ``ids``: (its length, each layer's (keys, values) at
        positions 0.., batch of one). The longest head already encoded that fits is reused (a batch whose
        rows share more than the system text, all first turns say, does not make a new one), else ``ids``
        is encoded."""
        fits = [h for h in self._heads if len(h) <= len(ids) and tuple(ids[: len(h)]) == h]
        if fits:
            h = max(fits, key=len)
            return len(h), self._heads[h]
        import torch

        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([ids], device=self.model.device), use_cache=True, logits_to_keep=1)
        got = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        if len(self._heads) >= 8:  # a few system texts at most (one per set of enabled verbs)
            self._heads.clear()
        self._heads[tuple(ids)] = got
        return len(ids), got

    def _shared(self, batch: list[_Request]) -> int:
        """How many leading ids every row shares (each row keeps at least one of its own); 0 when too few
        to bother, or for a single row (nothing to share)."""
        if not self.prefix or len(batch) < 2:
            return 0
        first, p = batch[0].ids, min(len(r.ids) for r in batch) - 1
        for r in batch[1:]:
            k = 0
            while k < p and r.ids[k] == first[k]:
                k += 1
            p = k
        return p if p >= self.MIN_SHARED else 0

    def _decode(self, batch: list[_Request]) -> list[tuple[list[int], list[float]]]:
        import torch
        from transformers import DynamicCache

        device = self.model.device
        n = len(batch)
        shared = self._shared(batch)
        head = None
        if shared:
            shared, head = self._head(batch[0].ids[:shared])
        width = max(len(r.ids) for r in batch) - shared
        input_ids = torch.full((n, width), self.pad, dtype=torch.long, device=device)
        attn = torch.zeros((n, width), dtype=torch.long, device=device)
        for i, r in enumerate(batch):
            input_ids[i, width - len(r.ids) + shared :] = torch.tensor(r.ids[shared:], device=device)
            attn[i, width - len(r.ids) + shared :] = 1
        pos = shared + (attn.cumsum(-1) - 1).clamp(min=0)
        gens = [torch.Generator().manual_seed(int(r.seed)) if (self.sample and r.seed is not None) else None for r in batch]
        comps: list[list[int]] = [[] for _ in batch]
        logps: list[list[float]] = [[] for _ in batch]
        with torch.no_grad():
            past = None
            if shared:  # [shared head | left padding | each row's own ids]: padding may sit inside, the mask says where
                past = DynamicCache(config=self.model.config)
                for li, (k, v) in enumerate(head):
                    past.update(k.expand(n, -1, -1, -1), v.expand(n, -1, -1, -1), li)
                attn = torch.cat([torch.ones((n, shared), dtype=torch.long, device=device), attn], 1)
            # only the last position's logits: the prompt's others are never read
            out = self.model(input_ids=input_ids, attention_mask=attn, position_ids=pos, past_key_values=past, use_cache=True,
                             logits_to_keep=1)
            past = out.past_key_values
            logits = out.logits[:, -1, :].float()
            last_pos = pos[:, -1]
            step = self.stepper
            if step is not None:
                step.start(past, attn, last_pos, self.max_new_tokens)
                past = None
            rows = list(range(n))  # batch rows still decoding, in the order of the cache's rows
            for _ in range(self.max_new_tokens):
                scores = logits / self.temperature if self.sample else logits
                allowed = torch.ones_like(scores, dtype=torch.bool)
                for k, i in enumerate(rows):
                    c = batch[i].constraint
                    if c is not None:  # the tokenizer's ids; a model's padded vocabulary beyond them is never allowed
                        m = c.mask(comps[i])
                        allowed[k, : m.numel()] = m.to(device)
                        allowed[k, m.numel() :] = False
                lp = torch.log_softmax(scores.masked_fill(~allowed, float("-inf")), -1)
                if self.sample:
                    probs = lp.exp().cpu()
                    if self.top_p < 1.0:
                        probs = nucleus(probs, self.top_p)
                    picks = [int(torch.multinomial(probs[k], 1, generator=gens[i])) for k, i in enumerate(rows)]
                else:
                    picks = lp.argmax(-1).tolist()
                keep = []
                lp_cpu = lp.cpu()
                for k, (i, t) in enumerate(zip(rows, picks)):
                    comps[i].append(t)
                    logps[i].append(float(lp_cpu[k, t]))
                    if t not in self.stops:
                        keep.append(k)
                if not keep:
                    break
                nxt = torch.tensor([picks[k] for k in keep], dtype=torch.long, device=device)
                if len(keep) < len(rows):  # finished rows leave the batch and its cache
                    idx = torch.tensor(keep, dtype=torch.long, device=device)
                    if step is not None:
                        step.keep(idx)
                    else:
                        past.batch_select_indices(idx)
                        attn, last_pos = attn[idx], last_pos[idx]
                    rows = [rows[k] for k in keep]
                if step is not None:
                    logits = step.step(nxt)
                    continue
                attn = torch.cat([attn, torch.ones((len(rows), 1), dtype=torch.long, device=device)], 1)
                last_pos = last_pos + 1
                out = self.model(input_ids=nxt[:, None], attention_mask=attn, position_ids=last_pos[:, None], past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[:, -1, :].float()
        return list(zip(comps, logps))


class VLLMGenerator(Batcher):
    """Decodes a batch on a vLLM engine: evaluation's own ``LLM``, or in GRPO the engine TRL keeps
    on each training process (colocate mode), whose weights TRL syncs before every batch of rollouts.
    Each row carries its seed and its constraint, which the engine applies token by token with the
    same grammar as the other decoders (``vllm_engine.ConstraintLogitsProcessor``: the engine must be
    made with it); the logprobs are vLLM's processed ones, those of the distribution sampled from."""

    def __init__(self, llm, tok, sample: bool, temperature: float, max_new_tokens: int, constrained: bool = True, max_batch: int = 256,
                 wait_s: float = 0.05, top_p: float = 1.0):
        super().__init__(tok, sample, temperature, max_new_tokens, constrained, max_batch, wait_s, top_p)
        self.llm = llm

    def _constraint(self, admissible: tuple[str, ...], verbs: tuple[str, ...], after: str = ""):
        c = ActionConstraint(self.tok, admissible, verbs, self.max_new_tokens, after)  # refuses a tokenizer without the tags
        return [list(admissible), list(verbs), after, self.max_new_tokens] if c.active else None

    def _decode(self, batch: list[_Request]) -> list[tuple[list[int], list[float]]]:
        from vllm import SamplingParams

        from evoharness.agent.policies.vllm_engine import KEY

        params = []
        for r in batch:
            kw = dict(n=1, temperature=self.temperature if self.sample else 0.0, max_tokens=self.max_new_tokens, logprobs=0,
                      stop_token_ids=sorted(self.stops), skip_special_tokens=False, top_p=self.top_p if self.sample else 1.0)
            if self.sample and r.seed is not None:
                kw["seed"] = int(r.seed)
            if r.constraint is not None:
                kw["extra_args"] = {KEY: r.constraint}
            params.append(SamplingParams(**kw))
        outs = self.llm.generate([{"prompt_token_ids": r.ids} for r in batch], sampling_params=params, use_tqdm=False)
        res = []
        for o in outs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            lps = [float(step[t].logprob) if step and t in step else 0.0 for t, step in zip(ids, c.logprobs or [{}] * len(ids))]
            res.append((ids, lps))
        return res
