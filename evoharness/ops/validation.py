"""The validation gate: Great Expectations suites for teacher trajectories and SFT pairs.

Bad data stops the pipeline with a one-line summary and a report (JSON, plus GX data docs HTML)
naming each failed expectation with counts and examples; the offending file is moved to a
quarantine folder with that report, never deleted or overwritten. GX is imported lazily: it
costs about 8 s.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from evoharness.agent.alfworld.families import FAMILIES
from evoharness.agent.harness.workspace import META_VERBS
from evoharness.agent.pairs import load_pairs
from evoharness.core.errors import EvoError

TURN_KINDS = ("env", *META_VERBS, "invalid")
RESPONSE_RE = r"^\s*<think>(?:.|\n)*</think>\s*<action>[^<]+</action>\s*$"
REWARD_PARTS = ("success", "efficiency", "diversity", "repeats", "invalid", "total")


class ValidationFailed(EvoError):
    """A gate failed; the message is the one-line summary."""


@dataclass
class Report:
    target: str
    suite: str
    rows: int = 0
    evaluated: int = 0
    failed: list[dict] = field(default_factory=list)
    data_docs: str | None = None

    @property
    def success(self) -> bool:
        return not self.failed

    def to_json(self) -> dict:
        return {"target": self.target, "suite": self.suite, "success": self.success, "rows": self.rows,
                "expectations": self.evaluated, "failed": self.failed, "data_docs": self.data_docs}

    def one_line(self) -> str:
        parts = [f"{f['expectation']}({f.get('column') or ''}): {f['unexpected_count']} bad" for f in self.failed[:4]]
        more = f" (+{len(self.failed) - 4} more)" if len(self.failed) > 4 else ""
        return f"{Path(self.target).name}: {len(self.failed)} of {self.evaluated} expectations failed: " + "; ".join(parts) + more


# ---- flattening -------------------------------------------------------------------------------

def _num(v):
    if v is None:
        return math.nan
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return math.nan
    return v


def flatten_trajectories(lines: list[str]):
    """(episodes frame, turns frame, unparsed line numbers) from JSONL lines; missing fields become nulls."""
    import pandas as pd

    eps, turns, bad = [], [], []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            if not isinstance(r, dict):
                raise ValueError("not an object")
        except ValueError:
            bad.append(i)
            continue
        o = r.get("outcome") if isinstance(r.get("outcome"), dict) else {}
        calls = o.get("calls") if isinstance(o.get("calls"), dict) else {}
        rw = r.get("reward") if isinstance(r.get("reward"), dict) else {}
        row = {
            "line": i, "episode_id": r.get("episode_id"), "game_id": r.get("game_id"), "family": r.get("family"),
            "policy": r.get("policy"), "seed": r.get("seed"), "max_steps": r.get("max_steps"),
            "won": o.get("won"), "steps": o.get("steps"), "turns": o.get("turns"), "invalid": o.get("invalid"),
            "error": r.get("error"),
        }
        for v in META_VERBS:
            row[f"calls_{v}"] = calls.get(v)
        for part in REWARD_PARTS:
            row[f"reward_{part}"] = _num(rw.get(part))
        unknown = sorted(set(calls) - set(META_VERBS))
        row["unknown_verbs"] = ",".join(unknown) if unknown else None
        eps.append(row)
        for t in r.get("turns") or []:
            if not isinstance(t, dict):
                t = {}
            turns.append({"line": i, "episode_id": r.get("episode_id"), "t": t.get("t"), "kind": t.get("kind"),
                          "valid": t.get("valid"), "prompt": t.get("prompt"), "response": t.get("response")})
    ecols = ["line", "episode_id", "game_id", "family", "policy", "seed", "max_steps", "won", "steps", "turns", "invalid", "error",
             *[f"calls_{v}" for v in META_VERBS], *[f"reward_{p}" for p in REWARD_PARTS], "unknown_verbs"]
    tcols = ["line", "episode_id", "t", "kind", "valid", "prompt", "response"]
    return pd.DataFrame(eps, columns=ecols), pd.DataFrame(turns, columns=tcols), bad


# ---- suites -----------------------------------------------------------------------------------

def trajectory_suites(gx):
    E = gx.expectations
    ints = ["seed", "max_steps", "steps", "turns", "invalid", *[f"calls_{v}" for v in META_VERBS]]
    episodes = [E.ExpectColumnToExist(column=c) for c in ("episode_id", "game_id", "family", "won", "steps", "max_steps")]
    episodes += [E.ExpectColumnValuesToNotBeNull(column=c) for c in ("episode_id", "game_id", "family", "policy", "won", *ints)]
    episodes += [
        E.ExpectColumnValuesToBeInSet(column="family", value_set=list(FAMILIES)),
        E.ExpectColumnValuesToBeInSet(column="won", value_set=[True, False]),
        E.ExpectColumnValuesToBeUnique(column="episode_id"),
        E.ExpectColumnValuesToBeBetween(column="steps", min_value=0),
        E.ExpectColumnPairValuesAToBeGreaterThanB(column_A="max_steps", column_B="steps", or_equal=True),
        E.ExpectColumnValuesToBeNull(column="unknown_verbs"),
    ]
    episodes += [E.ExpectColumnValuesToBeBetween(column=f"calls_{v}", min_value=0) for v in META_VERBS]
    for p in REWARD_PARTS:  # finite: NaN counts as null, +-inf falls outside the range
        episodes.append(E.ExpectColumnValuesToNotBeNull(column=f"reward_{p}"))
        episodes.append(E.ExpectColumnValuesToBeBetween(column=f"reward_{p}", min_value=-1e6, max_value=1e6))
    turns = [
        E.ExpectColumnValuesToNotBeNull(column="kind"),
        E.ExpectColumnValuesToBeInSet(column="kind", value_set=list(TURN_KINDS)),
        E.ExpectColumnValuesToBeInSet(column="valid", value_set=[True, False]),
        E.ExpectColumnValuesToNotBeNull(column="prompt"),
        E.ExpectColumnValueLengthsToBeBetween(column="prompt", min_value=1),
        E.ExpectColumnValuesToNotBeNull(column="response"),
    ]
    # Turns the engine accepted must be in the output format (invalid ones are the policy's errors).
    replies = [E.ExpectColumnValuesToMatchRegex(column="response", regex=RESPONSE_RE)]
    return {"episodes": episodes, "turns": turns, "replies": replies}


def pairs_suites(gx, max_tokens: int):
    E = gx.expectations
    cols = ["episode_id", "game_id", "family", "turn", "kind", "prompt", "response", "prompt_tokens", "response_tokens", "split"]
    rows = [E.ExpectColumnToExist(column=c) for c in cols]
    rows += [E.ExpectColumnValuesToNotBeNull(column=c) for c in cols]
    rows += [
        E.ExpectColumnValuesToBeOfType(column="turn", type_="int64"),
        E.ExpectColumnValuesToBeOfType(column="prompt_tokens", type_="int64"),
        E.ExpectColumnValuesToBeInSet(column="family", value_set=list(FAMILIES)),
        E.ExpectColumnValuesToBeInSet(column="kind", value_set=["env", *META_VERBS]),
        E.ExpectColumnValuesToBeInSet(column="split", value_set=["train", "val"]),
        E.ExpectColumnValueLengthsToBeBetween(column="prompt", min_value=1),
        E.ExpectColumnValueLengthsToBeBetween(column="response", min_value=1),
        E.ExpectColumnValuesToMatchRegex(column="response", regex=RESPONSE_RE),
        E.ExpectColumnValuesToBeBetween(column="total_tokens", min_value=1, max_value=max_tokens),
        E.ExpectCompoundColumnsToBeUnique(column_list=["episode_id", "turn"]),
        E.ExpectColumnValuesToBeBetween(column="episode_splits", min_value=1, max_value=1),
    ]
    return {"pairs": rows}


# ---- running ----------------------------------------------------------------------------------

def _gx():
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    import logging

    logging.getLogger("great_expectations").setLevel(logging.ERROR)
    import great_expectations as gx

    return gx


def run_suites(frames: dict, suites: dict, report: Report, docs_root: Path | None) -> Report:
    """Validate each frame against its suite with a GX checkpoint; collect failures into the report."""
    gx = _gx()
    if docs_root is not None:
        docs_root.mkdir(parents=True, exist_ok=True)
        ctx = gx.get_context(mode="file", project_root_dir=str(docs_root))
    else:
        ctx = gx.get_context(mode="ephemeral")
    try:
        ctx.variables.progress_bars = {"globally": False, "metric_calculations": False}
    except Exception:
        pass
    ds = ctx.data_sources.add_or_update_pandas("evoharness")
    vds = []
    for name, exps in suites.items():
        asset_name = f"{report.suite}_{name}"
        try:
            asset = ds.get_asset(asset_name)
        except LookupError:
            asset = ds.add_dataframe_asset(asset_name)
        try:
            bd = asset.get_batch_definition("all")
        except (KeyError, LookupError, ValueError):
            bd = asset.add_batch_definition_whole_dataframe("all")
        suite = gx.ExpectationSuite(name=asset_name)
        for e in exps:
            suite.add_expectation(e)
        suite = ctx.suites.add_or_update(suite)
        vd = ctx.validation_definitions.add_or_update(gx.ValidationDefinition(name=asset_name, data=bd, suite=suite))
        res = vd.run(batch_parameters={"dataframe": frames[name]}, result_format={"result_format": "SUMMARY", "partial_unexpected_count": 5})
        vds.append((name, vd, res))
    for name, _, res in vds:
        report.evaluated += len(res.results)
        for r in res.results:
            if r.success:
                continue
            c = r.expectation_config
            res_ = r.result or {}
            examples = res_.get("partial_unexpected_list") or []
            if c.type == "expect_column_to_exist":
                examples = [f"column {c.kwargs.get('column')!r} missing"]
            report.failed.append({
                "frame": name,
                "expectation": c.type,
                "column": c.kwargs.get("column") or ",".join(c.kwargs.get("column_list", []) or [c.kwargs.get("column_A", ""), c.kwargs.get("column_B", "")]).strip(","),
                "kwargs": {k: (list(v)[:10] if isinstance(v, (list, set, tuple)) else v) for k, v in c.kwargs.items() if k not in ("column", "batch_id")},
                "unexpected_count": int(res_.get("unexpected_count") or (0 if c.type != "expect_column_to_exist" else 1)),
                "unexpected_percent": round(float(res_.get("unexpected_percent") or 0.0), 4),
                "examples": [_jsonable(x) for x in examples[:5]],
                "where": _offending_rows(frames[name], c),
            })
    if docs_root is not None:
        ctx.build_data_docs()
        report.data_docs = str(Path(docs_root) / "gx" / "uncommitted" / "data_docs" / "local_site" / "index.html")
    return report


def _offending_rows(df, cfg) -> list:
    """Where the bad rows are: JSONL line numbers for trajectories, episode/turn for pairs."""
    col = cfg.kwargs.get("column")
    try:
        if cfg.type == "expect_column_values_to_not_be_null":
            mask = df[col].isna()
        elif cfg.type == "expect_column_values_to_be_in_set":
            mask = df[col].notna() & ~df[col].isin(list(cfg.kwargs["value_set"]))
        elif cfg.type == "expect_column_values_to_be_between":
            lo, hi = cfg.kwargs.get("min_value"), cfg.kwargs.get("max_value")
            v = df[col]
            mask = v.notna() & (((v < lo) if lo is not None else False) | ((v > hi) if hi is not None else False))
        elif cfg.type == "expect_column_pair_values_a_to_be_greater_than_b":
            mask = ~(df[cfg.kwargs["column_A"]] >= df[cfg.kwargs["column_B"]])
        elif cfg.type == "expect_column_values_to_be_null":
            mask = df[col].notna()
        elif cfg.type == "expect_column_values_to_match_regex":
            mask = df[col].notna() & ~df[col].astype(str).str.contains(cfg.kwargs["regex"], regex=True)
        elif cfg.type == "expect_column_value_lengths_to_be_between":
            mask = df[col].notna() & (df[col].astype(str).str.len() < (cfg.kwargs.get("min_value") or 0))
        else:
            return []
    except (KeyError, TypeError):
        return []
    bad = df[mask].head(5)
    if "line" in df.columns:
        return [f"line {int(n)}" for n in bad["line"]]
    if {"episode_id", "turn"} <= set(df.columns):
        return [f"{e} turn {t}" for e, t in zip(bad["episode_id"], bad["turn"])]
    return []


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x if not isinstance(x, str) else x[:160]
    return str(x)[:160]


def validate_trajectories(path: Path, docs_root: Path | None = None) -> Report:
    path = Path(path)
    if not path.exists():
        raise EvoError(f"trajectories file {path} does not exist")
    lines = path.read_text(errors="replace").splitlines()
    eps, turns, bad = flatten_trajectories(lines)
    report = Report(str(path), "trajectories", rows=len(eps))
    if bad:
        report.failed.append({"frame": "file", "expectation": "jsonl_lines_parse", "column": None, "kwargs": {},
                              "unexpected_count": len(bad), "unexpected_percent": round(100 * len(bad) / max(len(lines), 1), 4),
                              "examples": [f"line {n}: {lines[n - 1][:80]!r}" for n in bad[:5]], "where": [f"line {n}" for n in bad[:5]]})
        report.evaluated += 1
    if len(eps) == 0:
        report.failed.append({"frame": "file", "expectation": "has_rows", "column": None, "kwargs": {}, "unexpected_count": 1,
                              "unexpected_percent": 100.0, "examples": ["no parsable trajectory"], "where": []})
        report.evaluated += 1
        return report
    replies = turns[turns["kind"].notna() & (turns["kind"] != "invalid")].reset_index(drop=True)
    return run_suites({"episodes": eps, "turns": turns, "replies": replies}, trajectory_suites(_gx()), report, docs_root)


def validate_pairs(pairs_dir: Path, max_tokens: int, docs_root: Path | None = None) -> Report:
    df = load_pairs(pairs_dir)
    report = Report(str(pairs_dir), "pairs", rows=len(df))
    if {"prompt_tokens", "response_tokens"} <= set(df.columns):
        df["total_tokens"] = df["prompt_tokens"].fillna(0) + df["response_tokens"].fillna(0)
    else:
        df["total_tokens"] = 0
    if {"episode_id", "split"} <= set(df.columns):
        df["episode_splits"] = df.groupby("episode_id")["split"].transform("nunique")
    else:
        df["episode_splits"] = 0
    return run_suites({"pairs": df}, pairs_suites(_gx(), max_tokens), report, docs_root)


def quarantine(files: list[Path], report: Report, root: Path) -> Path:
    """Move the offending files and the report into a new folder under root; nothing is overwritten."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    name = Path(report.target).name
    dest = Path(root) / f"{stamp}-{name}"
    n = 1
    while dest.exists():
        n += 1
        dest = Path(root) / f"{stamp}-{name}-{n}"
    dest.mkdir(parents=True)
    for f in files:
        if Path(f).exists():
            shutil.move(str(f), str(dest / Path(f).name))
    if report.data_docs and Path(report.data_docs).exists():
        shutil.copytree(Path(report.data_docs).parent, dest / "data_docs")
    (dest / "report.json").write_text(json.dumps({**report.to_json(), "quarantined": [Path(f).name for f in files]}, indent=2))
    return dest


