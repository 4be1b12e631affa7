"""The Great Expectations gate: each kind of bad input is rejected with a report and quarantined."""

from __future__ import annotations

import json
import math

import pytest

from evoharness.agent.pairs import build_pairs
from evoharness.agent.policies.teacher import DETOUR_THINK
from evoharness.ops.validation import ValidationFailed, gate


@pytest.fixture(scope="module")
def demos(tmp_path_factory, games_root):
    """Real teacher demos (2 per family, noise so that some fail) on the session's games."""
    from evoharness.agent.alfworld.games import list_games
    from evoharness.agent.collect import collect
    from evoharness.agent.episode import EpisodeConfig
    from evoharness.agent.policies import PolicySpec

    out = tmp_path_factory.mktemp("demos")
    collect(list_games(games_root, "train"), PolicySpec(kind="teacher", noise=0.6), EpisodeConfig(), 12, out, batch_size=6, workers=2, seed=1)
    return out / "demos.jsonl"


def _corrupt(src, dst, fn):
    lines = src.read_text().splitlines()
    lines = fn(lines)
    dst.write_text("\n".join(lines) + "\n")
    return dst


def _edit(i, f):
    def fn(lines):
        rec = json.loads(lines[i])
        f(rec)
        lines[i] = json.dumps(rec)
        return lines
    return fn


def test_clean_demos_and_pairs_pass(demos, tmp_path):
    s = build_pairs(demos, tmp_path / "pairs", 0.25, 0)
    assert s["kept"] + sum(s["dropped"].values()) == 12 and s["rows"]["train"] > 0
    # The teacher's noise steps (random commands) stay in the history but are never targets.
    import pandas as pd

    rows = pd.concat([pd.read_parquet(tmp_path / "pairs" / f"{x}.parquet") for x in ("train", "val")])
    assert s["turns_skipped"]["teacher detour"] > 0
    assert not rows["response"].str.contains(DETOUR_THINK, regex=False).any()
    assert rows["prompt"].str.contains("LAST ACTIONS").any()
    s2 = build_pairs(demos, tmp_path / "pairs2", 0.25, 0, imitate_detours=True)
    assert sum(s2["rows"].values()) == sum(s["rows"].values()) + s["turns_skipped"]["teacher detour"]
    res = gate(demos, tmp_path / "pairs", 1024, tmp_path / "report", tmp_path / "q", tmp_path / "m.json")
    assert res["trajectories"]["failed"] == 0 and res["pairs"]["failed"] == 0
    assert json.loads((tmp_path / "m.json").read_text()) == res
    assert (tmp_path / "report" / "gx" / "uncommitted" / "data_docs" / "local_site" / "index.html").exists()
    assert not (tmp_path / "q").exists()


