"""DVC lineage on a real git + DVC repo in a temp folder, with a real local remote.

The tests run in order on one repo: build, no-op, change one param, push and clone+pull,
reproduce by hash, lineage, then the bad-input cases. The repo has the project's dvc.yaml; the
data stages are the targets here (the training stages have tests of their own).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from evoharness.core.errors import EvoError
from evoharness.ops.lockfile import parse_lock
from evoharness.ops.vcs import check_lock, check_remote, dvc, git, unlock
from evoharness.ops.remote import ensure_remote
from evoharness.ops.lineage import lineage
from evoharness.ops.records import find_record
from evoharness.ops.reproduce import reproduce
from project import commit, make_project, MICRO

@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return make_project(tmp_path_factory.mktemp("dvcrepo"), MICRO)


DATA = ["validate", "baselines"]  # with their upstream: games, grpo_games, panel, demos, pairs and the ReAct demos and pairs


def _ran(out: str) -> set[str]:
    return {line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage")}


def test_repro_builds_the_pipeline_and_a_second_repro_does_nothing(repo):
    out = dvc(["repro", *DATA], repo)
    assert _ran(out) == {"games", "grpo_games", "panel", "demos", "pairs", "demos_react", "pairs_react", "validate", "baselines"}
    for p in ("data/games/valid_unseen", "data/demos/demos.jsonl", "data/pairs/train.parquet", "data/metrics/validation.json"):
        assert (repo / p).exists(), p
    git(["add", "-A"], repo)
    commit(repo, "-q", "-m", "run 1")
    again = dvc(["repro", *DATA], repo)
    assert _ran(again) == set() and "Data and pipelines are up to date" in again
    dag = dvc(["dag", "--md"], repo)
    assert "games" in dag and "validate" in dag
    metrics = dvc(["metrics", "show", "--json"], repo)
    for f in ("data/metrics/games.json", "data/metrics/demos.json", "data/metrics/pairs.json", "data/metrics/validation.json"):
        assert f in metrics, f
    assert '"failed": 0' in json.dumps(json.loads(metrics))


def test_changing_one_param_reruns_only_its_dependents(repo):
    p = yaml.safe_load((repo / "params.yaml").read_text())
    p["pairs"]["val_fraction"] = 0.5
    (repo / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    diff = dvc(["params", "diff"], repo)
    assert "pairs.val_fraction" in diff and "0.2" in diff and "0.5" in diff
    out = dvc(["repro", *DATA], repo)
    assert _ran(out) == {"pairs", "pairs_react", "validate"}
    git(["add", "-A"], repo)
    commit(repo, "-q", "-m", "val 0.5")


def test_fresh_clone_plus_pull_restores_the_data(repo, tmp_path):
    dvc(["push", "--with-deps", *DATA], repo)
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
    remote = dvc(["remote", "list", "--local"], repo).split()[1]
    ensure_remote(clone, remote)
    assert not (clone / "data" / "pairs").exists()
    dvc(["pull", "--with-deps", *DATA], clone)
    for p in ("data/pairs/train.parquet", "data/demos/demos.jsonl", "data/games/summary.json"):
        assert (clone / p).read_bytes() == (repo / p).read_bytes(), p
    status = dvc(["status", *DATA], clone)
    assert "up to date" in status


def test_a_remote_object_whose_bytes_changed_fails_the_pull_and_never_reaches_the_workspace(repo, tmp_path):
    """Whoever can write to the remote cannot swap a file's content under its hash: every pull re-hashes
    (DVC's remote ``verify``, set in config.local by the first pull of a checkout)."""
    remote = Path(dvc(["remote", "list", "--local"], repo).split()[1])
    tree = next(o["md5"] for o in parse_lock((repo / "dvc.lock").read_text())["demos"]["outs"] if o["path"] == "data/demos")
    manifest = json.loads((remote / "files" / "md5" / tree[:2] / tree[2:]).read_text())
    md5 = next(e["md5"] for e in manifest if e["relpath"] == "demos.jsonl")
    obj = remote / "files" / "md5" / md5[:2] / md5[2:]
    original = obj.read_bytes()
    clone = tmp_path / "tampered"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
    ensure_remote(clone, str(remote))
    obj.chmod(0o644)
    obj.write_bytes(original.replace(b'"won"', b'"WON"', 1))
    try:
        with pytest.raises(EvoError, match=r"^dvc pull data/demos/demos.jsonl failed in .*tampered"):
            dvc(["pull", "data/demos/demos.jsonl"], clone)
    finally:
        obj.write_bytes(original)
    assert not (clone / "data" / "demos" / "demos.jsonl").exists()
    assert "verify = True" in (clone / ".dvc" / "config.local").read_text()
    dvc(["pull", "data/demos/demos.jsonl"], clone)  # the object restored: the same pull goes through
    assert (clone / "data" / "demos" / "demos.jsonl").read_bytes() == (repo / "data" / "demos" / "demos.jsonl").read_bytes()


def test_a_stage_run_on_one_machine_is_restored_on_another_from_the_run_cache(repo, tmp_path):
    """A stage run here on inputs that dvc.lock no longer names (a param changed, then changed back) is not run
    again by a fresh clone given those inputs: DVC restores it from the run-cache on the remote (its entry, its
    outputs and its uncached metrics, which DVC's own push leaves out), as another box would."""
    from evoharness.ops import stagerun

    text = (repo / "params.yaml").read_text()
    other = yaml.safe_load(text)
    other["games"]["max_per_type"] = 2
    try:
        (repo / "params.yaml").write_text(yaml.safe_dump(other, sort_keys=False))
        made = stagerun.run_here(repo, "games")
        assert made.ran
        metrics = (repo / "data" / "metrics" / "games.json").read_bytes()
        stagerun.push_run_cache(repo)
    finally:
        (repo / "params.yaml").write_text(text)
    assert not stagerun.run_here(repo, "games").ran  # back to the committed inputs: restored here too
    clone = tmp_path / "box"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
    ensure_remote(clone, dvc(["remote", "list", "--local"], repo).split()[1])
    (clone / "params.yaml").write_text(yaml.safe_dump(other, sort_keys=False))
    again = stagerun.run_here(clone, "games")
    assert not again.ran and again.entry["outs"] == made.entry["outs"]
    assert (clone / "data" / "metrics" / "games.json").read_bytes() == metrics


def test_reproduce_by_hash_reports_identical_hashes(repo):
    stages = parse_lock((repo / "dvc.lock").read_text())
    pairs_md5 = next(o["md5"] for o in stages["pairs"]["outs"] if o["path"] == "data/pairs")
    found, how = find_record(pairs_md5[:10], repo)
    assert found == git(["rev-parse", "HEAD"], repo) and "data/pairs" in how
    lines = []
    rows = reproduce(pairs_md5[:10], repo, echo=lines.append)
    assert {r["stage"] for r in rows} == {"games", "grpo_games", "panel", "demos", "pairs", "demos_react", "pairs_react", "validate", "baselines"}
    assert {r["path"] for r in rows} >= {"data/games", "data/demos", "data/pairs", "data/baselines", "data/metrics/validation.json"}
    assert all(r["match"] for r in rows), [r for r in rows if not r["match"]]
    assert any("yes" in ln for ln in lines) and git(["worktree", "list"], repo).count("\n") == 0
    # One stage alone, on its recorded inputs; a stage the record does not hold is named with the ones it does.
    rows = reproduce("HEAD", repo, echo=lines.append, stages=["pairs"])
    assert {r["stage"] for r in rows} == {"pairs"} and "data/pairs" in {r["path"] for r in rows} and all(r["match"] for r in rows), rows
    with pytest.raises(EvoError, match=r"recorded no stage sft_inline; its stages: games, grpo_games, panel, demos, pairs, demos_react"):
        reproduce("HEAD", repo, echo=lines.append, stages=["sft_inline"])
    # This environment is the one the commit's constraints.txt pins; another pin is refused in one line.
    (repo / "constraints.txt").write_text((repo / "constraints.txt").read_text().replace("mlflow==", "mlflow==0.0.1\n# was mlflow=="))
    commit(repo, "-qam", "an environment this machine does not have")
    with pytest.raises(EvoError, match=r"pins mlflow==0.0.1 \(constraints.txt\), the environment of .* has mlflow==3.17.2; reproduce without --no-setup"):
        reproduce("HEAD", repo, echo=lines.append, setup=False)
    git(["reset", "-q", "--hard", "HEAD~1"], repo)
    # A stage that ran in the GPU box's environment (its metrics say so) is re-run only in that kind of environment.
    m = repo / "data" / "metrics" / "validation.json"
    m.write_text(json.dumps({**json.loads(m.read_text()), "launch": {"environment": "constraints-gpu.txt"}}))
    commit(repo, "-qam", "validate as if it ran on the GPU box")
    with pytest.raises(EvoError, match=r"^stage validate of \w+ ran in the environment constraints-gpu.txt pins; this one is constraints.txt's: "
                                       r"reproduce it there \(`bash scripts/setup.sh --gpu`\), or leave it out with --stage$"):
        reproduce("HEAD", repo, echo=lines.append, stages=["validate"])
    assert git(["worktree", "list"], repo).count("\n") == 0  # refused before pulling anything, the scratch worktree removed
    git(["reset", "-q", "--hard", "HEAD~1"], repo)


def test_lineage_names_stage_params_and_inputs(repo):
    lines = []
    info = lineage("data/pairs", repo, echo=lines.append)
    assert info["stage"] == "pairs"
    assert [c["stage"] for c in info["chain"]][:3] == ["pairs", "demos", "games"]
    text = "\n".join(lines)
    assert "param pairs = " in text and '"val_fraction": 0.5' in text
    assert "dep   data/demos" in text and "<- stage demos" in text
    md5 = next(o["md5"] for o in info["chain"][2]["outs"] if o["path"] == "data/games")
    assert lineage(md5[:8], repo, echo=lambda s: None)["stage"] == "games"
    with pytest.raises(EvoError, match="not an output of any stage"):
        lineage("data/nothing", repo, echo=lambda s: None)


def test_params_with_a_wrong_type_fail_the_stage_with_one_line(repo):
    text = (repo / "params.yaml").read_text()
    p = yaml.safe_load(text)
    p["games"]["per_family"]["train"] = "lots"
    (repo / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
    try:
        with pytest.raises(EvoError) as e:
            dvc(["repro", *DATA], repo)
        assert "params.yaml: games.per_family.train: Input should be a valid integer" in str(e.value)
        assert "\n" not in str(e.value)
    finally:
        (repo / "params.yaml").write_text(text)


def test_missing_and_unreachable_remote(repo, tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
    with pytest.raises(EvoError, match=r"no DVC remote is configured for .*clone"):
        dvc(["pull"], clone)
    dvc(["remote", "add", "--local", "-d", "dead", "http://127.0.0.1:9/store"], clone)
    with pytest.raises(EvoError, match=r"DVC remote 'dead' \(http://127.0.0.1:9/store\) is unreachable \(ConnectError\)"):
        dvc(["pull"], clone)
    dvc(["remote", "modify", "--local", "dead", "url", str(tmp_path / "gone")], clone)
    with pytest.raises(EvoError, match=r"DVC remote 'dead' \(.*gone\) does not exist"):
        dvc(["push"], clone)
    # A default that names no defined remote, and a config DVC cannot parse: one line naming the file.
    local = clone / ".dvc" / "config.local"
    local.write_text("[core]\n    remote = nowhere\n")
    with pytest.raises(EvoError, match=r"DVC default remote 'nowhere' is not defined in .*clone/.dvc/config"):
        check_remote(clone)
    local.write_text("[core\nremote = = x\n")
    with pytest.raises(EvoError, match=r"DVC config in .*clone/.dvc is invalid: ") as e:
        check_remote(clone)
    assert "\n" not in str(e.value) and local.read_text() == "[core\nremote = = x\n"  # reported, not rewritten


def test_stale_lock_is_named_and_cleared(repo):
    proc = subprocess.Popen(["true"])
    proc.wait()
    lock = repo / ".dvc" / "tmp" / "rwlock"
    lock.parent.mkdir(exist_ok=True)
    held = {"pid": proc.pid, "cmd": "dvc repro"}  # a dead `dvc repro` holds every path it wrote and read
    lock.write_text(json.dumps({"read": {str(repo / "data" / "demos"): [held]}, "write": {str(repo / "data" / "pairs"): held}}))
    with pytest.raises(EvoError, match=rf"stale DVC lock .*rwlock: process {proc.pid} \('dvc repro'\) died"):
        dvc(["status", *DATA], repo)
    assert unlock(repo) == [proc.pid]  # named once
    assert str(proc.pid) not in lock.read_text()
    dvc(["status", *DATA], repo)  # raises if the lock still blocks


def test_unlock_waits_for_dvcs_guard_and_leaves_a_live_lock_untouched(repo):
    """A second retrain's preflight clears stale locks while the first retrain's ``dvc repro`` runs:
    it must take DVC's guard (DVC rewrites ``rwlock`` in place under it) and must not rewrite a lock
    whose holders are alive. CI saw ``dvc repro`` stop on an emptied ``rwlock`` ("JSON structure is
    corrupted") when it did neither."""
    import threading

    tmp = repo / ".dvc" / "tmp"
    tmp.mkdir(exist_ok=True)
    lock = tmp / "rwlock"
    live = {"pid": os.getpid(), "cmd": "dvc repro --single-item grpo_games"}
    lock.write_text(json.dumps({"read": {str(repo / "data" / "demos"): [live]}, "write": {}}))
    before = (lock.stat().st_ino, lock.stat().st_mtime_ns)
    assert unlock(repo) == [] and (lock.stat().st_ino, lock.stat().st_mtime_ns) == before  # not rewritten

    # DVC holds its guard (as while editing rwlock) in another process: unlock and check_lock wait for it.
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from dvc.lock import make_lock; l = make_lock(sys.argv[1], tmp_dir=sys.argv[2]); "
                               "l.lock(); print('held', flush=True); sys.stdin.read()", str(tmp / "rwlock.lock"), str(tmp)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = subprocess.Popen(["true"])
        proc.wait()
        dead = {"pid": proc.pid, "cmd": "dvc repro"}
        lock.write_text(json.dumps({"read": {str(repo / "data" / "demos"): [live, dead]}, "write": {}}))
        done = {}

        def checked():
            try:
                check_lock(repo)
                done["check"] = "no stale holder"
            except EvoError as e:
                done["check"] = str(e)

        t = threading.Thread(target=lambda: done.update(pids=unlock(repo)))
        c = threading.Thread(target=checked)
        t.start(), c.start()
        t.join(5)  # longer than one round of DVC's retries
        assert t.is_alive() and c.is_alive() and not done and str(proc.pid) in lock.read_text()
    finally:
        holder.stdin.close()
        holder.wait(10)
    t.join(30), c.join(30)
    assert done["pids"] == [proc.pid]
    # check_lock read the file whole, before or after unlock dropped the dead holder, never half-written.
    assert done["check"] in ("no stale holder", f"stale DVC lock {lock}: process {proc.pid} ('dvc repro') died holding {repo / 'data' / 'demos'}; "
                                                "run `evoharness unlock` to clear it"), done
    assert json.loads(lock.read_text())["read"][str(repo / "data" / "demos")] == [live]
    assert not list(tmp.glob("rwlock.tmp.*"))
    try:
        dvc(["status", *DATA], repo)  # DVC reads what unlock wrote
    finally:
        lock.unlink()  # this process's entry would block the module's later `dvc repro`


def test_a_lock_file_dvc_cannot_read_stops_every_command_and_is_kept_aside(repo):
    tmp = repo / ".dvc" / "tmp"
    tmp.mkdir(exist_ok=True)
    lock = tmp / "rwlock"
    for text in ('{"read": {', '["not", "a", "lock"]'):
        lock.write_text(text)
        with pytest.raises(EvoError, match=r"DVC lock .*rwlock is corrupt; no DVC command can run until it is removed \(`evoharness unlock`\)$"):
            dvc(["status", *DATA], repo)
        assert unlock(repo) == [] and not lock.exists()
        kept = tmp / f"rwlock.corrupt.{os.getpid()}"
        assert kept.read_text() == text  # kept aside for a look, not deleted
        kept.unlink()
    dvc(["status", *DATA], repo)


def test_reproduce_finds_the_commit_behind_an_mlflow_run(repo, mlflow_template, monkeypatch):
    from evoharness.ops import tracking

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    shutil.copy(mlflow_template, repo / "mlflow.db")  # the project's default store, as a retrain leaves it
    head = git(["rev-parse", "HEAD"], repo)
    c = tracking.client(repo)
    run = c.create_run(tracking.experiment_id(c, repo), tags={"git_commit": head})
    assert find_record(run.info.run_id, repo) == (head, f"MLflow run {run.info.run_id} (its git_commit tag: no record of it in git)")
    with pytest.raises(EvoError, match=r"is neither a retrain's MLflow run id .* nor a git ref, nor an output hash"):
        find_record("0" * 32, repo)


def test_outputs_left_on_the_remote_count_as_up_to_date_only_while_absent(tmp_path):
    """A pool retrain's scheduler never pulls the weights (pool.stay_on_remote): an output under such a path that
    is absent here, and a dep on it, are up to date while the remote holds it; the same output half there, changed,
    or lost by the remote, is not, and a remote that is gone stops the check."""
    from evoharness.ops import stagerun

    root = tmp_path / "p"
    root.mkdir()
    git(["init", "-q"], root)
    dvc(["init", "-q"], root)
    (root / "dvc.yaml").write_text(yaml.safe_dump({"stages": {
        "train": {"cmd": "mkdir -p data/models/m && echo w > data/models/m/w.bin && echo c > data/models/m/config.json", "outs": ["data/models/m"]},
        "evaluate": {"cmd": "ls data/models/m > data/eval.txt", "deps": ["data/models/m"], "outs": ["data/eval.txt"]}}}))
    dvc(["repro"], root)
    store = tmp_path / "store"
    store.mkdir()
    dvc(["remote", "add", "-d", "store", str(store)], root)
    dvc(["push"], root)
    assert stagerun.up_to_date(root) and stagerun.changes(root, "dvc.yaml") == {}
    shutil.rmtree(root / "data" / "models")  # in the cache, not in the workspace: "deleted"
    assert not stagerun.up_to_date(root)  # plain DVC: the outputs are gone
    assert stagerun.up_to_date(root, ["data/models"]) and stagerun.stage_up_to_date(root, "evaluate", ["data/models"])
    assert not stagerun.stage_up_to_date(root, "train", ["data/other"])
    shutil.rmtree(root / ".dvc" / "cache")  # as on a scheduler that never held them: "not in cache"
    assert stagerun.stage_up_to_date(root, "train", ["data/models"])
    assert json.dumps(stagerun.changes(root, "dvc.yaml", ["data/models"])) == '{"evaluate": [{"changed outs": {"data/eval.txt": "not in cache"}}]}'
    # The remote loses the weights, or one file of them: neither here nor there, so the stage is not up to date any
    # more (DVC's own `status --cloud` reports nothing for the first and "deleted", i.e. there, for the second).
    md5 = next(o["md5"] for o in parse_lock((root / "dvc.lock").read_text())["train"]["outs"] if o["path"] == "data/models/m")
    listing = store / "files" / "md5" / md5[:2] / md5[2:]
    w = next(e["md5"] for e in json.loads(listing.read_text()) if e["relpath"] == "w.bin")
    for lost, want in ((store / "files" / "md5" / w[:2] / w[2:], "data/models/m/w.bin"), (listing, "data/models/m")):
        kept = lost.read_bytes()
        lost.unlink()
        assert stagerun.changes(root, "train", ["data/models"]) == {"train": [{"not on the remote": {want: "missing"}}]}
        assert not stagerun.stage_up_to_date(root, "train", ["data/models"]) and not stagerun.up_to_date(root, ["data/models"])
        lost.write_bytes(kept)
    assert stagerun.stage_up_to_date(root, "train", ["data/models"])
    shutil.move(store, tmp_path / "gone")  # a remote that cannot be asked: one line, not "up to date"
    with pytest.raises(EvoError, match="DVC remote 'store' .* does not exist"):
        stagerun.stage_up_to_date(root, "train", ["data/models"])
    shutil.move(tmp_path / "gone", store)
    # Half there, or changed: counted, whatever stay_on_remote says.
    (root / "data" / "models" / "m").mkdir(parents=True)
    (root / "data" / "models" / "m" / "config.json").write_text("c\n")
    assert not stagerun.stage_up_to_date(root, "train", ["data/models"])


def test_the_run_caches_metrics_push_fails_in_one_line_naming_what_and_where(tmp_path):
    """push_run_cache's own process (``python -m evoharness.ops.stagerun``): whatever stops it reaches the caller as
    one line naming the step and the folder."""
    from evoharness.ops.vcs import python_module

    with pytest.raises(EvoError) as e:
        python_module("evoharness.ops.stagerun", ["push-uncached-run-outputs", str(tmp_path)], tmp_path, "pushing the run-cache's metrics objects")
    msg = str(e.value)
    assert msg.startswith(f"pushing the run-cache's metrics objects in {tmp_path}: ") and "\n" not in msg, msg
    assert "Traceback" not in msg and len(msg) < 500
