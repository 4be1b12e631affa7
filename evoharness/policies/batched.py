"""Batched decoding for episodes that run in threads.

Every episode thread asks for one response at a time. On CPU a small model's cost per generated
token is mostly fixed overhead, so decoding the waiting requests of all episodes together costs
little more than decoding one. ``BatchedGenerator`` has the interface of ``hf.Sampler``: the first
thread to ask becomes the batch's leader, waits briefly for the other active episodes' requests,
decodes them together (left-padded, one KV cache) and hands each thread its own result.

Each row is decoded under its own ``constrain.ActionConstraint`` and, when sampling, with its own
seeded generator, so a row's tokens do not depend on which others share its batch (up to float
rounding of batched matrix products in greedy ties).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from evoharness.chat_format import render
from evoharness.policies.constrain import ActionConstraint


@dataclass
class _Request:
    ids: list[int]
    constraint: ActionConstraint | None
    seed: int | None
    done: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: BaseException | None = None


class BatchedGenerator:
    ACTIVE_S = 5.0  # a thread that asked within this many seconds is expected in the next batch

    def __init__(self, model, tok, sample: bool, temperature: float, max_new_tokens: int, constrained: bool = True,
                 max_batch: int = 32, wait_s: float = 0.08):
        import torch

        from evoharness.policies.hf import stop_ids

        self.model, self.tok = model, tok
        self.sample, self.temperature, self.max_new_tokens = sample, temperature, max_new_tokens
        self.constrained, self.max_batch, self.wait_s = constrained, max_batch, wait_s
        self.stops = set(stop_ids(tok))
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self._cv = threading.Condition()
        self._pending: list[_Request] = []
        self._leading = False
        self._seen: dict[int, float] = {}
        self._torch = torch
        self.batches = 0
        self.rows = 0

    # -- the Sampler interface -------------------------------------------------------------
    def __call__(self, prompt: str, seed: int | None = None, view=None):
        ids = self.tok(render(self.tok, prompt), add_special_tokens=False)["input_ids"]
        c = None
        if self.constrained and view is not None:
            c = ActionConstraint(self.tok, tuple(view.admissible), tuple(view.verbs), self.max_new_tokens)
            c = c if c.active else None
        req = _Request(list(ids), c, seed)
        with self._cv:
            self._pending.append(req)
            self._seen[threading.get_ident()] = time.monotonic()
            self._cv.notify_all()
        while not req.done.is_set():
            with self._cv:
                if req.done.is_set():
                    break
                if self._leading:
                    self._cv.wait(0.5)
                    continue
                self._leading = True
                batch = self._collect()
            try:
                self._run(batch)
            finally:
                with self._cv:
                    self._leading = False
                    self._cv.notify_all()
        if req.error is not None:
            raise req.error
        return req.result

    def _collect(self) -> list[_Request]:
        """Called holding the lock: wait for the other active threads' requests, then take a batch."""
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
        from evoharness.policies.hf import Sample

        try:
            outs = self._decode(batch)
        except BaseException as e:  # every waiting thread gets the error, none hangs
            for r in batch:
                r.error = e
                r.done.set()
            return
        self.batches += 1
        self.rows += len(batch)
        for r, (comp, logps) in zip(batch, outs):
            r.result = Sample(self.tok.decode(comp, skip_special_tokens=True), r.ids, comp, logps)
            r.done.set()

    def _decode(self, batch: list[_Request]) -> list[tuple[list[int], list[float]]]:
        torch = self._torch
        n = len(batch)
        width = max(len(r.ids) for r in batch)
        input_ids = torch.full((n, width), self.pad, dtype=torch.long)
        attn = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(batch):
            input_ids[i, width - len(r.ids) :] = torch.tensor(r.ids)
            attn[i, width - len(r.ids) :] = 1
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        gens = [torch.Generator().manual_seed(int(r.seed)) if (self.sample and r.seed is not None) else None for r in batch]
        comps: list[list[int]] = [[] for _ in batch]
        logps: list[list[float]] = [[] for _ in batch]
        with torch.no_grad():
            out = self.model(input_ids=input_ids, attention_mask=attn, position_ids=pos, use_cache=True)
            past = out.past_key_values
            logits = out.logits[:, -1, :].float()
            last_pos = pos[:, -1]
            rows = list(range(n))  # batch rows still decoding, in the order of the cache's rows
            for _ in range(self.max_new_tokens):
                scores = logits / self.temperature if self.sample else logits
                allowed = torch.ones_like(scores, dtype=torch.bool)
                for k, i in enumerate(rows):
                    c = batch[i].constraint
                    if c is not None:
                        allowed[k] = False
                        allowed[k, c.allowed(comps[i])] = True
                lp = torch.log_softmax(scores.masked_fill(~allowed, float("-inf")), -1)
                if self.sample:
                    picks = [int(torch.multinomial(lp[k].exp(), 1, generator=gens[i])) for k, i in enumerate(rows)]
                else:
                    picks = lp.argmax(-1).tolist()
                keep = []
                for k, (i, t) in enumerate(zip(rows, picks)):
                    comps[i].append(t)
                    logps[i].append(float(lp[k, t]))
                    if t not in self.stops:
                        keep.append(k)
                if not keep:
                    break
                nxt = torch.tensor([picks[k] for k in keep], dtype=torch.long)
                if len(keep) < len(rows):  # finished rows leave the batch and its cache
                    idx = torch.tensor(keep, dtype=torch.long)
                    past.batch_select_indices(idx)
                    attn, last_pos = attn[idx], last_pos[idx]
                    rows = [rows[k] for k in keep]
                attn = torch.cat([attn, torch.ones((len(rows), 1), dtype=torch.long)], 1)
                last_pos = last_pos + 1
                out = self.model(input_ids=nxt[:, None], attention_mask=attn, position_ids=last_pos[:, None], past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[:, -1, :].float()
        return list(zip(comps, logps))
