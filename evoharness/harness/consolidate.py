"""Consolidation between batches: turn a batch's evidence into Experience edits.

Offline the consolidator is rule-based; when an OpenAI-compatible endpoint is configured the
LLM proposes the edits instead. Either way the edits go through ``Experience.apply``, which
enforces the caps and the usage veto, and the bank's update counter moves once per call.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict

from evoharness.harness.belief import object_type
from evoharness.harness.experience import CATEGORIES, Experience, _tokens, priority_counts

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


def llm_edits(bank: Experience, evidence: list[dict], endpoint) -> list[dict]:
    """Ask an OpenAI-compatible endpoint for edits; it answers a JSON list."""
    prompt = (
        "You maintain an agent's experience bank for ALFWorld household tasks. Categories: "
        + ", ".join(CATEGORIES)
        + ". Propose edits as a JSON list of objects with op in add|update|merge|delete "
        "(add: category, key, text; update: id, text; merge: ids, text; delete: id). "
        "Keep entries short and general. Answer with the JSON list only.\n"
        f"BANK: {json.dumps(bank.to_json()['entries'])}\nEVIDENCE: {json.dumps(evidence)}"
    )
    text = endpoint.complete(prompt)
    m = re.search(r"\[.*\]", text, re.S)
    try:
        edits = json.loads(m.group(0)) if m else []
    except ValueError:
        edits = []
    return [e for e in edits if isinstance(e, dict)]


def consolidate(bank: Experience, trajectories: list[dict], endpoint=None) -> list[dict]:
    """Apply a batch's evidence to the bank; returns the edit log. Usage counts land here too."""
    bank.record_uses([i for t in trajectories for i in t.get("recalled", [])])
    evidence = evidence_of(trajectories)
    edits = llm_edits(bank, evidence, endpoint) if endpoint is not None else rule_edits(bank, evidence)
    log = bank.apply(edits)
    bank.updates += 1
    return log
