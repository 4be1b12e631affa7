"""Training on the tiny model with the real TRL trainers: micro SFT (and resume), micro GRPO,
group construction, prompt identity across SFT / GRPO / evaluation, DeepSpeed and profile configs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from evoharness.core.errors import EvoError

ROOT = Path(__file__).resolve().parents[1]
TINY = {"hidden_size": 32, "intermediate_size": 64, "layers": 1, "heads": 2, "kv_heads": 1, "max_length": 1024}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, games_root):
    """Demos, pairs, a tiny base and a 2-step SFT model."""
    from evoharness.agent.alfworld.games import list_games
    from evoharness.agent.collect import collect
    from evoharness.agent.pairs import build_pairs
    from evoharness.agent.episode import EpisodeConfig
    from evoharness.agent.policies import PolicySpec
    from evoharness.agent.training.profiles import BaseModelSpec, Profile, SFTSpec
    from evoharness.agent.training.sft import train_sft
    from evoharness.agent.training.tiny import make_tiny_base

    d = tmp_path_factory.mktemp("train")
    collect(list_games(games_root, "train"), PolicySpec(kind="teacher"), EpisodeConfig(), 6, d / "demos", batch_size=6, workers=2, seed=2)
    build_pairs(d / "demos" / "demos.jsonl", d / "pairs", 0.2, 0)
    make_tiny_base(d / "demos" / "demos.jsonl", d / "base", TINY, 0)
    profile = Profile(name="t", base=BaseModelSpec(kind="tiny", **TINY), sft=SFTSpec(batch_size=4, save_steps=1, eval_steps=1, max_length=1024))
    metrics = train_sft(d / "pairs", d / "base", d / "sft", profile, "inline", 0, max_steps=2)
    return {"dir": d, "profile": profile, "sft_metrics": metrics}


def test_tiny_base_is_a_normal_hugging_face_checkpoint(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from evoharness.agent.episode import parse_response

    base = trained["dir"] / "base"
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.vocab_size == len(tok)
    resp = "<think>I take the mug 2 from the cabinet 13.</think>\n<action>take mug 2 from cabinet 13</action>"
    back = tok.decode(tok(resp, add_special_tokens=False)["input_ids"])
    assert parse_response(back).action == "take mug 2 from cabinet 13"
    assert tok.unk_token_id not in tok("go to countertop 1", add_special_tokens=False)["input_ids"]
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True).endswith("<|im_start|>assistant\n")


def test_micro_sft_trains_on_the_response_only_and_resumes(trained):
    from evoharness.agent.training.sft import load_rows, to_dataset, train_sft
    from transformers import AutoTokenizer

    m = trained["sft_metrics"]
    d = trained["dir"]
    assert m["steps"] == 2 and m["train_loss"] > 0 and m["eval_loss"] is not None and m["resumed_from"] is None
    assert (d / "sft" / "config.json").exists() and len(list((d / "sft-checkpoints").glob("*/checkpoint-2"))) == 1
    # a killed run (here: a longer budget) resumes from the last checkpoint instead of starting over
    again = train_sft(d / "pairs", d / "base", d / "sft", trained["profile"], "inline", 0, max_steps=3)
    assert again["resumed_from"] == "checkpoint-2" and again["steps"] == 3
    # a resumed run's loss is the mean over the whole run's logged losses, not the trainer's figure for the steps after
    # the checkpoint (0.0 when it resumed at its last one); no step of this 3-step run logged one (logging_steps 5),
    # so it is unknown
    assert again["train_loss"] is None
    # loss on the response only: TRL's labels are -100 on the prompt, the response and its EOS are learned
    from trl import SFTConfig, SFTTrainer
    from transformers import AutoModelForCausalLM

    tok = AutoTokenizer.from_pretrained(d / "base")
    train, _ = load_rows(d / "pairs", "inline")
    ds = to_dataset(train.head(3), tok)
    t = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(d / "base"), args=SFTConfig(output_dir=str(d / "x"), report_to=[], use_cpu=True, max_length=1024),
                   train_dataset=ds, processing_class=tok)
    row = t.train_dataset[0]
    n_resp = len(tok(train.response.iloc[0], add_special_tokens=False)["input_ids"]) + 1
    learned = [x for x in row["labels"] if x != -100]
    assert len(learned) == n_resp and row["labels"][: len(row["input_ids"]) - n_resp] == [-100] * (len(row["input_ids"]) - n_resp)


def test_env_only_projection_is_the_same_demos_without_the_harness(trained):
    from evoharness.agent.training.sft import load_rows

    inline, _ = load_rows(trained["dir"] / "pairs", "inline")
    env, _ = load_rows(trained["dir"] / "pairs", "env_only")
    assert len(env) == (inline.kind == "env").sum()
    assert not env.prompt.str.contains("track \\[query\\]|PLAN:|HINTS:|RESULT:").any()
    assert not env.prompt.str.contains("LAST ACTIONS: .*(recall|commit|track|note) ", regex=True).any()
    assert set(env.response) <= set(inline.response)


def test_group_blocks():
    from evoharness.agent.training.grpo_rollouts import group_blocks

    assert group_blocks(["a"] * 4 + ["b"] * 4, 4) == ["a", "b"]
    assert group_blocks(["a", "b", "c"], 4) == ["a", "b", "c"]
    assert group_blocks(["a"] * 8, 4) == ["a", "a"]  # the same game drawn twice: two groups


def test_micro_grpo_step_with_the_real_trainer(trained, games_root, tmp_path):
    from evoharness.agent.harness.experience import Experience
    from evoharness.agent.reward import RewardConfig
    from evoharness.agent.training.grpo import train_grpo
    from evoharness.agent.training.profiles import GRPOSpec, Profile

    prof = Profile(name="t", base=trained["profile"].base, sft=trained["profile"].sft,
                   grpo=GRPOSpec(games_per_step=1, rollouts=2, turns_per_rollout=2, steps=1, max_new_tokens=12, max_steps_per_episode=3, learning_rate=1e-3))
    from hosts import start_consolidator

    bank = tmp_path / "bank.json"
    Experience.seeded().save(bank)
    # The bank is consolidated between batches by an LLM over HTTP (an OpenAI-compatible server on loopback).
    srv = start_consolidator([json.dumps([{"op": "add", "category": "notes", "key": "evolver", "text": "a note the evolver wrote"}])])
    try:
        r = train_grpo(games_root, trained["dir"] / "sft", bank, tmp_path / "grpo", prof, RewardConfig(updates=1), seed=0, workers=2, steps=1,
                       curve=tmp_path / "curve.jsonl", timing=tmp_path / "timing.json",
                       consolidator=f"chat:base_url=http://127.0.0.1:{srv.server_port}/v1,model=evolver")
    finally:
        srv.shutdown()
    assert len(srv.seen) == 1 and "EVIDENCE: " in srv.seen[0][1]["messages"][0]["content"]
    assert r["steps"] == 1 and r["episodes"] == 2 and r["launch"]["processes"] == 1 and r["launch"]["zero_stage"] == 0
    curve = [json.loads(x) for x in (tmp_path / "curve.jsonl").read_text().splitlines()]
    assert len(curve) == 1 and set(curve[0]["reward"]) == {"success", "efficiency", "diversity", "repeats", "invalid", "total"}
    assert set(curve[0]["calls_per_episode"]) == {"track", "commit", "recall", "note"} and curve[0]["diversity_weight"] == 1.0
    assert curve[0]["episode_length"] <= 3  # meta-actions are charged: the budget binds every turn
    evolved = Experience.load(tmp_path / "grpo" / "experience.json")
    assert evolved.updates == 1 and evolved.entries[-1].text == "a note the evolver wrote"  # consolidated after the batch, by the evolver
    assert curve[0]["bank_edits"] == {"add": 1} and curve[0]["bank_replies_refused"] == 0
    assert (tmp_path / "grpo" / "config.json").exists() and json.loads((tmp_path / "timing.json").read_text())["seconds"] > 0


def test_rollout_rows_come_in_groups_of_one_game(trained, games_root):
    """Each group's rows are that game's rollouts; rows carry their episode's reward."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from evoharness.agent.alfworld.games import list_games
    from evoharness.agent.envpool import EnvPool
    from evoharness.agent.harness.experience import Experience
    from evoharness.agent.reward import RewardConfig
    from evoharness.agent.training.grpo_rollouts import Rollouts
    from evoharness.agent.training.profiles import GRPOSpec, Profile

    d = trained["dir"]
    prof = Profile(name="t", base=trained["profile"].base, grpo=GRPOSpec(games_per_step=2, rollouts=2, turns_per_rollout=3, max_new_tokens=8, max_steps_per_episode=2))
    games = {g.id: g for g in list_games(games_root, "train")}
    a = next(g for g in sorted(games) if games[g].family == "pick_and_place_simple")
    b = next(g for g in sorted(games) if games[g].family == "pick_heat_then_place_in_recep")
    model = AutoModelForCausalLM.from_pretrained(d / "sft")
    tok = AutoTokenizer.from_pretrained(d / "sft")
    # The trainer's side of the rollout_func contract: its (wrapped) model, a real accelerator, the step counter.
    from accelerate import Accelerator

    trainer = SimpleNamespace(model_wrapped=model, accelerator=Accelerator(cpu=True), state=SimpleNamespace(global_step=0))
    with EnvPool(2) as pool:
        ro = Rollouts(games, prof, Experience.seeded(), pool, tok, d / "ro", RewardConfig(), 0, d / "ro-curve.jsonl")
        (d / "ro").mkdir(exist_ok=True)
        out = ro([a] * 6 + [b] * 6, trainer)
    assert len(out["prompt_ids"]) == 12 and len(out["episode_reward"]) == 12
    # The loss covers the tokens the policy chose; those the constraint forced (log-prob exactly 0) are masked.
    assert all(len(m) == len(c) == len(lp) for m, c, lp in zip(out["env_mask"], out["completion_ids"], out["logprobs"]))
    assert all(m[0] == 0 for m in out["env_mask"]) and any(sum(m) for m in out["env_mask"])  # '<think>' is forced; replies have choices
    texts = [tok.decode(p) for p in out["prompt_ids"]]
    objective = lambda t: t.split("OBJECTIVE : ")[-1]  # the field (the last line), not the system text  # noqa: E731
    # rows 0-5 are game a's group, rows 6-11 game b's: one objective per group, two different games
    assert len({objective(t) for t in texts[:6]}) == 1 and len({objective(t) for t in texts[6:]}) == 1
    assert objective(texts[0]) != objective(texts[6])  # a Pick task and a Heat task: never the same text
    # 2 rollouts x 3 rows: each row carries its own episode's reward
    curve = [json.loads(x) for x in (d / "ro-curve.jsonl").read_text().splitlines()]
    assert curve[-1]["episodes"] == 4 and len(set(out["episode_reward"][:6])) <= 2


