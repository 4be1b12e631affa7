"""The training commands: the base model, SFT and cost-aware GRPO; on a launched profile each re-launches itself under
``accelerate launch`` and only the main process writes."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from evoharness.cli.app import PARAMS, app, finish_process, main_echo, relaunch, selected_profile
from evoharness.core.errors import EvoError


@app.command("base-model")
def base_model(
    out: Path = typer.Option(Path("data/models/base")),
    demos: Path = typer.Option(Path("data/demos/demos.jsonl")),
    profile: Optional[str] = typer.Option(None, help="profile name (params profile)"),
    timing: Optional[Path] = typer.Option(None, help="wall-clock figures of pretraining (kept out of the hashed output)"),
    tokenizer: str = typer.Option("word", help="tiny: word (the tags are tokens) | byte-bpe (like Qwen3's: <action> takes "
                                  "several tokens; the toy GPU profile's base folder)"),
    heads: Optional[int] = typer.Option(None, help="tiny: attention heads instead of the profile's (tiny-dist's base: 3, so that "
                                        "head_dim is 32, which vLLM's CPU attention takes; it refuses 16 and 24)"),
    kv_heads: Optional[int] = typer.Option(None, help="tiny: key/value heads instead of the profile's"),
    params: str = PARAMS,
):
    """Make the profile's base model: tiny (built from a config, seeded) or a pretrained path."""
    from evoharness.core.config import load_params

    prof = selected_profile(params, profile)
    seed = load_params(params).seed
    if prof.base.kind == "tiny":
        from evoharness.agent.training.tiny import make_tiny_base

        cfg = prof.base.model_dump()
        cfg.update({k: v for k, v in (("heads", heads), ("kv_heads", kv_heads)) if v is not None})
        if cfg["hidden_size"] % cfg["heads"] or cfg["heads"] % cfg["kv_heads"]:
            raise EvoError(f"base model: hidden_size {cfg['hidden_size']}, heads {cfg['heads']} and kv_heads {cfg['kv_heads']} do not "
                           "divide (hidden_size by heads, heads by kv_heads)")
        info = make_tiny_base(demos, out, cfg, seed, timing, tokenizer)
        typer.echo(f"tiny base: {info['parameters']:,} parameters, vocabulary {info['vocab_size']}")
        return
    from evoharness.agent.training.checkpoint import check_checkpoint, write_pointer
    from evoharness.agent.training.profiles import resolve_model_path

    src = resolve_model_path(prof.base.path)
    if not src.is_dir():
        raise EvoError(f"profile {prof.name}: base model {prof.base.path} ({src}) does not exist on this machine; put the checkpoint there "
                       f"(e.g. `hf download Qwen/Qwen3-8B --local-dir {prof.base.path}`) or set profiles.{prof.name}.base.path")
    check_checkpoint(src, f"profile {prof.name}: base model")
    doc = write_pointer(out, src, prof.base.path)
    typer.echo(f"base: {prof.base.path} ({src}, weights {doc['weights']}); pointer in {out}")


@app.command()
def sft(
    pairs_dir: Path = typer.Option(Path("data/pairs"), "--pairs"),
    base: Path = typer.Option(Path("data/models/base")),
    out: Path = typer.Option(Path("data/models/sft-inline")),
    mode: str = typer.Option("inline", help="inline (pairs as collected) | env_only (the same demos without the harness)"),
    metrics: Optional[Path] = typer.Option(None),
    checkpoints: Optional[Path] = typer.Option(None, help="checkpoint folder kept across kills (default: beside --out)"),
    timing: Optional[Path] = typer.Option(None, help="wall-clock figures (kept out of hashed outputs)"),
    profile: Optional[str] = typer.Option(None),
    max_steps: Optional[int] = typer.Option(None),
    params: str = PARAMS,
):
    """Supervised fine-tuning with TRL SFTTrainer (loss on the response only; resumes from checkpoints)."""
    import sys as _sys

    from evoharness.agent.training.sft import train_sft
    from evoharness.core.config import load_params

    prof = selected_profile(params, profile)
    if relaunch(prof, _sys.argv[1:], {"sft: base model": base}):
        return
    m = train_sft(pairs_dir, base, out, prof, mode, load_params(params).seed, max_steps, checkpoints, timing)
    finish_process(metrics, m)
    main_echo(f"sft ({mode}): {m['steps']} steps, train loss {m['train_loss']}, eval loss {m['eval_loss']}, {m['launch']}")


@app.command()
def grpo(
    games_root: Path = typer.Option(Path("data/games"), "--games"),
    sft_dir: Path = typer.Option(Path("data/models/sft-inline"), "--sft"),
    bank: Optional[Path] = typer.Option(Path("data/demos/experience.json")),
    out: Path = typer.Option(Path("data/models/grpo")),
    metrics: Optional[Path] = typer.Option(None),
    curve: Optional[Path] = typer.Option(None, help="per-update curve JSONL (DVC plot)"),
    checkpoints: Optional[Path] = typer.Option(None),
    timing: Optional[Path] = typer.Option(None),
    profile: Optional[str] = typer.Option(None),
    steps: Optional[int] = typer.Option(None),
    mode: str = typer.Option("inline", help="the harness the rollouts act through: inline | env_only (plain GRPO)"),
    without: str = typer.Option("", help="harness modules switched off, comma-separated: belief, progress, experience (ablations)"),
    reward: str = typer.Option("cost-aware", help="cost-aware (the paper's composite reward) | success (10 for a win, nothing else)"),
    seed: Optional[int] = typer.Option(None, help="override params seed (bench/grpo_seeds.py trains one model per seed)"),
    params: str = PARAMS,
):
    """Cost-aware GRPO with TRL GRPOTrainer: groups of rollouts of one game on the real engine."""
    import sys as _sys

    from evoharness.agent.harness.workspace import HarnessConfig
    from evoharness.core.config import load_params

    prof = selected_profile(params, profile)
    if relaunch(prof, _sys.argv[1:], {"grpo: SFT model": sft_dir}):
        return
    from evoharness.agent.training.grpo import train_grpo

    p = load_params(params)
    off = [w.strip() for w in without.split(",") if w.strip()]
    bad = [w for w in off if w not in ("belief", "progress", "experience")]
    if bad or mode not in ("inline", "env_only") or reward not in ("cost-aware", "success"):
        raise EvoError(f"grpo: --mode {mode!r}, --without {without!r}, --reward {reward!r}: expected inline|env_only, belief/progress/experience, cost-aware|success")
    harness = HarnessConfig(mode=mode, **{w: False for w in off})
    rc = p.episode.reward.model_copy(update={"updates": steps or prof.grpo.steps})
    if reward == "success":
        rc = rc.model_copy(update={"eff": 0.0, "div_max": 0.0, "spam": 0.0, "inv": 0.0})
    r = train_grpo(games_root, sft_dir, bank if mode != "env_only" else None, out, prof, rc, p.seed if seed is None else seed, p.workers, steps,
                   checkpoints, curve, timing,
                   harness=harness, consolidator=p.consolidator.endpoint)
    finish_process(metrics, r)
    last = r["last"] or {}
    main_echo(f"grpo: {r['steps']} updates, {r['episodes']} episodes; last step success {last.get('success')} calls {last.get('calls_per_episode')}")
