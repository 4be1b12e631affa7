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
    """The reply's tags as token sequences: one token each in the tiny tokenizer, several in a pretrained
    one that lacks them (Qwen3 has ``<think>`` and ``</think>`` but splits ``<action>`` into ``<``,
    ``action``, ``>``). ``sep`` is what the teacher writes between ``</think>`` and ``<action>`` (a newline)
    where the tokenizer keeps whitespace, else nothing."""

    think: tuple[int, ...]
    end_think: tuple[int, ...]
    sep: tuple[int, ...]
    action: tuple[int, ...]
    end_action: tuple[int, ...]
    eos: int
    banned: frozenset[int]  # never inside free text: special tokens, one-token tags, each closing tag's first token
    exact: bool  # the tokenizer decodes to exactly the text (byte-level, whitespace kept), as Qwen3's does


def _encode_exact(tok, text: str) -> tuple[int, ...] | None:
    """``text`` as one token if the tokenizer has it, else its tokens, when they decode back to exactly
    ``text``; None when the tokenizer cannot write it (an unknown word, or whitespace it drops)."""
    one = tok.convert_tokens_to_ids(text)
    if isinstance(one, int) and one != tok.unk_token_id and one is not None:
        return (one,)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    if not ids or tok.unk_token_id in ids or tok.decode(ids) != text:
        return None
    return tuple(ids)


def _tags(tok) -> _Tags | None:
    seqs = [_encode_exact(tok, t) for t in ("<think>", "</think>", "<action>", "</action>")]
    if any(x is None for x in seqs) or tok.eos_token_id is None:
        return None  # the tokenizer cannot write the format: no constraint (the caller says so)
    sep = _encode_exact(tok, "\n") or ()
    think, end_think, action, end_action = seqs
    banned = set(tok.all_special_ids) | {x[0] for x in (end_think, end_action)}
    banned |= {x[0] for x in (think, action) if len(x) == 1}
    return _Tags(think, end_think, sep, action, end_action, tok.eos_token_id, frozenset(banned), exact=bool(sep))


def tags_as_tokens(tok) -> bool:
    """Whether the tokenizer has ``<action>`` and ``</action>`` as single tokens (the tiny one does, Qwen3's not)."""
    return all(isinstance(i, int) and i is not None and i != tok.unk_token_id for i in tok.convert_tokens_to_ids(["<action>", "</action>"]))