def test_prompts_and_tokens_identical_across_sft_grpo_and_eval(trained, games_root):
    from transformers import AutoTokenizer

    from evoharness.agent.alfworld.games import list_games
    from evoharness.agent.chat_format import render
    from evoharness.agent.envpool import EnvWorker
    from evoharness.agent.episode import EpisodeConfig, run_episode
    from evoharness.agent.harness.experience import Experience
    from evoharness.agent.policies.hf import HFPolicy, Sampler, load
    from evoharness.agent.training.grpo_rollouts import RecordingPolicy
    from evoharness.agent.training.sft import load_rows, to_dataset

    d = trained["dir"]
    demos = [json.loads(x) for x in (d / "demos" / "demos.jsonl").read_text().splitlines()]
    demo = demos[0]
    game = next(g for g in list_games(games_root, "train") if g.id == demo["game_id"])
    cfg = EpisodeConfig(max_steps=1)
    w = EnvWorker()
    try:
        ev = run_episode(w, game, HFPolicy(str(d / "sft"), max_new_tokens=8), cfg, Experience.seeded(), demo["seed"])
        tok, model, lock = load(str(d / "sft"))
        rec = RecordingPolicy(Sampler(model, tok, True, 1.0, 8, lock), 0)
        gr = run_episode(w, game, rec, cfg, Experience.seeded(), demo["seed"])
    finally:
        w.close()
    assert demo["turns"][0]["prompt"] == ev.turns[0].prompt == gr.turns[0].prompt  # collection == eval == GRPO
    tok = AutoTokenizer.from_pretrained(d / "sft")
    ids_eval = tok(render(tok, ev.turns[0].prompt), add_special_tokens=False)["input_ids"]
    assert rec.turns[0].prompt_ids == ids_eval  # GRPO's tokens are evaluation's tokens
    train, val = load_rows(d / "pairs", "inline")
    rows = train[(train.episode_id == demo["episode_id"]) & (train.turn == 0)]
    rows = rows if len(rows) else val[(val.episode_id == demo["episode_id"]) & (val.turn == 0)]
    assert to_dataset(rows, tok)["prompt"][0] == render(tok, ev.turns[0].prompt)  # SFT's text is evaluation's text


