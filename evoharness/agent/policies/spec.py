"""A policy by spec: ``parse_policy`` reads one from text, ``make_policy`` builds it."""

from __future__ import annotations

import hashlib
import re
from pathlib import PurePosixPath
from typing import Literal

from pydantic import BaseModel, ConfigDict

from evoharness.core.errors import EvoError

KINDS = ("teacher", "random", "chat", "hf")


class PolicySpec(BaseModel):
    """A policy by kind plus its settings. ``noise`` (teacher): chance per env step of a random
    admissible command instead of the expert's. ``base_url``/``model``/``api_key_env`` (chat):
    any OpenAI-compatible endpoint, the key read from that environment variable. ``path``
    (hf): a local Hugging Face checkpoint. ``sample``: sample instead of greedy decoding (``temperature``, ``top_p``).
    ``constrained`` (hf): decode under ``policies.constrain`` (the format and a legal action).
    ``backend`` / ``device`` / ``dtype`` (hf): decode with the model's own weights or vLLM, where."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["teacher", "random", "chat", "hf"]
    noise: float = 0.0
    base_url: str = ""
    model: str = ""
    api_key_env: str = "OPENAI_API_KEY"
    path: str = ""
    sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 96
    constrained: bool = True
    backend: Literal["hf", "vllm"] = "hf"
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["float32", "bfloat16"] = "float32"


def parse_policy(text: str) -> PolicySpec:
    """``teacher``, ``teacher:noise=0.2``, ``random``, ``hf:path=models/sft``, ``chat:base_url=...,model=...``."""
    kind, _, rest = text.partition(":")
    if kind not in KINDS:
        raise EvoError(f"unknown policy {kind!r} (known: {', '.join(KINDS)})")
    fields: dict = {"kind": kind}
    for item in filter(None, rest.split(",")):
        k, eq, v = item.partition("=")
        if not eq:
            raise EvoError(f"policy {text!r}: option {item!r} is not key=value")
        fields[k.strip()] = v.strip()
    try:
        return PolicySpec(**fields)
    except Exception as e:  # pydantic's message, folded to one line
        raise EvoError(f"policy {text!r}: {str(e).splitlines()[0]}; {' '.join(str(e).splitlines()[1:3])}") from None


_PLAIN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def policy_label(text: str) -> str:
    """The name a policy's results go under (a folder, a summary key, an MLflow metric): the spec itself when it
    is a plain name (``teacher``, ``random``), else its kind, its model or checkpoint name and a hash of the
    whole spec. A spec's options (an endpoint URL with its credentials) never become a name."""
    if _PLAIN.match(text):
        return text
    spec = parse_policy(text)
    name = spec.model if spec.kind == "chat" else PurePosixPath(spec.path).name if spec.kind == "hf" else ""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-.")[:40]
    return "-".join(filter(None, (spec.kind, name, hashlib.sha256(text.encode()).hexdigest()[:8])))


def make_policy(spec: PolicySpec):
    if spec.kind == "teacher":
        from evoharness.agent.policies.teacher import TeacherPolicy

        return TeacherPolicy(noise=spec.noise)
    if spec.kind == "random":
        from evoharness.agent.policies.random_policy import RandomPolicy

        return RandomPolicy()
    if spec.kind == "chat":
        from evoharness.agent.policies.chat import ChatPolicy

        return ChatPolicy(spec.base_url, spec.model, spec.api_key_env, temperature=spec.temperature if spec.sample else 0.0, max_tokens=spec.max_new_tokens)
    from evoharness.agent.policies.hf import HFPolicy

    return HFPolicy(spec.path, sample=spec.sample, temperature=spec.temperature, max_new_tokens=spec.max_new_tokens, constrained=spec.constrained,
                    backend=spec.backend, device=spec.device, dtype=spec.dtype, top_p=spec.top_p)
