"""Constrained decoding: the response always has the format ``<think>…</think><action>…</action>``
and its action is a line of ADMISSIBLE COMMANDS or one of the enabled meta-verbs (with a free
argument). The prompt is unchanged; only which next tokens may be sampled is restricted, so the
probabilities a trained policy gives the allowed tokens are renormalised, nothing more.

A small model trained on a few hundred episodes spends most of its failures on malformed or
misspelled commands; with the constraint every turn is a legal move, and evaluation, GRPO
rollouts and the baselines all decode the same way (``decoding: constrained`` in the profile).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

MAX_THINK = 24  # tokens of free text before ``</think>`` is forced (the teacher's thoughts are at most 16)
MAX_ARG = 12  # tokens of a meta-action's argument before ``</action>`` is forced


@dataclass
class _Tags:
    think: int
    end_think: int
    action: int
    end_action: int
    banned: frozenset[int]  # special and tag tokens: never inside free text


def _tags(tok) -> _Tags | None:
    ids = tok.convert_tokens_to_ids(["<think>", "</think>", "<action>", "</action>"])
    if any(not isinstance(i, int) or i == tok.unk_token_id for i in ids):
        return None  # the tokenizer does not have the tags as single tokens: no constraint
    banned = set(ids) | set(tok.all_special_ids)
    return _Tags(*ids, frozenset(banned))


class _Known:
    """Per tokenizer: the ids of each command text seen so far, and the free-text tokens. An episode
    sees the same commands turn after turn; tokenizing them again for every turn's constraint was
    most of its cost (and held the GIL the episode threads share)."""

    def __init__(self, tok):
        self.tok = tok
        self._ids: dict[str, tuple[int, ...]] = {}
        self._free: dict[tuple, list[int]] = {}
        self._masks: dict[tuple, object] = {}
        self._lock = threading.Lock()

    def ids(self, text: str) -> list[int]:
        got = self._ids.get(text)
        if got is None:
            got = tuple(self.tok(text, add_special_tokens=False)["input_ids"])
            with self._lock:
                if len(self._ids) > 200_000:  # commands only, but a long-lived process must not grow without bound
                    self._ids.clear()
                self._ids[text] = got
        return list(got)

    def free(self, vocab: int, banned: frozenset[int]) -> list[int]:
        key = (vocab, banned)
        got = self._free.get(key)
        if got is None:
            got = self._free.setdefault(key, [i for i in range(vocab) if i not in banned])
        return got

    def free_mask(self, vocab: int, banned: frozenset[int], plus: int):
        """The free-text tokens and ``plus`` as a bool tensor; callers copy it, never write to it."""
        key = (vocab, banned, plus)
        got = self._masks.get(key)
        if got is None:
            import torch

            got = torch.zeros(vocab, dtype=torch.bool)
            got[self.free(vocab, banned) + [plus]] = True
            got = self._masks.setdefault(key, got)
        return got


_KNOWN: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_KNOWN_LOCK = threading.Lock()


def _known(tok) -> _Known:
    k = _KNOWN.get(tok)
    if k is None:
        with _KNOWN_LOCK:
            k = _KNOWN.get(tok) or _KNOWN.setdefault(tok, _Known(tok))
    return k


class Trie:
    def __init__(self):
        self.children: dict[int, Trie] = {}
        self.end = False

    def add(self, ids: list[int]) -> None:
        node = self
        for i in ids:
            node = node.children.setdefault(i, Trie())
        node.end = True

    def walk(self, ids: list[int]) -> "Trie | None":
        node = self
        for i in ids:
            node = node.children.get(i)
            if node is None:
                return None
        return node


class ActionConstraint:
    """``allowed(generated)``: the token ids allowed after the response's ``generated`` ids.

    ``after`` is the action of the turn before: a meta-verb may not follow itself (its answer is on
    screen; asking again is the spam the reward penalises, and the teacher never does it), so a
    greedy policy cannot loop on ``track X; track X; ...``."""

    def __init__(self, tok, admissible: tuple[str, ...], verbs: tuple[str, ...], budget: int = 1 << 30, after: str = ""):
        self.tags = _tags(tok)
        self.budget = budget  # max new tokens: the think is closed early enough to leave room for an action
        self.vocab = len(tok)
        self.trie = Trie()
        self.longest = 1
        self.verb_ids: set[int] = set()
        if self.tags is None:
            return
        unk = tok.unk_token_id
        known = self._known = _known(tok)
        for cmd in admissible:
            ids = known.ids(cmd)
            if ids and unk not in ids:  # a command with a word the tokenizer lacks cannot be written
                self.trie.add(ids)
                self.longest = max(self.longest, len(ids))
        repeat = after.split(" ", 1)[0] if after else ""
        for v in verbs:
            ids = known.ids(v)
            if len(ids) == 1 and ids[0] != unk and v != repeat:
                self.verb_ids.add(ids[0])
        self.free = known.free(self.vocab, self.tags.banned)

    @property
    def active(self) -> bool:
        return self.tags is not None and (bool(self.trie.children) or bool(self.verb_ids))

    def allowed(self, generated: list[int]) -> list[int]:
        free, ids = self._next(generated)
        return self.free + ids if free else ids

    def mask(self, generated: list[int]):
        """``allowed`` as a bool tensor over the vocabulary (free text's masks are built once per tokenizer)."""
        free, ids = self._next(generated)
        if free:
            return self._known.free_mask(self.vocab, self.tags.banned, ids[0])
        import torch

        m = torch.zeros(self.vocab, dtype=torch.bool)
        m[ids] = True
        return m

    def _next(self, generated: list[int]) -> tuple[bool, list[int]]:
        """(free, ids): the allowed ids are ``ids``, plus every free-text token when ``free``."""
        t = self.tags
        if not generated:
            return False, [t.think]
        if t.end_think not in generated:
            n = len(generated) - 1
            close = n >= MAX_THINK or len(generated) + 3 + self.longest >= self.budget
            return (False, [t.end_think]) if close else (True, [t.end_think])
        k = generated.index(t.end_think)
        after = generated[k + 1 :]
        if not after:
            return False, [t.action]
        action = after[1:]
        if not action:
            return False, sorted(set(self.trie.children) | self.verb_ids)
        if action[0] in self.verb_ids:
            close = len(action) > MAX_ARG or len(generated) + 1 >= self.budget
            return (False, [t.end_action]) if close else (True, [t.end_action])
        node = self.trie.walk(action)
        if node is None:  # cannot happen under the constraint; end the action
            return False, [t.end_action]
        out = list(node.children)
        if node.end:
            out.append(t.end_action)
        return False, out or [t.end_action]


def prefix_fn(tok, admissible, verbs, prompt_len: int, budget: int = 1 << 30, after: str = ""):
    """A ``prefix_allowed_tokens_fn`` for ``model.generate`` (one sequence), or None when the
    tokenizer has no tags to constrain with."""
    c = ActionConstraint(tok, tuple(admissible), tuple(verbs), budget, after)
    if not c.active:
        return None

    def fn(batch_id, input_ids):
        return c.allowed(input_ids[prompt_len:].tolist())

    return fn
