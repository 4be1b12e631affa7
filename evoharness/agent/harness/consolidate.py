"""Consolidation between batches: turn a batch's evidence into Experience edits.

Offline the consolidator is rule-based; when an endpoint is configured (``make_consolidator``: any
OpenAI-compatible server, or the local student) the LLM proposes the edits instead. Its reply is untrusted
input: ``parse_edits`` bounds and shape-checks it, and ``Experience.apply`` checks every edit against the bank
(ids exist, the caps, the usage veto). Either way the bank's update counter moves once per call.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict

from evoharness.agent.harness.belief import object_type
from evoharness.agent.harness.experience import CATEGORIES, Experience, _tokens, priority_counts

FAMILY_RECIPES = {
    "pick_and_place_simple": "find the {obj}, take it, go to the {recep}, move it there.",
    "look_at_obj_in_light": "find the {obj}, take it, find the {toggle}, use the {toggle} while holding the {obj}.",
    "pick_clean_then_place_in_recep": "find the {obj}, take it, clean it with the sinkbasin, go to the {recep}, move it there.",
    "pick_heat_then_place_in_recep": "find the {obj}, take it, heat it with the microwave, go to the {recep}, move it there.",
    "pick_cool_then_place_in_recep": "find the {obj}, take it, cool it with the fridge, go to the {recep}, move it there.",
    "pick_two_obj_and_place": "find one {obj}, take it, move it to the {recep}; then find a second {obj} and do the same.",
}


def _similar(a: str, b: str) -> float:
    ta, tb = _tokens(a), _tokens(b)
    return len(ta & tb) / max(len(ta | tb), 1)


def evidence_of(trajectories: list[dict]) -> list[dict]:
    """The part of each trajectory record that consolidation reads (no prompts)."""
    ev = []
    for t in trajectories:
        if t.get("error"):
            continue
        ev.append(
            {
                "family": t["family"],
                "won": t["outcome"]["won"],
                "steps": t["outcome"]["steps"],
                "target": t.get("target", {}),
                "found_in": t.get("found_in"),
                "notes": t.get("notes", []),
                "recalled": t.get("recalled", []),
                "invalid_actions": [x["action"] for x in t.get("turns", []) if not x["valid"] and x.get("action")][:5],
            }
        )
    return ev


def rule_edits(bank: Experience, evidence: list[dict]) -> list[dict]:
    edits: list[dict] = []
    # Search priorities: object type -> receptacle types it was found in, most frequent first.
    found: dict[str, Counter] = defaultdict(Counter)
    for e in evidence:
        obj = e["target"].get("object", "")
        if e["won"] and e.get("found_in") and obj:
            found[obj][object_type(e["found_in"])] += 1
    for obj, counts in sorted(found.items()):
        existing = next((x for x in bank.by_category("search_priorities") if x.key == obj), None)
        if existing is not None:
            prior = Counter(priority_counts(existing.text))
            prior.update(counts)
            counts = prior
        text = f"{obj} is usually in: " + ", ".join(f"{r} ({n})" for r, n in counts.most_common(4))
        if existing is None:
            edits.append({"op": "add", "category": "search_priorities", "key": obj, "text": text, "support": sum(counts.values())})
        elif existing.text != text:
            edits.append({"op": "update", "id": existing.id, "text": text, "support": 1})
    # Task skills: one recipe per family that has been won at least once.
    for fam in sorted({e["family"] for e in evidence if e["won"]}):
        if not any(x.key == fam for x in bank.by_category("task_skills")):
            ex = next(e for e in evidence if e["won"] and e["family"] == fam)
            t = ex["target"]
            recipe = FAMILY_RECIPES[fam].format(obj=t.get("object", "object"), recep=t.get("receptacle", "receptacle"), toggle=t.get("toggle", "lamp"))
            edits.append({"op": "add", "category": "task_skills", "key": fam, "text": f"{fam.replace('_', ' ')}: {recipe}"})
    # Mistakes: failures that ran out of budget, and invalid commands.
    for fam, n in sorted(Counter(e["family"] for e in evidence if not e["won"]).items()):
        key = f"budget:{fam}"
        text = f"{fam.replace('_', ' ')}: {n} episode(s) ran out of steps; check unvisited likely receptacles first and do not revisit."
        existing = next((x for x in bank.by_category("mistakes") if x.key == key), None)
        edits.append({"op": "add", "category": "mistakes", "key": key, "text": text} if existing is None else {"op": "update", "id": existing.id, "text": existing.text})
    # Notes: merge near-duplicates into an existing note, add the rest.
    seen_new: list[str] = []
    for e in evidence:
        for note in e["notes"]:
            note = " ".join(note.split())[:200]
            if not note or any(_similar(note, s) >= 0.6 for s in seen_new):
                continue
            seen_new.append(note)
            dup = [x for x in bank.by_category("notes") if _similar(x.text, note) >= 0.6]
            if len(dup) >= 2:
                edits.append({"op": "merge", "ids": [d.id for d in dup], "text": note})
            elif dup:
                edits.append({"op": "update", "id": dup[0].id, "text": note})
            else:
                edits.append({"op": "add", "category": "notes", "key": "", "text": note})
    # Delete notes that have never been recalled and are superseded by a search priority.
    prios = " ".join(x.text for x in bank.by_category("search_priorities"))
    for x in bank.by_category("notes"):
        if x.uses == 0 and x.support <= 1 and x.updated + 3 <= bank.updates and _similar(x.text, prios) > 0.3:
            edits.append({"op": "delete", "id": x.id})
    return edits


MAX_REPLY_CHARS = 32_000  # a consolidator's reply: a few dozen short edits
MAX_EDITS = 32  # per consolidation
MAX_TEXT = 240  # characters of one entry: the text reaches every later prompt that recalls it
_FIELDS = {"add": {"op", "category", "key", "text", "support"}, "update": {"op", "id", "text", "support"},
           "merge": {"op", "ids", "text", "support"}, "delete": {"op", "id"}}


class ReplyError(ValueError):
    """A consolidator's reply that is not a list of well-formed edits: nothing of it is applied."""


