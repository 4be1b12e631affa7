"""Experience: a bank of entries that persists across episodes and runs, read by ``recall``.

Five categories; ``recall`` routes a query by intent (where / how / mistakes) and returns the
top 3. The bank is read-only while a batch runs: recalls and ``note`` evidence are recorded in
the episode's trace, and ``consolidate`` applies add / update / merge / delete edits between
batches, with at most ``MAX_PER_CATEGORY`` entries per category and a usage veto (an entry
recalled ``USAGE_VETO`` or more times is never deleted). The update counter lives in the bank.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from evoharness.core.errors import EvoError

CATEGORIES = ("general_skills", "task_skills", "mistakes", "search_priorities", "notes")
MAX_PER_CATEGORY = 80
USAGE_VETO = 3
TOP_K = 3

# Intent routing: the words of a query that say which categories can answer it.
INTENTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "mistakes": (("mistake", "mistakes", "avoid", "wrong", "fail", "failed", "error", "stuck"), ("mistakes",)),
    "where": (("where", "find", "locate", "search", "look", "usually", "likely"), ("search_priorities", "notes")),
    "how": (("how", "steps", "step", "plan", "do", "procedure", "skill"), ("task_skills", "general_skills")),
}
_STOP = {"a", "an", "the", "is", "are", "to", "in", "on", "of", "and", "it", "i", "my", "for", "with", "what", "some"}


def _tokens(text: str) -> set[str]:
    return {re.sub(r"s$", "", w) for w in re.findall(r"[a-z]+", text.lower()) if w not in _STOP}


def priority_counts(text: str) -> dict[str, int]:
    """``apple is usually in: fridge (3), countertop (1)`` -> {"fridge": 3, "countertop": 1}."""
    return {r: int(n) for r, n in re.findall(r"(\w+) \((\d+)\)", text)}


def route(query: str) -> tuple[str, tuple[str, ...]]:
    words = set(re.findall(r"[a-z]+", query.lower()))
    for intent, (cues, cats) in INTENTS.items():
        if words & set(cues):
            return intent, cats
    return "any", CATEGORIES


@dataclass
class Entry:
    id: str
    category: str
    text: str
    key: str = ""  # what the entry is about: an object type, a family, a verb
    uses: int = 0  # times recalled (applied at consolidation)
    support: int = 1  # episodes of evidence behind it
    created: int = 0  # bank update counter when added
    updated: int = 0


SEED_ENTRIES = (
    ("general_skills", "", "go to a receptacle to see what is on it; open a closed receptacle to see inside."),
    ("general_skills", "", "take an object before cleaning, heating or cooling it; then go to the destination and move it there."),
    ("mistakes", "invalid", "only admissible commands work; copy one exactly, object numbers included."),
)


@dataclass
class Experience:
    entries: list[Entry] = field(default_factory=list)
    updates: int = 0
    next_id: int = 0

    # -- reading -----------------------------------------------------------------------
    def recall(self, query: str, key_hint: str = "") -> tuple[str, list[str]]:
        """Top-3 entries for a query, routed by intent; returns (text shown, entry ids)."""
        intent, cats = route(query)
        q = _tokens(query) | _tokens(key_hint)
        scored = []
        for e in self.entries:
            if e.category not in cats:
                continue
            overlap = len(q & (_tokens(e.text) | _tokens(e.key)))
            if overlap == 0 and intent == "any":
                continue
            scored.append((-overlap, -e.support, -e.uses, e.id, e))
        scored.sort(key=lambda t: t[:4])
        top = [t[-1] for t in scored[:TOP_K] if t[0] < 0 or intent != "any"]
        if not top:
            return f"no {intent} experience yet", []
        return " | ".join(e.text for e in top), [e.id for e in top]

    def where_counts(self, query: str) -> dict[str, int]:
        """Receptacle type -> times found, from the search priority of the first object type
        named in ``query`` that has one ({} when none does)."""
        words = re.findall(r"[a-z]+", query.lower())
        prio = {e.key: e for e in self.by_category("search_priorities")}
        for w in words:
            if w in prio:
                return priority_counts(prio[w].text)
        return {}

    def by_category(self, cat: str) -> list[Entry]:
        return [e for e in self.entries if e.category == cat]

    def get(self, eid: str) -> Entry | None:
        return next((e for e in self.entries if e.id == eid), None)

    # -- persistence -------------------------------------------------------------------
    @classmethod
    def seeded(cls) -> "Experience":
        bank = cls()
        for cat, key, text in SEED_ENTRIES:
            bank._add(cat, text, key)
        return bank

    def to_json(self) -> dict:
        return {"updates": self.updates, "next_id": self.next_id, "entries": [asdict(e) for e in self.entries]}

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        tmp.replace(path)  # atomic: a crash mid-write never leaves half a bank

    @classmethod
    def from_json(cls, data: dict) -> "Experience":
        """The inverse of ``to_json``; raises ValueError/KeyError/TypeError on a malformed document."""
        bank = cls(updates=int(data["updates"]), next_id=int(data["next_id"]))
        for raw in data["entries"]:
            e = Entry(**raw)
            if e.category not in CATEGORIES:
                raise ValueError(f"unknown category {e.category!r}")
            bank.entries.append(e)
        return bank

    @classmethod
    def load(cls, path: str | Path) -> "Experience":
        path = Path(path)
        try:
            bank = cls.from_json(json.loads(path.read_text()))
        except FileNotFoundError:
            raise EvoError(f"experience bank {path} does not exist") from None
        except (ValueError, KeyError, TypeError) as e:
            raise EvoError(f"experience bank {path}: malformed ({e})") from None
        return bank

    @classmethod
    def load_or_seed(cls, path: str | Path | None) -> "Experience":
        """The bank at ``path``; the seed bank only when no path is given (a mistyped one is an error)."""
        if path is not None:
            return cls.load(path)
        return cls.seeded()

    # -- editing (between batches only) ----------------------------------------------------
    def _add(self, category: str, text: str, key: str = "", support: int = 1) -> Entry:
        e = Entry(f"e{self.next_id}", category, text, key, 0, support, self.updates, self.updates)
        self.next_id += 1
        self.entries.append(e)
        return e

    def apply(self, edits: list[dict]) -> list[dict]:
        """Apply edits (add / update / merge / delete); return what was applied, vetoed or rejected.
        An edit an LLM got wrong (a non-numeric support, a merge naming one entry twice) is rejected
        with its reason, never applied halfway and never a crash."""
        log = []
        for ed in edits:
            op = ed.get("op")
            cat = ed.get("category")
            try:
                support = int(ed.get("support", 1))
            except (TypeError, ValueError):
                log.append({**ed, "result": f"rejected: support {ed.get('support')!r} is not a number"})
                continue
            if op == "add":
                if cat not in CATEGORIES or not str(ed.get("text", "")).strip():
                    log.append({**ed, "result": "rejected: bad category or empty text"})
                    continue
                if len(self.by_category(cat)) >= MAX_PER_CATEGORY and not self._evict(cat, log):
                    log.append({**ed, "result": "vetoed: category full and every entry in use"})
                    continue
                e = self._add(cat, str(ed["text"]).strip(), str(ed.get("key", "")), support)
                log.append({"op": "add", "category": cat, "id": e.id, "text": e.text, "result": "applied"})
            elif op == "update":
                e = self.get(str(ed.get("id")))
                if e is None:
                    log.append({**ed, "result": "rejected: no such entry"})
                    continue
                e.text = str(ed.get("text", e.text)).strip() or e.text
                e.support += support
                e.updated = self.updates
                log.append({"op": "update", "category": e.category, "id": e.id, "text": e.text, "result": "applied"})
            elif op == "merge":
                ids = list(dict.fromkeys(str(i) for i in ed.get("ids", [])))  # ["e0", "e0"] would merge e0 away into itself
                found = [self.get(i) for i in ids]
                if len(ids) < 2 or any(f is None for f in found) or len({f.category for f in found}) != 1:
                    log.append({**ed, "result": "rejected: merge needs 2+ entries of one category"})
                    continue
                keep, rest = found[0], found[1:]
                keep.text = str(ed.get("text", keep.text)).strip() or keep.text
                for r in rest:
                    keep.uses += r.uses
                    keep.support += r.support
                    self.entries.remove(r)
                keep.updated = self.updates
                log.append({"op": "merge", "category": keep.category, "id": keep.id, "merged": [r.id for r in rest], "text": keep.text, "result": "applied"})
            elif op == "delete":
                e = self.get(str(ed.get("id")))
                if e is None:
                    log.append({**ed, "result": "rejected: no such entry"})
                elif e.uses >= USAGE_VETO:
                    log.append({"op": "delete", "category": e.category, "id": e.id, "result": f"vetoed: recalled {e.uses} times"})
                else:
                    self.entries.remove(e)
                    log.append({"op": "delete", "category": e.category, "id": e.id, "text": e.text, "result": "applied"})
            else:
                log.append({**ed, "result": f"rejected: unknown op {op!r}"})
        return log

    def _evict(self, cat: str, log: list[dict]) -> bool:
        cands = [e for e in self.by_category(cat) if e.uses < USAGE_VETO]
        if not cands:
            return False
        victim = min(cands, key=lambda e: (e.uses, e.support, e.updated, e.id))
        self.entries.remove(victim)
        log.append({"op": "delete", "category": cat, "id": victim.id, "text": victim.text, "result": "applied: evicted for room"})
        return True

    def record_uses(self, ids: list[str]) -> None:
        counts = Counter(ids)
        for e in self.entries:
            e.uses += counts.get(e.id, 0)
