"""Evaluation: every game of a split exactly once per seed; success per family and overall,
steps, harness calls per episode by verb, invalid rate. Resumable: an episode whose
fingerprint is already in ``episodes.jsonl`` (and did not error) is not played again."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Callable

from evoharness.agent.alfworld.families import FAMILIES
from evoharness.agent.alfworld.games import Game
from evoharness.agent.envpool import EnvPool
from evoharness.agent.episode import EpisodeConfig, fingerprint
from evoharness.agent.harness.experience import Experience
from evoharness.agent.harness.workspace import META_VERBS
from evoharness.agent.policies import PolicySpec, make_policy
from evoharness.agent.rollout import JsonlWriter, read_jsonl, run_batch
from evoharness.core import atomic
from evoharness.core.errors import EvoError


def wilson(wins: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson score interval of a success rate."""
    if n == 0:
        return (0.0, 1.0)
    p = wins / n
    d = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (round(max(0.0, mid - half), 4), round(min(1.0, mid + half), 4))


def mcnemar_greater(a: dict[str, int], b: dict[str, int]) -> tuple[int, int, float]:
    """Paired by game (the keys both played): ``only_a`` games a won and b lost, ``only_b`` the reverse, and McNemar's
    exact one-sided p-value that a is better than b, P(X >= only_a) with X ~ Binomial(only_a + only_b, 1/2)."""
    keys = a.keys() & b.keys()
    only_a = sum(1 for k in keys if a[k] and not b[k])
    only_b = sum(1 for k in keys if b[k] and not a[k])
    n = only_a + only_b
    p = sum(math.comb(n, i) for i in range(only_a, n + 1)) / 2**n if n else 1.0
    return only_a, only_b, p


def outcomes_of(out_dir: Path, episodes: int) -> dict[str, int]:
    """An evaluation folder's per-episode outcomes, ``game_id#s<seed>`` -> won (an errored episode lost): its first
    ``episodes`` records, which are the evaluation's own (records of other runs are kept after them)."""
    recs = read_jsonl(Path(out_dir) / "episodes.jsonl")[0][:episodes]
    if len(recs) != episodes:
        raise EvoError(f"{out_dir}/episodes.jsonl holds {len(recs)} episodes, its results {episodes}")
    return {f"{r['game_id']}#s{r['seed']}": int(bool((r.get("outcome") or {}).get("won")) and not r.get("error")) for r in recs}


