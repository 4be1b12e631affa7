"""Policies: who writes the response on each turn. ``make_policy`` builds one from a spec
(``policies.spec``). The package itself imports nothing heavy, pydantic included: the decoder
(``policies.batched``, ``policies.constrain``) also runs where only torch and transformers are, as in
``bench/h200_check.py`` on the GPU box."""

from __future__ import annotations

_SPEC = ("KINDS", "PolicySpec", "parse_policy", "make_policy")


def __getattr__(name: str):
    if name in _SPEC:
        from evoharness.agent.policies import spec

        return getattr(spec, name)
    raise AttributeError(f"module 'evoharness.agent.policies' has no attribute {name!r}")
