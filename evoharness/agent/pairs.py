"""SFT pairs: one row per turn of a successful, well-formed teacher episode.

Rows are ``{prompt, response}`` plus where they came from; the prompt is the one the episode
engine built (``build_prompt``), optionally with few-shot exemplars added exactly as the prompt
builder would add them. Train/val are split by episode (no episode in both).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

from evoharness.agent import tokens
from evoharness.agent.alfworld.families import FAMILIES
from evoharness.agent.episode import add_examples, parse_response
from evoharness.agent.policies.teacher import DETOUR_THINK
from evoharness.agent.rollout import read_jsonl
from evoharness.core.errors import EvoError

COLUMNS = ["episode_id", "game_id", "family", "turn", "kind", "prompt", "response", "prompt_tokens", "response_tokens", "split"]


def drop_reason(rec: dict) -> str | None:
    """Why an episode is not used for SFT, or None if it is kept."""
    if rec.get("error"):
        return "errored"
    if not rec.get("outcome", {}).get("won"):
        return "failed"
    turns = rec.get("turns") or []
    if not turns:
        return "no turns"
    for t in turns:
        if not t.get("valid") or parse_response(t.get("response", "")).error:
            return "malformed turn"
    return None


def is_val(episode_id: str, val_fraction: float) -> bool:
    h = int(hashlib.sha256(episode_id.encode()).hexdigest()[:8], 16)
    return (h % 10_000) < val_fraction * 10_000


def exemplars(records: list[dict], k: int) -> dict[str, str]:
    """Per family, the action sequences of its first k kept episodes (by episode id)."""
    out: dict[str, list[str]] = {}
    for rec in sorted(records, key=lambda r: r["episode_id"]):
        fam = rec["family"]
        if drop_reason(rec) is None and len(out.setdefault(fam, [])) < k:
            acts = "; ".join(t["action"] for t in rec["turns"])
            out[fam].append(f"{rec['task']} -> {acts}")
    return {fam: "\n".join(v) for fam, v in out.items()}


def kept_episodes(demos_path: Path) -> int:
    """How many episodes of a demos file SFT would learn from (``drop_reason`` keeps them)."""
    records, bad = read_jsonl(Path(demos_path))
    if bad or not Path(demos_path).exists():
        raise EvoError(f"{demos_path}: missing or {len(bad)} line(s) not JSON; run `evoharness validate` for the report")
    return sum(drop_reason(r) is None for r in records)


def build_pairs(demos_path: Path, out_dir: Path, val_fraction: float = 0.1, few_shot: int = 0, imitate_detours: bool = False,
                max_episodes: int | None = None) -> dict:
    """``max_episodes``: keep the first that many usable episodes (file order), so that two training sets hold the
    same number of successful episodes (ReAct-SFT's against SFT-inline's); fewer available is an error."""
    import pandas as pd

    demos_path, out_dir = Path(demos_path), Path(out_dir)
    if not demos_path.exists():
        raise EvoError(f"demos file {demos_path} does not exist")
    records, bad = read_jsonl(demos_path)
    if bad:
        raise EvoError(f"{demos_path}: {len(bad)} line(s) are not JSON (first: line {bad[0]}); run `evoharness validate` for the report")
    if max_episodes is not None:
        usable = sum(drop_reason(r) is None for r in records if isinstance(r, dict))
        if usable < max_episodes:
            raise EvoError(f"{demos_path}: {usable} usable episodes, fewer than the {max_episodes} to match; collect more demos (params demos.n)")
    out_dir.mkdir(parents=True, exist_ok=True)
    ex = exemplars(records, few_shot) if few_shot > 0 else {}
    dropped: Counter = Counter()
    skipped: Counter = Counter()
    rows = []
    kept_eps = {"train": 0, "val": 0}
    for rec in records:
        try:
            reason = drop_reason(rec)
        except (AttributeError, TypeError):
            reason = "malformed record"
        if reason is None and max_episodes is not None and sum(kept_eps.values()) >= max_episodes:
            reason = "over the matched count"
        if reason:
            dropped[reason] += 1
            continue
        split = "val" if is_val(rec["episode_id"], val_fraction) else "train"
        kept_eps[split] += 1
        for t in rec["turns"]:
            if not imitate_detours and t["response"].startswith(f"<think>{DETOUR_THINK}</think>"):
                skipped["teacher detour"] += 1
                continue
            prompt = add_examples(t["prompt"], ex.get(rec["family"], ""))
            rows.append({
                "episode_id": rec["episode_id"], "game_id": rec["game_id"], "family": rec["family"], "turn": int(t["t"]),
                "kind": t["kind"], "prompt": prompt, "response": t["response"],
                "prompt_tokens": tokens.count(prompt), "response_tokens": tokens.count(t["response"]), "split": split,
            })
    df = pd.DataFrame(rows, columns=COLUMNS)
    for split in ("train", "val"):
        df[df["split"] == split].reset_index(drop=True).to_parquet(out_dir / f"{split}.parquet", index=False)
    (out_dir / "exemplars.json").write_text(json.dumps(ex, indent=2, sort_keys=True))
    kinds = Counter(df["kind"]) if len(df) else Counter()
    summary = {
        "episodes": len(records),
        "kept": sum(kept_eps.values()),
        "kept_by_split": kept_eps,
        "dropped": dict(sorted(dropped.items())),
        "turns_skipped": dict(sorted(skipped.items())),
        "rows": {"train": int((df["split"] == "train").sum()), "val": int((df["split"] == "val").sum())},
        "verb_share": {k: round(v / max(len(df), 1), 4) for k, v in sorted(kinds.items())},
        "by_family": {FAMILIES.get(f, f): int(n) for f, n in sorted(Counter(df["family"]).items())},
        "tokens": {
            "prompt_mean": round(float(df["prompt_tokens"].mean()), 1) if len(df) else 0.0,
            "prompt_max": int(df["prompt_tokens"].max()) if len(df) else 0,
            "response_mean": round(float(df["response_tokens"].mean()), 1) if len(df) else 0.0,
            "response_max": int(df["response_tokens"].max()) if len(df) else 0,
        },
        "few_shot": few_shot,
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _field(prompt: str, name: str) -> str:
    for line in prompt.split("\n"):
        if line.startswith(f"{name}: "):
            return line[len(name) + 2 :]
    raise EvoError(f"prompt has no {name} line")


def project_env_only(df):
    """The same demos without the harness: each env turn re-prompted as ``env_only`` would have
    seen it (no verbs, no panels, the episode's previous env actions as history), through
    ``build_prompt``. Meta-action turns are dropped: in env_only they do not exist."""
    from evoharness.agent.episode import HISTORY, TurnView, build_prompt

    out = []
    for _, ep in df.sort_values(["episode_id", "turn"]).groupby("episode_id", sort=False):
        history: list[str] = []
        for row in ep.itertuples():
            action = parse_response(row.response).action
            if row.kind != "env":
                continue
            view = TurnView(
                verbs=(),
                objective=_field(row.prompt, "OBJECTIVE"),
                observation=_field(row.prompt, "OBSERVATION"),
                admissible=tuple(_field(row.prompt, "ADMISSIBLE COMMANDS").split(" | ")),
                last_actions=tuple(history[-HISTORY:]),
            )
            prompt = build_prompt(view)
            out.append({**row._asdict(), "prompt": prompt, "prompt_tokens": tokens.count(prompt)})
            history.append(action)
    import pandas as pd

    return pd.DataFrame(out).drop(columns=["Index"]) if out else df.head(0)


def load_pairs(pairs_dir: Path):
    import pandas as pd

    frames = []
    for split in ("train", "val"):
        p = Path(pairs_dir) / f"{split}.parquet"
        if not p.exists():
            raise EvoError(f"pairs file {p} does not exist")
        try:
            frames.append(pd.read_parquet(p))
        except Exception as e:
            raise EvoError(f"pairs file {p}: unreadable parquet ({type(e).__name__})") from None
    return pd.concat(frames, ignore_index=True)