def gate(demos: Path | None, pairs_dir: Path | None, max_tokens: int, report_dir: Path, quarantine_root: Path, metrics: Path | None = None,
         more: dict[str, tuple[Path | None, Path | None]] | None = None) -> dict:
    """Validate demos and pairs (and ``more``: per name, another demos file and pairs folder, reported as
    ``trajectories_<name>`` and ``pairs_<name>``); on failure quarantine and raise ValidationFailed (one line)."""
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    failures = []
    checks = []
    for suffix, (d, pd_) in {"": (demos, pairs_dir), **{f"_{k}": v for k, v in (more or {}).items()}}.items():
        if d is not None:
            checks.append((f"trajectories{suffix}", lambda d=d: validate_trajectories(Path(d), report_dir), [Path(d)]))
        if pd_ is not None:
            checks.append((f"pairs{suffix}", lambda pd_=pd_: validate_pairs(Path(pd_), max_tokens, report_dir),
                           [Path(pd_) / "train.parquet", Path(pd_) / "val.parquet"]))
    for name, run, files in checks:
        rep = run()
        (report_dir / f"{name}.json").write_text(json.dumps(rep.to_json(), indent=2))
        results[name] = {"rows": rep.rows, "expectations": rep.evaluated, "failed": len(rep.failed)}
        if not rep.success:
            where = quarantine(files, rep, quarantine_root)
            failures.append(f"{rep.one_line()}; report and file in {where}")
    if failures:
        raise ValidationFailed("validation failed: " + " | ".join(failures))
    if metrics is not None:
        Path(metrics).parent.mkdir(parents=True, exist_ok=True)
        Path(metrics).write_text(json.dumps(results, indent=2, sort_keys=True))
    return results