def _plain(v, what: str, limit: int = MAX_TEXT) -> str:
    if not isinstance(v, str) or len(v) > limit or any(ord(ch) < 32 for ch in v):
        raise ReplyError(f"{what} must be one line of text of at most {limit} characters (got {str(v)[:40]!r})")
    return v.strip()


def parse_edits(text: str) -> list[dict]:
    """The edits of a consolidator's reply, checked for shape only (``Experience.apply`` checks them against the
    bank: ids exist, caps, the usage veto). The reply is untrusted: it must be a JSON list (bare, or the one
    fenced block) of at most ``MAX_EDITS`` objects whose op is add, update, merge or delete with that op's
    fields only, typed and bounded; anything else raises ``ReplyError`` and nothing is applied."""
    if not isinstance(text, str) or len(text) > MAX_REPLY_CHARS:
        raise ReplyError(f"the reply is {len(text) if isinstance(text, str) else type(text).__name__} characters, over {MAX_REPLY_CHARS}")
    body = text.strip()
    m = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, re.S)
    if m:
        body = m.group(1)
    try:
        edits = json.loads(body)
    except ValueError as e:
        raise ReplyError(f"the reply is not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(edits, list):
        raise ReplyError(f"the reply is a JSON {type(edits).__name__}, not a list of edits")
    if len(edits) > MAX_EDITS:
        raise ReplyError(f"the reply has {len(edits)} edits, over {MAX_EDITS}")
    out = []
    for i, ed in enumerate(edits):
        if not isinstance(ed, dict) or ed.get("op") not in _FIELDS:
            raise ReplyError(f"edit {i} is not an object with op add|update|merge|delete ({str(ed)[:60]!r})")
        extra = set(ed) - _FIELDS[ed["op"]]
        if extra:
            raise ReplyError(f"edit {i} ({ed['op']}) has fields it may not have: {sorted(extra)}")
        clean = {"op": ed["op"]}
        if "support" in ed:
            if not isinstance(ed["support"], int) or isinstance(ed["support"], bool) or not 1 <= ed["support"] <= 100:
                raise ReplyError(f"edit {i}: support must be a whole number from 1 to 100 (got {ed['support']!r})")
            clean["support"] = ed["support"]
        if ed["op"] == "add":
            if ed.get("category") not in CATEGORIES:
                raise ReplyError(f"edit {i}: category must be one of {', '.join(CATEGORIES)} (got {str(ed.get('category'))[:40]!r})")
            clean.update(category=ed["category"], key=_plain(ed.get("key", ""), f"edit {i}'s key", 64), text=_plain(ed.get("text"), f"edit {i}'s text"))
        if ed["op"] in ("update", "delete"):
            clean["id"] = _plain(ed.get("id"), f"edit {i}'s id", 16)
        if ed["op"] == "merge":
            ids = ed.get("ids")
            if not isinstance(ids, list) or not 2 <= len(ids) <= 8:
                raise ReplyError(f"edit {i}: merge needs a list of 2 to 8 ids")
            clean["ids"] = [_plain(x, f"edit {i}'s id", 16) for x in ids]
        if ed["op"] in ("update", "merge") and "text" in ed:
            clean["text"] = _plain(ed["text"], f"edit {i}'s text")
        if ed["op"] in ("add", "update", "merge") and "text" in clean and not clean["text"]:
            raise ReplyError(f"edit {i}: empty text")
        out.append(clean)
    return out


def llm_prompt(bank: Experience, evidence: list[dict]) -> str:
    return (
        "You maintain an agent's experience bank for ALFWorld household tasks. Categories: "
        + ", ".join(CATEGORIES)
        + f". Propose at most {MAX_EDITS} edits as a JSON list of objects with op in add|update|merge|delete "
        "(add: category, key, text; update: id, text; merge: ids, text; delete: id). "
        f"Keep each text under {MAX_TEXT} characters and general. Answer with the JSON list only.\n"
        f"BANK: {json.dumps(bank.to_json()['entries'])}\nEVIDENCE: {json.dumps(evidence)}"
    )


def llm_edits(bank: Experience, evidence: list[dict], endpoint) -> list[dict]:
    """Ask a consolidator (anything with ``complete(prompt) -> str``: an OpenAI-compatible endpoint, the local
    student) for edits. Raises ``ReplyError`` for a malformed reply, ``PolicyError`` for an endpoint that failed."""
    return parse_edits(endpoint.complete(llm_prompt(bank, evidence)))


def consolidate(bank: Experience, trajectories: list[dict], endpoint=None, warn=None) -> list[dict]:
    """Apply a batch's evidence to the bank; returns the edit log. Usage counts land here too (they are what the
    batch observed, whatever the consolidator says). With an endpoint its edits are used; a reply that is
    malformed, or an endpoint that fails, leaves the entries unchanged, with a warning and one log line."""
    from evoharness.core.errors import PolicyError

    bank.record_uses([i for t in trajectories for i in t.get("recalled", [])])
    evidence = evidence_of(trajectories)
    if endpoint is None:
        log = bank.apply(rule_edits(bank, evidence))
    else:
        try:
            log = bank.apply(llm_edits(bank, evidence, endpoint))
        except (ReplyError, PolicyError) as e:
            why = f"consolidator reply refused, bank unchanged: {e}"
            (warn or _warn)(why)
            log = [{"op": "none", "result": f"rejected: {why}"[:300]}]
    bank.updates += 1
    return log


def _warn(msg: str) -> None:
    import warnings

    warnings.warn(msg, stacklevel=3)


def make_consolidator(spec: str | None):
    """``rules`` (or none): the rule-based consolidator. ``chat:base_url=...,model=...[,api_key_env=...]``: any
    OpenAI-compatible endpoint. ``hf:path=<checkpoint>``: a local model (the student) through the same interface."""
    if spec in (None, "", "rules"):
        return None
    from evoharness.agent.policies.spec import parse_policy

    ps = parse_policy(spec)
    if ps.kind == "chat":
        from evoharness.agent.policies.chat import ChatEndpoint

        return ChatEndpoint(ps.base_url, ps.model, ps.api_key_env, temperature=ps.temperature if ps.sample else 0.0, max_tokens=max(ps.max_new_tokens, 1024))
    if ps.kind == "hf":
        return LocalEndpoint(ps.path, max_new_tokens=max(ps.max_new_tokens, 512))
    from evoharness.core.errors import EvoError

    raise EvoError(f"consolidator {spec!r}: expected rules, chat:base_url=...,model=... or hf:path=...")


class LocalEndpoint:
    """A local Hugging Face checkpoint answering ``complete(prompt)`` greedily (the student as its own consolidator)."""

    def __init__(self, path: str, max_new_tokens: int = 512):
        self.path, self.max_new_tokens = path, max_new_tokens
        self._model = self._tok = None

    def complete(self, prompt: str) -> str:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from evoharness.agent.training.checkpoint import resolve_checkpoint
        from evoharness.core.errors import PolicyError

        if self._model is None:
            try:
                p = resolve_checkpoint(self.path)
                self._tok = AutoTokenizer.from_pretrained(p)
                self._model = AutoModelForCausalLM.from_pretrained(p).eval()
            except Exception as e:  # noqa: BLE001 -- a checkpoint that does not load is the endpoint failing
                raise PolicyError(f"consolidator checkpoint {self.path} does not load ({type(e).__name__})") from None
        limit = getattr(self._model.config, "max_position_embeddings", 1024) - self.max_new_tokens
        ids = self._tok(prompt, return_tensors="pt").input_ids[:, -max(limit, 16):]
        with torch.no_grad():
            out = self._model.generate(ids, max_new_tokens=self.max_new_tokens, do_sample=False, pad_token_id=self._tok.eos_token_id)
        return self._tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