CASES = {
    "truncated line": (lambda lines: lines[:-1] + [lines[-1][: len(lines[-1]) // 2]], "jsonl_lines_parse"),
    "non-JSON line": (lambda lines: lines[:3] + ["this is not json"] + lines[3:], "jsonl_lines_parse"),
    "missing field": (_edit(0, lambda r: r["outcome"].pop("won")), "expect_column_values_to_not_be_null"),
    "unknown verb": (_edit(1, lambda r: r["turns"][0].update(kind="dance")), "expect_column_values_to_be_in_set"),
    "unknown verb in calls": (_edit(1, lambda r: r["outcome"]["calls"].update(dance=2)), "expect_column_values_to_be_null"),
    "NaN reward": (_edit(2, lambda r: r["reward"].update(total=math.nan)), "expect_column_values_to_not_be_null"),
    "infinite reward": (_edit(2, lambda r: r["reward"].update(efficiency=math.inf)), "expect_column_values_to_be_between"),
    "steps over budget": (_edit(3, lambda r: r["outcome"].update(steps=999)), "expect_column_pair_values_a_to_be_greater_than_b"),
    "unknown family": (_edit(4, lambda r: r.update(family="juggle")), "expect_column_values_to_be_in_set"),
    "bad response format": (_edit(5, lambda r: r["turns"][1].update(response="go to fridge 1", kind="env")), "expect_column_values_to_match_regex"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_corruption_is_rejected_and_quarantined(case, demos, tmp_path):
    fn, expectation = CASES[case]
    bad = _corrupt(demos, tmp_path / "demos.jsonl", fn)
    original = bad.read_bytes()
    with pytest.raises(ValidationFailed) as e:
        gate(bad, None, 1024, tmp_path / "report", tmp_path / "quarantine", None)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("validation failed: demos.jsonl:") and expectation in msg
    assert not bad.exists()  # moved, not copied
    (qdir,) = list((tmp_path / "quarantine").iterdir())
    assert (qdir / "demos.jsonl").read_bytes() == original  # nothing lost
    report = json.loads((qdir / "report.json").read_text())
    failed = [f for f in report["failed"] if f["expectation"] == expectation]
    assert failed and failed[0]["unexpected_count"] >= 1 and failed[0]["where"] and report["quarantined"] == ["demos.jsonl"]
    assert (qdir / "data_docs" / "index.html").exists()  # the GX data docs travel with the report


def test_quarantine_never_overwrites(demos, tmp_path):
    for _ in range(2):
        bad = _corrupt(demos, tmp_path / "demos.jsonl", CASES["NaN reward"][0])
        with pytest.raises(ValidationFailed):
            gate(bad, None, 1024, tmp_path / "report", tmp_path / "quarantine", None)
    assert len(list((tmp_path / "quarantine").iterdir())) == 2


def test_bad_pairs_are_rejected(demos, tmp_path):
    import pandas as pd

    build_pairs(demos, tmp_path / "pairs", 0.25, 0)
    train = pd.read_parquet(tmp_path / "pairs" / "train.parquet")
    val = pd.read_parquet(tmp_path / "pairs" / "val.parquet")
    leaked = pd.concat([val, train.head(3).assign(split="val")])  # an episode in both splits
    train.loc[0, "response"] = ""
    train.loc[1, "prompt_tokens"] = 5000  # over the profile's max length
    train = pd.concat([train, train.tail(1)])  # a duplicate row
    train.to_parquet(tmp_path / "pairs" / "train.parquet", index=False)
    leaked.to_parquet(tmp_path / "pairs" / "val.parquet", index=False)
    with pytest.raises(ValidationFailed) as e:
        gate(None, tmp_path / "pairs", 1024, tmp_path / "report", tmp_path / "q", None)
    (qdir,) = list((tmp_path / "q").iterdir())
    report = json.loads((qdir / "report.json").read_text())
    failed = {(f["expectation"], f["column"]) for f in report["failed"]}
    assert ("expect_column_value_lengths_to_be_between", "response") in failed
    assert ("expect_column_values_to_be_between", "total_tokens") in failed
    assert ("expect_compound_columns_to_be_unique", "episode_id,turn") in failed
    assert ("expect_column_values_to_be_between", "episode_splits") in failed
    assert sorted(report["quarantined"]) == ["train.parquet", "val.parquet"] and "pairs" in str(e.value)


def test_pairs_split_by_episode_and_few_shot_matches_prompt_builder(demos, tmp_path):
    import pandas as pd

    from evoharness.agent.episode import TurnView, add_examples, build_prompt

    s = build_pairs(demos, tmp_path / "p", 0.25, few_shot=1)
    train = pd.read_parquet(tmp_path / "p" / "train.parquet")
    val = pd.read_parquet(tmp_path / "p" / "val.parquet")
    assert not set(train.episode_id) & set(val.episode_id)
    assert s["dropped"].get("failed", 0) >= 1  # noise 0.6: some demos fail and are dropped
    ex = json.loads((tmp_path / "p" / "exemplars.json").read_text())
    assert ex and all(train[train.family == f].prompt.str.contains("EXAMPLES:\n" + v, regex=False).all() for f, v in ex.items() if (train.family == f).any())
    view = TurnView(("track",), "put a mug in shelf.", "You are in a room.", ("look", "go to shelf 1"), ("look",), (("PLAN", "(empty)"),))
    with_ex = TurnView(*view.__dict__.values())
    object.__setattr__(with_ex, "examples", "a -> b; c")
    assert add_examples(build_prompt(view), "a -> b; c") == build_prompt(with_ex)


def test_react_sft_learns_from_an_env_only_teacher_with_as_many_wins_as_sft_inline(demos, games_root, tmp_path):
    """The fair ReAct baseline's data: the env_only teacher's own demos (its search moves chosen from what it sees),
    cut to the inline demos' number of successful episodes, validated by the same gate, used by SFT as they are."""
    from evoharness.agent.alfworld.games import list_games
    from evoharness.agent.collect import collect
    from evoharness.agent.pairs import kept_episodes
    from evoharness.agent.episode import EpisodeConfig
    from evoharness.core.errors import EvoError
    from evoharness.agent.harness.workspace import HarnessConfig
    from evoharness.agent.policies import PolicySpec
    from evoharness.agent.training.sft import load_rows

    react = tmp_path / "react"
    collect(list_games(games_root, "train"), PolicySpec(kind="teacher", noise=0.3), EpisodeConfig(harness=HarnessConfig(mode="env_only")), 12, react,
            batch_size=6, workers=2, seed=1)
    w = kept_episodes(demos)
    assert 0 < w < kept_episodes(react / "demos.jsonl"), (w, kept_episodes(react / "demos.jsonl"))
    s = build_pairs(react / "demos.jsonl", tmp_path / "pairs_react", 0.25, 0, max_episodes=w)
    assert s["kept"] == w and s["dropped"]["over the matched count"] >= 1
    with pytest.raises(EvoError, match=r"usable episodes, fewer than the 99 to match"):
        build_pairs(react / "demos.jsonl", tmp_path / "too_many", 0.25, 0, max_episodes=99)
    build_pairs(demos, tmp_path / "pairs", 0.25, 0)
    res = gate(demos, tmp_path / "pairs", 1024, tmp_path / "report", tmp_path / "q", None, {"react": (react / "demos.jsonl", tmp_path / "pairs_react")})
    assert set(res) == {"trajectories", "pairs", "trajectories_react", "pairs_react"} and all(r["failed"] == 0 for r in res.values())
    train, val = load_rows(tmp_path / "pairs_react", "env_only")
    import pandas as pd

    raw = pd.concat([pd.read_parquet(tmp_path / "pairs_react" / f"{x}.parquet") for x in ("train", "val")])
    assert sorted(pd.concat([train, val])["prompt"]) == sorted(raw["prompt"])  # the env_only teacher's prompts, not a projection
    assert not raw["prompt"].str.contains("track [query]", regex=False).any() and set(raw["kind"]) == {"env"}