class _Known:
    """Per tokenizer: the ids of each command text seen so far, and the free-text tokens. An episode
    sees the same commands turn after turn; tokenizing them again for every turn's constraint was
    most of its cost (and held the GIL the episode threads share)."""

    def __init__(self, tok):
        self.tok = tok
        self._ids: dict[str, tuple[int, ...]] = {}
        self._free: dict[tuple, list[int]] = {}
        self._masks: dict[tuple, object] = {}
        self._texts: list[str] | None = None
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

    def texts(self, vocab: int) -> list[str]:
        """Each token's own text (decoded alone), once per tokenizer."""
        got = self._texts
        if got is None or len(got) != vocab:
            got = self._texts = [self.tok.decode([i]) for i in range(vocab)]
        return got

    def angled(self, vocab: int) -> frozenset[int]:
        """Tokens whose text holds ``<``: in a tokenizer that writes text exactly, free text with one of them
        could spell a second tag (``<action`` then ``>``), so free text never has them (as ``[^<]`` in
        ``batched.action_regex``)."""
        key = ("angled", vocab)
        got = self._free.get(key)
        if got is None:
            got = self._free.setdefault(key, frozenset(i for i, t in enumerate(self.texts(vocab)) if "<" in t))
        return got

    def banned(self, vocab: int, tags: "_Tags") -> frozenset[int]:
        """What free text may not hold: the tags' tokens, and with an exact tokenizer every token with ``<``
        (one object per tokenizer, so the masks' cache finds it by identity)."""
        key = ("banned", vocab, tags.banned)
        got = self._free.get(key)
        if got is None:
            got = self._free.setdefault(key, tags.banned | self.angled(vocab) if tags.exact else tags.banned)
        return got

    def lead(self, vocab: int, banned: frozenset[int]) -> list[int]:
        """Free tokens that begin with a space: a meta-verb's argument starts with one (``track apple``)."""
        key = ("lead", vocab, banned)
        got = self._free.get(key)
        if got is None:
            texts = self.texts(vocab)
            got = self._free.setdefault(key, [i for i in self.free(vocab, banned) if texts[i][:1] == " " and texts[i].strip()])
        return got

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
    """Token paths of the admissible commands (``end``: a whole command) and the meta-verbs (``verb``: a
    verb, after which a free argument follows)."""

    def __init__(self):
        self.children: dict[int, Trie] = {}
        self.end = False
        self.verb = False

    def add(self, ids: list[int], verb: bool = False) -> None:
        node = self
        for i in ids:
            node = node.children.setdefault(i, Trie())
        if verb:
            node.verb = True
        else:
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

    A token-level grammar: the tags (forced token by token when the tokenizer splits them), free
    thought text, then an admissible command's exact tokens or a meta-verb's followed by a free
    argument, the closing tag and the end of turn.

    ``after`` is the action of the turn before: a meta-verb may not follow itself (its answer is on
    screen; asking again is the spam the reward penalises, and the teacher never does it), so a
    greedy policy cannot loop on ``track X; track X; ...``."""

    def __init__(self, tok, admissible: tuple[str, ...], verbs: tuple[str, ...], budget: int = 1 << 30, after: str = ""):
        self.tags = _tags(tok)
        if self.tags is None:  # decoding free instead would train and evaluate another distribution than asked for
            from evoharness.core.errors import PolicyError

            raise PolicyError(f"constrained decoding: the tokenizer ({type(tok).__name__}, {len(tok)} tokens) cannot write the reply's "
                              "tags <think> </think> <action> </action> exactly; use a tokenizer that can, or decoding: free")
        self.budget = budget  # max new tokens: the think is closed early enough to leave room for an action
        self.vocab = len(tok)
        self.trie = Trie()
        self.longest = 1
        self.verbs = 0
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
            if ids and unk not in ids and v != repeat:
                self.trie.add(ids, verb=True)
                self.verbs += 1
        t = self.tags
        self.banned = known.banned(self.vocab, t)
        self.free = known.free(self.vocab, self.banned)
        self._tail = len(t.end_think) + len(t.sep) + len(t.action) + len(t.end_action)  # tokens after the thought, the action aside

    @property
    def active(self) -> bool:
        return bool(self.trie.children)

    def allowed(self, generated: list[int]) -> list[int]:
        free, ids = self._next(generated)
        return self.free + ids if free else ids

    def mask(self, generated: list[int]):
        """``allowed`` as a bool tensor over the vocabulary (free text's masks are built once per tokenizer)."""
        free, ids = self._next(generated)
        if free:
            return self._known.free_mask(self.vocab, self.banned, ids[0])
        import torch

        m = torch.zeros(self.vocab, dtype=torch.bool)
        m[ids] = True
        return m

    @staticmethod
    def _through(generated: list[int], pos: int, seq: tuple[int, ...]):
        """Past the forced sequence ``seq`` written from ``pos``: its end position, or the list of the one
        token that comes next while it is being written."""
        written = len(generated) - pos
        if written < len(seq):
            return [seq[written]]
        return pos + len(seq)

    def _next(self, generated: list[int]) -> tuple[bool, list[int]]:
        """(free, ids): the allowed ids are ``ids``, plus every free-text token when ``free``."""
        t = self.tags
        pos = self._through(generated, 0, t.think)
        if isinstance(pos, list):
            return False, pos
        close = t.end_think[0]
        try:
            pos = generated.index(close, pos)
        except ValueError:  # still thinking
            n = len(generated) - len(t.think)
            stop = n >= MAX_THINK or len(generated) + self._tail + self.longest >= self.budget
            return (False, [close]) if stop else (True, [close])
        for seq in (t.end_think, t.sep, t.action):
            pos = self._through(generated, pos, seq)
            if isinstance(pos, list):
                return False, pos
        node, body = self.trie, generated[pos:]
        k = 0
        while k < len(body) and not node.verb:
            nxt = node.children.get(body[k])
            if nxt is None:
                break
            node, k = nxt, k + 1
        rest, end = body[k:], t.end_action
        if node.verb:  # a meta-verb's free argument, then the closing tag
            try:
                j = rest.index(end[0])
            except ValueError:
                stop = k + len(rest) > MAX_ARG or len(generated) + len(end) >= self.budget  # MAX_ARG counts the verb too
                if stop:
                    return False, [end[0]]
                if t.exact and not rest:  # the argument's first word, after a space
                    return False, self._known.lead(self.vocab, self.banned) + [end[0]]
                return True, [end[0]]
            rest = rest[j:]
        elif not rest:
            out = list(node.children) + ([end[0]] if node.end else [])
            return False, out or [end[0]]
        if rest[0] != end[0]:  # cannot happen under the constraint; end the action
            return False, [end[0]]
        pos = self._through(rest, 0, end)
        return (False, pos) if isinstance(pos, list) else (False, [t.eos])


def prefix_fn(tok, admissible, verbs, prompt_len: int, budget: int = 1 << 30, after: str = ""):
    """A ``prefix_allowed_tokens_fn`` for ``model.generate`` (one sequence), or None when there is no
    command or verb to constrain to."""
    c = ActionConstraint(tok, tuple(admissible), tuple(verbs), budget, after)
    if not c.active:
        return None

    def fn(batch_id, input_ids):
        return c.allowed(input_ids[prompt_len:].tolist())

    return fn