def summarize(records: list[dict]) -> dict:
    """Per family and overall: episodes, wins, success (an errored episode counts as a failure: a
    model whose episodes crash must not score higher) with its 95 % Wilson interval, mean steps,
    calls per episode by verb and invalid rate (over the episodes that did not error)."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        groups[FAMILIES.get(r["family"], r["family"])].append(r)
        groups["all"].append(r)

    def agg(rs: list[dict]) -> dict:
        ok = [r for r in rs if not r.get("error")]
        n = len(ok)
        turns = sum(r["outcome"]["turns"] for r in ok)
        wins = sum(bool(r["outcome"].get("won")) for r in ok)
        return {
            "episodes": len(rs),
            "errored": len(rs) - n,
            "wins": wins,
            "success": round(wins / len(rs), 4) if rs else 0.0,
            "ci95": list(wilson(wins, len(rs))),
            "steps": round(sum(r["outcome"]["steps"] for r in ok) / n, 2) if n else 0.0,
            "steps_free": round(sum(r["outcome"].get("steps_free", 0) for r in ok) / n, 2) if n else 0.0,
            "steps_charged": round(sum(r["outcome"].get("steps_charged", 0) for r in ok) / n, 2) if n else 0.0,
            "calls": {v: round(sum(r["outcome"]["calls"][v] for r in ok) / n, 3) if n else 0.0 for v in META_VERBS},
            "invalid_rate": round(sum(r["outcome"]["invalid"] for r in ok) / turns, 4) if turns else 0.0,
        }

    order = [f for f in FAMILIES.values() if f in groups] + [k for k in groups if k not in FAMILIES.values() and k != "all"]
    return {k: agg(groups[k]) for k in order + (["all"] if "all" in groups else [])}


def format_table(title: str, summary: dict) -> str:
    head = f"{'family':<8} {'n':>4} {'err':>4} {'success':>8} {'steps':>6} " + " ".join(f"{v:>7}" for v in META_VERBS) + f" {'invalid':>8}"
    lines = [title, head, "-" * len(head)]
    for fam, s in summary.items():
        lines.append(
            f"{fam:<8} {s['episodes']:>4} {s['errored']:>4} {100 * s['success']:>7.1f}% {s['steps']:>6.1f} "
            + " ".join(f"{s['calls'][v]:>7.2f}" for v in META_VERBS)
            + f" {100 * s['invalid_rate']:>7.1f}%"
        )
    return "\n".join(lines)


def _canonical_rewrite(path: Path, records: list[dict], wanted: dict) -> None:
    """Rewrite the episodes file in (game, seed) order so its hash is the same on a rerun. Records of
    other runs and lines that did not parse are kept after them, byte for byte."""
    keep_other = []
    if path.exists():
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    fp = json.loads(line).get("fingerprint")
                except (ValueError, AttributeError):
                    fp = None
                if fp not in wanted:
                    keep_other.append(line.rstrip("\n"))
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
        for line in keep_other:
            f.write(line + "\n")
    tmp.replace(path)


def _what_ran(policy, cfg: EpisodeConfig, games: list[Game], seeds: list[int]) -> dict:
    """The head of a results.json: which policy, under which episode config, on which games and seeds (the gate reads it)."""
    return {"policy": policy.name, "policy_fingerprint": policy.fingerprint(), "episode_config": cfg.model_dump(),
            "split": sorted({g.split for g in games}), "seeds": seeds, "games": len(games)}


def evaluate(
    games: list[Game],
    spec: PolicySpec,
    cfg: EpisodeConfig,
    seeds: list[int],
    out_dir: Path,
    workers: int = 2,
    bank: Experience | None = None,
    progress: Callable[[dict], None] | None = None,
    pool: EnvPool | None = None,
) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    episodes = out_dir / "episodes.jsonl"
    existing, bad_lines = read_jsonl(episodes)
    policy = make_policy(spec)
    wanted = {fingerprint(g, s, policy, cfg, bank): (g, s) for s in seeds for g in games}
    have = {r["fingerprint"]: r for r in existing if r.get("fingerprint") in wanted and not r.get("error")}
    todo = [job for fp, job in wanted.items() if fp not in have]
    own = pool is None
    pool = pool or EnvPool(workers)
    try:
        new = run_batch(pool, todo, spec, cfg, bank, JsonlWriter(episodes), progress) if todo else []
    finally:
        if own:
            pool.close()
    records = list(have.values()) + new
    records.sort(key=lambda r: (r["game_id"], r["seed"]))
    _canonical_rewrite(episodes, records, wanted)
    result = {
        **_what_ran(policy, cfg, games, seeds),
        "reused": len(have),
        "played": len(new),
        "unparsed_lines": bad_lines,
        "summary": summarize(records),
    }
    atomic.write_json(out_dir / "results.json", result, indent=2)
    return result


def evaluate_evolving(
    games: list[Game],
    spec: PolicySpec,
    cfg: EpisodeConfig,
    seeds: list[int],
    out_dir: Path,
    bank: Experience,
    window: int,
    consolidator=None,
    workers: int = 2,
    pool: EnvPool | None = None,
    warn: Callable[[str], None] | None = None,
) -> dict:
    """Evaluation with an evolving Experience bank: the episodes go in windows of ``window`` (per seed, games in
    order); each window is a frozen evaluation with the bank as the windows before it left it, and then its
    trajectories are consolidated (``consolidator``: rules when None, else an endpoint) into the next bank. The
    bank after window k is checkpointed (``banks/after-w<k>.json``) before window k+1 starts, so a killed run
    resumes from its last bank, not the seed bank, and replays no finished episode (each window reuses its
    episodes by fingerprint, as ``evaluate`` does)."""
    from evoharness.agent.episode import bank_digest

    if window < 1:
        from evoharness.core.errors import EvoError

        raise EvoError(f"evolving evaluation: consolidator.window must be at least 1 (got {window})")
    out_dir = Path(out_dir)
    banks = out_dir / "banks"
    banks.mkdir(parents=True, exist_ok=True)
    start = bank_digest(bank)
    windows = [(s, games[i:i + window]) for s in seeds for i in range(0, len(games), window)]
    records, log = [], []
    own = pool is None
    pool = pool or EnvPool(workers)  # one pool for every window (each would otherwise start its engines again)
    try:
        bank, resumed_at = _play_windows(windows, spec, cfg, out_dir, bank, consolidator, workers, pool, warn, records, log)
    finally:
        if own:
            pool.close()
    records.sort(key=lambda r: (r["game_id"], r["seed"]))
    atomic.write_text(out_dir / "episodes.jsonl", "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))  # the gate's evidence
    bank.save(out_dir / "bank-final.json")
    result = {
        **_what_ran(make_policy(spec), cfg, games, seeds),
        "bank_mode": "evolve",
        "window": window,
        "windows": len(windows),
        "bank_start_digest": start,
        "bank_digest": bank_digest(bank),
        "resumed_after_window": resumed_at,
        "consolidations": log,
        "summary": summarize(records),
    }
    atomic.write_json(out_dir / "results.json", result, indent=2)
    return result


def _play_windows(windows, spec, cfg, out_dir: Path, bank: Experience, consolidator, workers: int, pool, warn, records: list, log: list):
    """``evaluate_evolving``'s windows in order: each played with the bank the windows before it left, then
    consolidated and checkpointed (or, resumed, its checkpoint read back). Returns the last bank and the last
    window a killed run had consolidated (None: none)."""
    from evoharness.agent.harness.consolidate import consolidate

    banks = Path(out_dir) / "banks"
    resumed_at = None
    for k, (seed, chunk) in enumerate(windows):
        wdir = out_dir / "windows" / f"w{k:03d}"
        evaluate(chunk, spec, cfg, [seed], wdir, workers, bank, pool=pool)
        mine = {(g.id, seed) for g in chunk}
        got = [r for r in read_jsonl(wdir / "episodes.jsonl")[0] if (r.get("game_id"), r.get("seed")) in mine]
        records += got
        ckpt = banks / f"after-w{k:03d}.json"
        if ckpt.exists():  # consolidated before this run was killed: the bank it left, not a second consolidation
            bank = Experience.load(ckpt)
            resumed_at = k
            log.append(json.loads(ckpt.with_suffix(".edits.json").read_text()) if ckpt.with_suffix(".edits.json").exists() else {"window": k})
            continue
        edits = consolidate(bank, got, consolidator, warn)
        log.append({"window": k, "applied": sum(str(e.get("result", "")).startswith("applied") for e in edits),
                    "refused": [e["result"] for e in edits if e.get("op") == "none"]})
        atomic.write_json(ckpt.with_suffix(".edits.json"), log[-1])
        bank.save(ckpt)  # last: its existence says the window is consolidated
    return bank, resumed_at