def test_profiles_validate_and_name_a_wrong_field(tmp_path):
    from evoharness.agent.training.profiles import load_profile

    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    tiny = load_profile("tiny-cpu", ROOT / "params.yaml")
    big = load_profile("qwen3-8b-h200", ROOT / "params.yaml")
    assert tiny.base.kind == "tiny" and big.base.path == "~/models/Qwen3-8B" and big.sft.lora_r == 64 and big.sft.lora_alpha == 128
    assert (big.grpo.games_per_step, big.grpo.rollouts, big.grpo.steps, big.grpo.beta) == (16, 8, 150, 0.01)
    raw["profiles"]["tiny-cpu"]["sft"]["lerning_rate"] = 0.1
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump(raw))
    with pytest.raises(EvoError, match=r"profiles.tiny-cpu.sft.lerning_rate: Extra inputs are not permitted"):
        load_profile("tiny-cpu", p)
    with pytest.raises(EvoError, match=r"no profile 'huge'"):
        load_profile("huge", p)
    # Beside the project's dvc.yaml, a profile must name every key a stage depends on (DVC would refuse the stage).
    shutil.copy(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    del raw["profiles"]["tiny-cpu"]["sft"]["lerning_rate"]
    del raw["profiles"]["tiny-cpu"]["decoding"]
    p.write_text(yaml.safe_dump(raw))
    with pytest.raises(EvoError, match=r"params.yaml: profiles.tiny-cpu.decoding is missing; the stages in dvc.yaml depend on it"):
        load_profile("tiny-cpu", p)
    assert load_profile("qwen3-8b-h200", p).decoding == "constrained"


def _demo_prompts(d: Path, n: int):
    from evoharness.agent.episode import TurnView
    from evoharness.agent.harness.workspace import META_VERBS

    demos = [json.loads(x) for x in (d / "demos" / "demos.jsonl").read_text().splitlines()]
    out = []
    for t in [t for dm in demos for t in dm["turns"]][:n]:
        adm = tuple(t["prompt"].split("ADMISSIBLE COMMANDS: ")[1].split("\n")[0].split(" | "))
        out.append((t["prompt"], TurnView(verbs=META_VERBS, objective="", observation="", admissible=adm, last_actions=())))
    return out


def _decode_together(gen, prompts: list, seed: int) -> list:
    """Each prompt asked from its own thread at once, as episode threads ask (prompt i with seed ``seed + i``)."""
    import threading

    got: list = [None] * len(prompts)

    def go(i):
        got[i] = gen(prompts[i][0], seed=seed + i, view=prompts[i][1])

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return got


def test_shared_head_training_forward_is_the_plain_forward(trained):
    """``shared_head.install`` runs the prompts' shared system text once per batch in training
    forwards: the loss and every gradient equal the plain forward's up to float rounding, on
    right-padded rows (SFT, pretraining) and on left-padded prompts with right-padded completions
    (GRPO's scoring); the head is really shared; generation, a single row and rows sharing too little
    take the plain path; a model it does not cover is left alone."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from evoharness.agent.chat_format import render
    from evoharness.agent.training import shared_head

    d = trained["dir"] / "sft"
    tok = AutoTokenizer.from_pretrained(d)
    plain = AutoModelForCausalLM.from_pretrained(d).train()
    mine = copy.deepcopy(plain)
    assert shared_head.install(mine) and shared_head.install(mine)  # idempotent
    rows = [tok(render(tok, p), add_special_tokens=False)["input_ids"] for p, _ in _demo_prompts(trained["dir"], 5)]
    head = shared_head.MIN_SHARED
    assert all(r[:head] == rows[0][:head] for r in rows)
    used: list = []
    real = shared_head.shared_forward

    def spy(*a, **k):
        out = real(*a, **k)
        used.append(out is not None)
        return out

    def run(model, ids, attn, **kw):
        model.zero_grad()
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False, **kw).logits
        keep = attn[:, -logits.size(1):].bool()
        loss = torch.log_softmax(logits.float(), -1)[keep][:, 7].sum()  # every kept position's logits feed it
        loss.backward()
        return logits[keep].detach(), [p.grad.clone() for p in model.parameters()]

    width = max(len(r) for r in rows) + 3
    for side in ("right", "left"):
        ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            s = 0 if side == "right" else width - len(r) - i % 2  # left padding, and right padding behind some rows
            ids[i, s : s + len(r)] = torch.tensor(r)
            attn[i, s : s + len(r)] = 1
        for kw in ({}, {"logits_to_keep": 9}):
            ref_logits, ref_grads = run(plain, ids, attn, **kw)
            shared_head.shared_forward = spy
            try:
                got_logits, got_grads = run(mine, ids, attn, **kw)
            finally:
                shared_head.shared_forward = real
            assert used.pop() is True, side
            assert float((got_logits - ref_logits).abs().max()) < 1e-4, side
            scale = max(float(g.abs().max()) for g in ref_grads)
            assert max(float((a - b).abs().max()) for a, b in zip(got_grads, ref_grads)) < 1e-5 * scale, side
    shared_head.shared_forward = spy
    try:
        with torch.no_grad():
            mine(input_ids=ids, attention_mask=attn)  # generation's prefill: use_cache, plain path
            mine(input_ids=ids[:1], attention_mask=attn[:1], use_cache=False)  # one row: nothing to share
            other = ids.clone()
            other[1, int((attn[1] == 0).sum()) + 2] = (other[1, int((attn[1] == 0).sum()) + 2] + 1) % len(tok)
            mine(input_ids=other, attention_mask=attn, use_cache=False)  # rows part after 2 tokens
    finally:
        shared_head.shared_forward = real
    assert used == [False]  # only the last call reached it, and it declined
    mine.config.use_sliding_window = True
    assert not shared_head.applies(mine)


def test_constrained_decoding_gives_a_legal_action_even_from_random_weights(trained):
    """The untrained base samples garbage freely; under the constraint every response parses and
    its action is an admissible command or a meta-verb, within the token budget."""
    import threading

    from evoharness.agent.episode import parse_response
    from evoharness.agent.harness.workspace import META_VERBS
    from evoharness.agent.policies.batched import BatchedGenerator
    from evoharness.agent.policies.hf import load

    tok, model, _ = load(str(trained["dir"] / "base"))
    prompts = _demo_prompts(trained["dir"], 6)
    free = BatchedGenerator(model, tok, True, 1.0, 24, constrained=False)
    con = BatchedGenerator(model, tok, True, 1.0, 24, constrained=True)
    outs: dict = {}

    def go(name, g, i):
        outs[name, i] = g(prompts[i][0], seed=i, view=prompts[i][1])

    threads = [threading.Thread(target=go, args=(n, g, i)) for n, g in (("free", free), ("con", con)) for i in range(len(prompts))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert con.batches < len(prompts)  # the six episodes' requests were decoded together
    assert sum(parse_response(outs["free", i].text).error is None for i in range(len(prompts))) == 0
    for i, (_, view) in enumerate(prompts):
        s = outs["con", i]
        p = parse_response(s.text)
        assert p.error is None, s.text
        assert p.action in view.admissible or p.verb in META_VERBS, p.action
        assert len(s.completion_ids) <= 24 and len(s.logprobs) == len(s.completion_ids)
        assert all(lp <= 0 for lp in s.logprobs)


def test_batched_decoding_matches_one_prompt_at_a_time(trained):
    """Batching changes the speed, not the tokens: greedy and seeded sampling give what ``Sampler``
    gives for each prompt alone (logprobs equal up to float rounding)."""
    from evoharness.agent.policies.batched import BatchedGenerator
    from evoharness.agent.policies.hf import Sampler, load

    tok, model, lock = load(str(trained["dir"] / "sft"))
    prompts = _demo_prompts(trained["dir"], 5)
    for sample in (False, True):
        one = Sampler(model, tok, sample, 1.0, 16, lock, constrained=True)
        ref = [one(p, seed=10 + i, view=v) for i, (p, v) in enumerate(prompts)]
        got = _decode_together(BatchedGenerator(model, tok, sample, 1.0, 16, constrained=True), prompts, 10)
        assert [g.completion_ids for g in got] == [r.completion_ids for r in ref]
        assert [g.prompt_ids for g in got] == [r.prompt_ids for r in ref]
        assert max(abs(x - y) for g, r in zip(got, ref) for x, y in zip(g.logprobs, r.logprobs)) < 1e-4


def test_generation_runs_only_on_the_generators_decoder_thread(trained):
    """Episode threads queue their requests; one decoder thread, bound to the generator's device, runs every
    forward pass (on a GPU box a new thread's CUDA device is 0 whatever its rank's: decoding from episode
    threads would launch ranks 1-7 on GPU 0). Checked on every forward step, not only on batches."""
    import threading

    from evoharness.agent.policies.batched import BatchedGenerator
    from evoharness.agent.policies.hf import load

    tok, model, _ = load(str(trained["dir"] / "sft"))
    prompts = _demo_prompts(trained["dir"], 4)
    forwards: set[int] = set()
    # the embedding runs in every forward, the model's own and fastdecode's step alike
    hook = model.get_input_embeddings().register_forward_pre_hook(lambda *_: forwards.add(threading.get_ident()))
    episode_threads: set[int] = set()
    try:
        gen = BatchedGenerator(model, tok, True, 1.0, 16, constrained=True)
        got: list = [None] * len(prompts)

        def go(i):
            episode_threads.add(threading.get_ident())
            got[i] = gen(prompts[i][0], seed=i, view=prompts[i][1])

        for _ in range(2):  # two bursts: the decoder thread may end between them, never an episode thread decodes
            threads = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
            [t.start() for t in threads]
            [t.join() for t in threads]
    finally:
        hook.remove()
    assert all(g is not None and g.completion_ids for g in got)
    assert forwards and forwards <= gen.decoder_threads, (forwards, gen.decoder_threads)
    assert not forwards & (episode_threads | {threading.get_ident()})


def test_fast_decoding_step_is_the_models_own_forward(trained):
    """``fastdecode.Qwen3Step`` (the decoding step without transformers' per-call machinery) gives the
    logits the model's forward gives, step after step, on left-padded rows; rows dropped mid-way keep
    theirs. A model it does not cover is left to transformers."""
    import torch

    from evoharness.agent.policies.fastdecode import Qwen3Step, supports
    from evoharness.agent.policies.hf import load

    tok, model, _ = load(str(trained["dir"] / "sft"))
    assert supports(model)
    g = torch.Generator().manual_seed(0)
    n, width = 5, 60
    ids = torch.randint(5, len(tok), (n, width), generator=g)
    attn = torch.ones_like(ids)
    for i in range(n):
        attn[i, : 9 * i] = 0  # left padding of different widths
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)
        past, last = out.past_key_values, pos[:, -1]
        fast = Qwen3Step(model)
        fast.start(past, attn, last, 12)
        worst = 0.0
        for s in range(10):
            if s == 5:  # rows 1 and 3 finish: both paths drop them
                keep = torch.tensor([0, 2, 4])
                past.batch_select_indices(keep)
                attn, last, ids = attn[keep], last[keep], ids[keep]
                fast.keep(keep)
            nxt = torch.randint(5, len(tok), (attn.size(0),), generator=g)
            attn = torch.cat([attn, torch.ones((attn.size(0), 1), dtype=torch.long)], 1)
            last = last + 1
            ref = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=last[:, None], past_key_values=past, use_cache=True)
            past = ref.past_key_values
            mine = fast.step(nxt)
            assert mine.shape == ref.logits[:, -1].shape
            worst = max(worst, float((mine - ref.logits[:, -1].float()).abs().max()))
    assert worst < 1e-4, worst
    model.config.use_sliding_window = True
    try:
        assert not supports(model)
    finally:
        model.config.use_sliding_window = False


def test_fast_batched_decoding_gives_the_tokens_of_transformers_decoding(trained):
    """The decoder's fast path (the prompts' shared head encoded once, steps by ``Qwen3Step``) decodes
    the tokens transformers' own path decodes, greedy and seeded, for prompts of different lengths."""
    from evoharness.agent.policies.batched import BatchedGenerator
    from evoharness.agent.policies.hf import load

    tok, model, _ = load(str(trained["dir"] / "sft"))
    prompts = _demo_prompts(trained["dir"], 6)
    assert len({len(tok(p)["input_ids"]) for p, _ in prompts}) > 1
    for sample in (False, True):
        outs = {}
        for fast in (False, True):
            b = BatchedGenerator(model, tok, sample, 1.0, 16, constrained=True, fast=fast)
            got = _decode_together(b, prompts, 20)
            assert b.batches < len(prompts)
            assert (b.stepper is not None) == fast and bool(b._heads) == fast  # the fast run used a shared head
            outs[fast] = got
        assert [g.completion_ids for g in outs[True]] == [g.completion_ids for g in outs[False]]
        assert max(abs(x - y) for a, r in zip(outs[True], outs[False]) for x, y in zip(a.logprobs, r.logprobs)) < 1e-4


def test_tiny_base_pretraining_learns_the_games_text_not_the_replies(trained, tmp_path):
    """``pretrain_epochs``: language modelling on the demos' prompts before SFT. The replies are
    never in its data, and the pretrained base predicts held-in prompt text better than the seed."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from evoharness.agent.chat_format import render
    from evoharness.agent.training.tiny import make_tiny_base

    demos = trained["dir"] / "demos" / "demos.jsonl"
    seedonly = make_tiny_base(demos, tmp_path / "seed", TINY, 0)
    pre = {**TINY, "pretrain_epochs": 4, "pretrain_lr": 1e-2}
    info = make_tiny_base(demos, tmp_path / "pre", pre, 0, timing=tmp_path / "t.json")
    assert seedonly["pretrain"] == {} and info["pretrain"]["steps"] > 0 and info["pretrain"]["prompts"] > 0
    assert info["pretrain"]["last_loss"] < info["pretrain"]["first_loss"]
    # A re-run gives the same bytes (DVC the same hash): the wall clock goes to the timing file only.
    make_tiny_base(demos, tmp_path / "again", pre, 0)
    assert {f.name: f.read_bytes() for f in (tmp_path / "pre").iterdir()} == {f.name: f.read_bytes() for f in (tmp_path / "again").iterdir()}
    assert json.loads((tmp_path / "t.json").read_text())["seconds"] > 0 and "seconds" not in (tmp_path / "pre" / "base_info.json").read_text()
    tok = AutoTokenizer.from_pretrained(tmp_path / "pre")
    prompt = json.loads(demos.read_text().splitlines()[0])["turns"][1]["prompt"]
    ids = tok(render(tok, prompt), add_special_tokens=False, return_tensors="pt")["input_ids"]

    def loss(folder):
        with torch.no_grad():
            return float(AutoModelForCausalLM.from_pretrained(folder)(ids, labels=ids).loss)

    assert loss(tmp_path / "pre") < loss(tmp_path / "seed") - 0.5
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"episode_id": "x", "turns": []}) + "\n")
    with pytest.raises(EvoError, match=r"empty.jsonl has no turns to pretrain on"):
        make_tiny_base(empty, tmp_path / "none", {**TINY, "pretrain_epochs": 1}, 0)


@pytest.fixture(scope="module")
def bpe_base(trained) -> Path:
    """A tiny base with the Qwen3-like byte-level BPE tokenizer (``<action>`` and ``</action>`` split)."""
    from evoharness.agent.training.tiny import make_tiny_base

    out = trained["dir"] / "bpe-base"
    make_tiny_base(trained["dir"] / "demos" / "demos.jsonl", out, TINY, 0, tokenizer="byte-bpe")
    return out


def test_a_tokenizer_without_the_tags_as_tokens_is_constrained_token_by_token(trained, bpe_base):
    """Qwen3's tokenizer has no ``<action>`` token: the constraint forces the tags' token sequences and
    still leaves only admissible moves, so every sampled reply of a random model parses and acts legally;
    the masks are not all True. A tokenizer that cannot write the tags at all is refused, never sampled free."""
    from evoharness.agent.episode import parse_response
    from evoharness.core.errors import PolicyError
    from evoharness.agent.policies.batched import BatchedGenerator
    from evoharness.agent.policies.constrain import ActionConstraint, tags_as_tokens
    from evoharness.agent.policies.hf import load
    from evoharness.agent.training.grpo_trainer import constraint_masks

    tok, model, _ = load(str(bpe_base))
    assert not tags_as_tokens(tok) and tags_as_tokens(load(str(trained["dir"] / "sft"))[0])
    assert len(tok("<action>", add_special_tokens=False)["input_ids"]) > 1 and len(tok("</action>", add_special_tokens=False)["input_ids"]) > 1
    prompts = _demo_prompts(trained["dir"], 6)
    got = _decode_together(BatchedGenerator(model, tok, True, 1.0, 40, constrained=True), prompts, 0)
    for s, (_, view) in zip(got, prompts):
        parsed = parse_response(s.text)
        assert parsed.error is None, s.text
        assert parsed.action in view.admissible or parsed.action.split(" ", 1)[0] in view.verbs, (parsed.action, s.text)
        assert s.text.endswith("</action>") and "</think>\n<action>" in s.text  # the teacher's separator, written exactly
        masks = constraint_masks(tok, [s.completion_ids], [(view.admissible, view.verbs)], 40, len(s.completion_ids), len(tok))
        assert (~masks).any(), "the constraint left every token allowed"
    from evoharness.agent.training.tiny import build_tokenizer

    no_tags = build_tokenizer(["go", "to", "desk", "1", "think", "action", "<", ">", "/"])
    with pytest.raises(PolicyError, match=r"cannot write the reply's tags .* exactly; use a tokenizer that can, or decoding: free"):
        ActionConstraint(no_tags, ("go to desk 1",), ())


@pytest.mark.parametrize("which,temperature", [("sft-word", 0.7), ("sft-word", 1.0), ("bpe", 0.7), ("bpe", 1.0)])
def test_the_trainer_scores_a_constrained_sample_as_the_sampler_did(trained, bpe_base, which, temperature):
    """GRPO's log-probabilities are those of the distribution the rollout sampled from: the trainer
    replays each row's constraint (``constraint_masks``) and renormalises over it, so for a
    constrained sample its per-token log-probs equal the sampler's, and the unconstrained ones do not.
    At both rollout temperatures, and with a tokenizer whose tags take several tokens."""
    import torch

    from evoharness.agent.policies.batched import BatchedGenerator
    from evoharness.agent.policies.hf import load
    from evoharness.agent.training.grpo_trainer import constrained_logps, constraint_masks

    tok, model, _ = load(str(trained["dir"] / "sft" if which == "sft-word" else bpe_base))
    prompts = _demo_prompts(trained["dir"], 4)
    got = _decode_together(BatchedGenerator(model, tok, True, temperature, 24, constrained=True), prompts, 0)
    width = max(len(s.completion_ids) for s in got)
    for s, (_, view) in zip(got, prompts):
        masks = constraint_masks(tok, [s.completion_ids], [(view.admissible, view.verbs)], 24, width, len(tok))
        ids = torch.tensor([s.prompt_ids + s.completion_ids + [tok.pad_token_id] * (width - len(s.completion_ids))])
        am = torch.tensor([[1] * (len(s.prompt_ids) + len(s.completion_ids)) + [0] * (width - len(s.completion_ids))])
        with torch.no_grad():
            lp, ent = constrained_logps(model, ids, am, width, masks, temperature, compute_entropy=True)
            free = torch.log_softmax(model(input_ids=ids, attention_mask=am).logits[:, -width - 1 : -1].float() / temperature, -1)
            free = free.gather(-1, ids[:, -width:].unsqueeze(-1)).squeeze(-1)
        n = len(s.completion_ids)
        assert torch.allclose(lp[0, :n], torch.tensor(s.logprobs), atol=1e-4), (lp[0, :n], s.logprobs)
        assert (lp[0, :n] >= free[0, :n] - 1e-5).all() and (lp[0, :n] - free[0, :n]).max() > 0.1  # renormalised, not the free model's
        assert torch.isfinite(ent[0, :n]).all()


def test_the_student_as_its_own_consolidator_through_the_same_interface(trained):
    """``consolidator.endpoint: hf:path=...``: the local model answers the consolidation prompt; what a 2-step student
    writes is no edit list, so the bank's entries stay as they were, with one warning line."""
    from evoharness.agent.harness.consolidate import consolidate, make_consolidator
    from evoharness.agent.harness.experience import Experience

    ep = make_consolidator(f"hf:path={trained['dir'] / 'sft'}")
    bank = Experience.seeded()
    before = [(e.id, e.text) for e in bank.entries]
    warnings: list[str] = []
    log = consolidate(bank, [], ep, warnings.append)
    assert isinstance(ep.complete("BANK: []"), str)  # the model really answers
    assert [(e.id, e.text) for e in bank.entries] == before and bank.updates == 1
    assert len(warnings) == 1 and "consolidator reply refused, bank unchanged" in warnings[0] and log[0]["op"] == "none"
    bad = make_consolidator("hf:path=/nowhere/model")
    consolidate(bank, [], bad, warnings.append)
    assert "consolidator checkpoint /nowhere/model does not load" in warnings[-1]
