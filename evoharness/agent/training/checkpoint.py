"""Model folders: where a pretrained base lives, whether its weights fit its config, what identifies
them, and a LoRA adapter merged into a full checkpoint.

A pretrained base is never copied into DVC: the base_model stage writes ``pointer.json`` holding the
path as the profile names it (resolved on whichever machine runs a stage: ``~/models/Qwen3-8B`` is the
GPU box's own folder) and the hashes of its config and weights, so DVC's hash of the stage's output is
the model's identity, not a path on one machine. Every stage after it loads full checkpoints: SFT and
GRPO with LoRA save their adapter under ``adapter/`` and the merged model beside it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from evoharness.core.errors import EvoError

POINTER = "pointer.json"
ADAPTER = "adapter"


def _sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


_DIGESTS: dict[tuple, str] = {}


def weights_digest(path: str | Path) -> str:
    """Identifies a checkpoint's weights: every (sharded) safetensors file's name and size and a hash
    of its first and last MiB, plus config.json. Cached per file state, so an episode pays nothing."""
    p = resolve_checkpoint(path)
    files = sorted(p.glob("*.safetensors")) + [p / "config.json"]
    key = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.exists())
    if key not in _DIGESTS:
        h = hashlib.sha256()
        for f in files:
            if not f.exists():
                continue
            size = f.stat().st_size
            with open(f, "rb") as fh:
                h.update(f"{f.name}:{size}".encode())
                h.update(fh.read(1 << 20))
                if size > 2 << 20:
                    fh.seek(-(1 << 20), 2)
                    h.update(fh.read())
        _DIGESTS[key] = h.hexdigest()[:16]
    return _DIGESTS[key]


def check_checkpoint(path: Path, what: str = "model") -> Path:
    """A folder holding a Hugging Face causal LM whose weights fit its config, else one line naming
    the folder and the first tensor that does not fit. Reads only the safetensors headers and builds
    the model on the meta device, so it costs seconds for the 8B and no memory."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    if not path.is_dir():
        raise EvoError(f"{what} {path} does not exist")
    if not (path / "config.json").is_file():
        raise EvoError(f"{what} {path} is not a Hugging Face checkpoint (no config.json)")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise EvoError(f"{what} {path} has no *.safetensors weights")
    try:
        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, OSError, KeyError) as e:
        raise EvoError(f"{what} {path}: config.json does not describe a causal LM ({str(e).splitlines()[0][:200]})") from None
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    names: dict[int, list[str]] = {}
    for n, prm in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(prm), []).append(n)
    tied = {n for group in names.values() if len(group) > 1 for n in group}
    found: dict[str, tuple] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    found[k] = tuple(h.get_slice(k).get_shape())
        except Exception as e:  # a truncated or foreign file: safetensors' own reason
            raise EvoError(f"{what} {path}: {f.name} is not readable safetensors ({str(e).splitlines()[0][:200]})") from None
    for k, shape in sorted(found.items()):
        if k in expected and expected[k] != shape:
            raise EvoError(f"{what} {path}: weights do not match config.json: {k} has shape {list(shape)}, the config gives {list(expected[k])}")
    missing = sorted(k for k in expected if k not in found and not (k in tied and any(t in found for t in tied)))
    if missing:
        raise EvoError(f"{what} {path}: weights do not match config.json: {len(missing)} of {len(expected)} tensors are missing "
                       f"(first: {missing[0]})")
    return path


def run_loss(trainer, result, resumed: bool) -> float | None:
    """The run's mean training loss. A run resumed from a checkpoint trains only the steps after it (none, when
    the checkpoint was its last), and ``result.training_loss`` covers only those (0.0 for none), so a resumed run
    reports the mean of every loss logged over the whole run (its trainer state carries the log from before the
    checkpoint), or None when no step logged one: unknown, never 0. A fresh run reports the trainer's own figure."""
    if not resumed:
        return round(float(result.training_loss), 4)
    logged = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return round(sum(logged) / len(logged), 4) if logged else None


def write_pointer(out: Path, target: Path, spec: str) -> dict:
    """Record a pretrained base: the path as the profile names it and what its files hash to."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for f in out.iterdir():  # the folder is the stage's output: only the pointer lives there
        if f.is_file():
            f.unlink()
    doc = {"path": spec, "config_sha256": _sha(target / "config.json"), "weights": weights_digest(target)}
    (out / POINTER).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return doc


def resolve_checkpoint(path: str | Path, root: Path | None = None) -> Path:
    """The folder that holds the weights: ``path`` itself, or where its pointer points on this
    machine. A pointer whose target changed (another config) is one line, never a silent swap."""
    from evoharness.agent.training.profiles import resolve_model_path

    p = Path(path)
    ptr = p / POINTER
    if not ptr.exists():
        return p
    try:
        doc = json.loads(ptr.read_text())
        target = resolve_model_path(doc["path"], root)
    except (ValueError, KeyError) as e:
        raise EvoError(f"{ptr} is not a model pointer ({e})") from None
    if not (target / "config.json").is_file():
        raise EvoError(f"{ptr} points to {doc['path']} ({target}), which holds no checkpoint on this machine")
    if _sha(target / "config.json") != doc.get("config_sha256"):
        raise EvoError(f"{ptr}: the checkpoint at {target} is not the one recorded (its config.json changed); re-run base_model")
    return target


def merge_lora(base: Path, adapter: Path, out: Path) -> None:
    """The adapter folded into its base and saved as a full checkpoint in ``out``, in this process
    (the main one, after training), whatever DeepSpeed config is active. The merge and the saved weights
    are float32 whatever the profile trains in: at the GPU recipe's learning rates a weight
    moves by about 2e-5, a sixth of bf16's step near the typical |w| of 0.02, so a bf16 merge or save
    would round most of the trained change away (``stored_dtype`` keeps it at evaluation)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from evoharness.agent.training.distributed import no_zero3_init

    with no_zero3_init():
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    merged = merged.to(torch.float32)
    for f in Path(out).glob("*.safetensors"):
        f.unlink()
    merged.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(adapter if (Path(adapter) / "tokenizer_config.json").exists() else base).save_pretrained(out)


def stored_dtype(path: str | Path) -> str:
    """The dtype a checkpoint's config says its weights are stored in (float32 when it names none)."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    return str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")


def load_dtype(path: str | Path, compute: str) -> str:
    """The dtype to load a checkpoint in for decoding: the profile's compute dtype, unless the checkpoint
    is stored wider (a trained model, merged in float32): its weights are then loaded as they are, so
    evaluation and the registry see the change training made, not its bf16 rounding."""
    return "float32" if stored_dtype(path) == "float32" else compute


def load_for_training(path: Path, dtype: str, lora: bool, r: int, alpha: int):
    """The model a trainer starts from, and its LoRA config: (model, whether ZeRO-3 partitioned it as
    it loaded, peft_config or None). Called after the training arguments exist, so that under ZeRO-3
    zero.Init applies while the weights load."""
    import torch
    from transformers import AutoModelForCausalLM

    from evoharness.agent.training.distributed import partitioned

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=r, lora_alpha=alpha, target_modules="all-linear", task_type="CAUSAL_LM")
    return model, partitioned(model), peft_config
