"""Memoised text generation for TextWorld's PDDL engine: same outputs, several times faster.

Profiling a step (``bench/env_bench.py --profile``) shows ~60% of the time in tatsu re-parsing
the same few grammar strings and ~30% deep-copying derivation contexts. The patches:

* parse each grammar string and each conjunctive query once, hand out copies of the result;
* copy a context's ``variables`` and ``mapping`` dicts shallowly (their values, EntityInfo and
  Variable objects, are never mutated by the derivation; only the dicts are updated);
* copy a symbol without dragging its old context through ``deepcopy``;
* translate each recent PDDL problem to SAS once per worker (a load and every reset translated it again).

``tests/test_engine.py`` checks that transcripts are identical with and without them.
"""

from __future__ import annotations

import copy

_APPLIED = False


def apply() -> None:
    global _APPLIED
    if _APPLIED:
        return
    from textworld.envs.pddl import textgen
    from textworld.logic import Rule

    original_parse = textgen._parse_and_convert
    parse_cache: dict = {}

    def cached_parse(text, rule_name=None, **kwargs):
        key = (text, rule_name)
        tree = parse_cache.get(key)
        if tree is None:
            tree = parse_cache[key] = original_parse(text, rule_name=rule_name)
        return copy.deepcopy(tree)

    textgen._parse_and_convert = cached_parse

    query_cache: dict = {}
    original_query = Rule.parse_conjunctive_query.__func__

    def cached_query(cls, expr):
        rule = query_cache.get(expr)
        if rule is None:
            rule = query_cache[expr] = original_query(cls, expr)
        return rule

    Rule.parse_conjunctive_query = classmethod(cached_query)

    def copy_context(context):
        return {
            "state": context["state"],
            "facts": context["facts"],
            "variables": dict(context["variables"]),
            "mapping": dict(context["mapping"]),
            "entity_infos": context["entity_infos"],
        }

    textgen.copy_context = copy_context

    def symbol_copy(self, context):
        saved = self.context
        self.context = {}
        try:
            dup = copy.deepcopy(self)
        finally:
            self.context = saved
        dup.context = copy_context(context)
        return dup

    textgen.Symbol.copy = symbol_copy

    # Loading a game builds its PDDL state and every reset builds it again; each build translates the
    # problem to SAS twice (fast_downward.pddl2sas, ~70 % of a reset). The translation depends only on
    # its arguments and its result is only read, so a worker translates each recent problem once.
    from textworld.envs.pddl import logic as pddl_logic

    downward = pddl_logic.fast_downward
    original_pddl2sas = downward.pddl2sas
    sas_cache: dict = {}

    def cached_pddl2sas(domain, problem, verbose=False, optimize=False):
        key = (domain, problem, bool(verbose), bool(optimize))
        got = sas_cache.pop(key, None)
        if got is None:
            got = original_pddl2sas(domain, problem, verbose=verbose, optimize=optimize)
        sas_cache[key] = got  # most recent last
        while len(sas_cache) > 16:  # 8 games (two translations each): a worker's share of an evaluation's games
            sas_cache.pop(next(iter(sas_cache)))
        return got

    downward.pddl2sas = cached_pddl2sas
    _APPLIED = True
