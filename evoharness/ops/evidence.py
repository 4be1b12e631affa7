"""An evaluation as the promotion gate reads it: per-game outcomes and the conditions they were played under
(games, seeds, budgets, harness, decoding), and the paired statistics between two of them (McNemar's exact test)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from evoharness.core.errors import EvoError

CANDIDATE = "grpo-inline"  # the evaluate stage's label for the model the gate decides on


SPLITS = ("valid_seen", "valid_unseen")


EVIDENCE = "promotion/evidence.json"  # per-game outcomes and conditions, an artifact of the version's run


CONDITION_KEYS = ("games", "splits", "seeds", "max_steps", "max_turns", "mode", "charge_meta_actions", "decoding", "sampling", "max_new_tokens")


@dataclass
class Evidence:
    """One model's evaluation: per split its summary (per family and all) and the outcome of every
    episode (1 won, 0 not; an errored episode is 0), and the conditions it was evaluated under."""

    label: str
    summary: dict
    outcomes: dict[str, dict[str, int]]
    errored: int
    conditions: dict

    def rate(self, split: str) -> float:
        try:
            v = float(self.summary[split]["all"]["success"])
        except (KeyError, TypeError, ValueError):
            raise EvoError(f"promotion: {self.label} has no {split} success in its evaluation; re-run the evaluate stage") from None
        if not math.isfinite(v) or not 0 <= v <= 1:
            raise EvoError(f"promotion: {self.label}'s {split} success is {v!r}, not a rate; re-run the evaluate stage")
        return v

    @property
    def episodes(self) -> int:
        return sum(len(o) for o in self.outcomes.values())

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Evidence":
        return cls(d["label"], d["summary"], {s: dict(o) for s, o in d["outcomes"].items()}, int(d["errored"]), dict(d["conditions"]))


def evidence_from_dirs(label: str, split_dirs: dict[str, Path], games_md5: str) -> Evidence:
    """Read an evaluation (``<dir>/results.json`` and ``episodes.jsonl`` per split), failing closed."""
    from evoharness.agent.rollout import read_jsonl

    summary, outcomes, errored, conds = {}, {}, 0, []
    for split, d in split_dirs.items():
        try:
            res = json.loads((Path(d) / "results.json").read_text())
        except (OSError, ValueError) as e:
            raise EvoError(f"promotion: cannot read {label}'s {split} evaluation ({Path(d) / 'results.json'}: {type(e).__name__})") from None
        records, bad = read_jsonl(Path(d) / "episodes.jsonl")
        if bad or not records:
            raise EvoError(f"promotion: {Path(d) / 'episodes.jsonl'} has {len(bad)} unreadable line(s) and {len(records)} episodes")
        # evaluate() keeps the records of earlier evaluations in the same folder after its own: evidence mixed
        # with another model's episodes is refused, never read game by game
        played = res.get("games", 0) * len(res.get("seeds") or [])
        keys = {(r.get("game_id"), r.get("seed")) for r in records}
        if len(records) != played or len(keys) != len(records):
            raise EvoError(f"promotion: {Path(d) / 'episodes.jsonl'} holds {len(records)} episodes ({len(keys)} distinct game and seed pairs) "
                           f"where {Path(d) / 'results.json'} played {played}: episodes of another evaluation are in that folder")
        summary[split] = res.get("summary") or {}
        outcomes[split] = {f"{r['game_id']}#s{r['seed']}": int(bool(r.get("outcome", {}).get("won")) and not r.get("error")) for r in records}
        # the summary the thresholds read and the episodes the paired tests read must be one evaluation
        wins = sum(outcomes[split].values())
        total = (summary[split].get("all") or {}) if isinstance(summary[split], dict) else {}
        claimed = (total.get("wins"), total.get("episodes"), total.get("success"))
        if claimed != (wins, len(records), round(wins / len(records), 4)):
            raise EvoError(f"promotion: {Path(d) / 'results.json'} says {claimed[0]} wins of {claimed[1]} (success {claimed[2]}) but "
                           f"{Path(d) / 'episodes.jsonl'} holds {wins} wins of {len(records)}: the evidence contradicts itself; re-run the evaluation")
        errored += sum(bool(r.get("error")) for r in records)
        conds.append(conditions_of(res, records, games_md5))
    merged = dict(conds[0])
    merged["splits"] = ",".join(sorted(split_dirs))
    for c in conds[1:]:
        for k in CONDITION_KEYS:
            if k not in ("splits", "games") and c.get(k) != merged.get(k):
                raise EvoError(f"promotion: {label} was evaluated under different {k} on its splits ({merged.get(k)} / {c.get(k)})")
    merged["games"] = hashlib.sha256("|".join(c["games"] for c in conds).encode()).hexdigest()[:16]
    return Evidence(label, summary, outcomes, errored, merged)


def conditions_of(result: dict, records: list[dict], games_md5: str) -> dict:
    """The conditions an evaluation ran under, from its results.json: which games (their DVC hash and
    the ids played), seeds, budgets, harness mode, charged or free meta-actions, decoding."""
    cfg = result.get("episode_config") or {}
    h = cfg.get("harness") or {}
    fp = str(result.get("policy_fingerprint", ""))
    parts = fp.split(":")  # hf:v3:<weights>:<sample>:<temperature>:<max_new_tokens>:<decoding>[:<backend>]
    ids = sorted({r["game_id"] for r in records})
    return {
        "games": hashlib.sha256((games_md5 + "|" + "|".join(ids)).encode()).hexdigest()[:16],
        "splits": ",".join(result.get("split") or []),
        "seeds": ",".join(str(s) for s in result.get("seeds") or []),
        "max_steps": str(cfg.get("max_steps")),
        "max_turns": str(cfg.get("max_turns")),
        "mode": str(h.get("mode")) + ("+evolve" if result.get("bank_mode") == "evolve" else ""),  # an evolving bank is another condition
        "charge_meta_actions": str(h.get("charge_meta_actions")).lower(),
        "decoding": parts[6] if len(parts) > 6 else "n/a",
        "sampling": f"{parts[3]}:{parts[4]}" if len(parts) > 4 else "n/a",
        "max_new_tokens": parts[5] if len(parts) > 5 else "n/a",
    }


def condition_difference(a: dict, b: dict) -> str | None:
    diffs = [f"{k} {b.get(k)} (champion) vs {a.get(k)}" for k in CONDITION_KEYS if str(a.get(k)) != str(b.get(k))]
    return "; ".join(diffs) if diffs else None


def conditions_hash(c: dict) -> str:
    return hashlib.sha256(json.dumps({k: str(c.get(k)) for k in CONDITION_KEYS}, sort_keys=True).encode()).hexdigest()[:12]


def mcnemar_worse(cand: dict[str, int], champ: dict[str, int]) -> tuple[int, int, float]:
    """On the games both played: b = champion won and candidate lost, c = the reverse; the exact
    one-sided p-value that the candidate is worse, P(X >= b) with X ~ Binomial(b + c, 1/2)."""
    from evoharness.agent.evaluate import mcnemar_greater

    return mcnemar_greater(champ, cand)


def paired_wins(cand: Evidence, ref: Evidence) -> tuple[int, int, int]:
    """(candidate wins, reference wins, games) over both splits, on the games both played."""
    cw = rw = n = 0
    for split in SPLITS:
        a, b = cand.outcomes.get(split, {}), ref.outcomes.get(split, {})
        keys = a.keys() & b.keys()
        cw += sum(a[k] for k in keys)
        rw += sum(b[k] for k in keys)
        n += len(keys)
    return cw, rw, n


# What a reference evaluation (a baseline the candidate must beat or not regress against) shares with the
# candidate: the games and seeds (every game and seed the candidate played, the reference played too), the harness
# mode and meta-action charging, decoding where both are models; and a step and turn budget at least the
# candidate's (the baselines stage plays the episode budget, the evaluate stage the profile's eval budget: more
# steps can only help the reference, so a candidate that beats it under less still beats it).
REF_EQUAL_KEYS = ("splits", "seeds", "mode", "charge_meta_actions")


REF_BUDGET_KEYS = ("max_steps", "max_turns")


DECODING_KEYS = ("decoding", "sampling", "max_new_tokens")


def _budget(c: dict, key: str) -> float:
    try:
        steps = float(c.get("max_steps"))
        v = float(c.get(key))
    except (TypeError, ValueError):
        return float("nan")
    return (v or 2 * steps) if key == "max_turns" else v  # max_turns 0: twice max_steps (EpisodeConfig)


def check_reference_conditions(cand: Evidence, refs: dict[str, Evidence]) -> None:
    """A reference evaluated under conditions that favour the candidate compares nothing: refused in one line."""
    for label, ref in refs.items():
        keys = list(REF_EQUAL_KEYS)
        if all(ref.conditions.get(k, "n/a") != "n/a" for k in DECODING_KEYS):
            keys += DECODING_KEYS
        diffs = [f"{k} {ref.conditions.get(k)} vs {cand.conditions.get(k)}" for k in keys if str(ref.conditions.get(k)) != str(cand.conditions.get(k))]
        diffs += [f"{k} {ref.conditions.get(k)} vs {cand.conditions.get(k)}" for k in REF_BUDGET_KEYS
                  if not _budget(ref.conditions, k) >= _budget(cand.conditions, k)]
        for split, played in cand.outcomes.items():
            missing = played.keys() - ref.outcomes.get(split, {}).keys()
            if missing:
                diffs.append(f"{len(missing)} {split} game and seed pair(s) the candidate played, {label} did not (e.g. {sorted(missing)[0]})")
        if diffs:
            raise EvoError(f"promotion: {label} was evaluated under other conditions than the candidate ({'; '.join(diffs)}); "
                           "re-run the baselines stage with the candidate's settings")
