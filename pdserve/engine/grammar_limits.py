"""Bounds on the constraints a client may send (JSON schemas, regexes, EBNF grammars), checked before anything
compiles them.

Why: xgrammar's compile time grows superlinearly in some shapes a client controls (docs/reliability.md, "Hostile
neighbours"): on a 2-vCPU AMD EPYC a 20k-value enum took 7.6 s and a 60k one ~100 s, arrays nested 320-450 deep
15-43 s. Inside the bounds below every shape we measured compiles in well under a second (1,000 enum values
0.02 s, 64 levels of JSON nesting 0.04 s), and the compile deadline (grammar_pool.py) catches the rest.

The defaults follow what OpenAI documents for structured outputs (at most 1,000 enum values across a schema, a
bounded nesting depth) with room for real tool schemas. Each bound is a flag of the gateway and the workers
(`--max-schema-bytes` ...; docs/api.md, "Limits"); the gateway refuses at once with a 400 naming the limit and the
field, the worker checks again (its RPCs are not only the gateway's).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from pdserve.engine.sampling_params import GuidedSpec, InvalidParameter


@dataclass(frozen=True)
class GrammarLimits:
    max_schema_bytes: int = 128 << 10  # a JSON schema's compact JSON text
    max_schema_depth: int = 64  # JSON nesting of the schema document (objects and arrays)
    max_enum_values: int = 1000  # `enum` entries + `const`s across one schema
    max_pattern_chars: int = 1000  # a guided_regex, and each `pattern` inside a schema
    max_grammar_bytes: int = 64 << 10  # a guided_grammar's EBNF text
    max_grammar_rules: int = 2000  # EBNF rules: a guided_grammar's, or what a schema converts to
    grammar_compile_timeout: float = 10.0  # seconds: a compile's deadline is min(the request's, now + this)


LIMIT_FLAGS = {  # flag -> (attribute, help); cli.py declares them, up.py forwards them, the chart sets them
    "--max-schema-bytes": ("max_schema_bytes", "largest JSON schema (bytes of its JSON text) for guided output"),
    "--max-schema-depth": ("max_schema_depth", "deepest JSON nesting of a schema"),
    "--max-enum-values": ("max_enum_values", "enum values + consts in one schema"),
    "--max-pattern-chars": ("max_pattern_chars", "longest regex: guided_regex, or a schema's `pattern`"),
    "--max-grammar-bytes": ("max_grammar_bytes", "largest guided_grammar (bytes of EBNF)"),
    "--max-grammar-rules": ("max_grammar_rules", "most EBNF rules in a grammar (or a schema's conversion)"),
    "--grammar-compile-timeout": ("grammar_compile_timeout", "seconds a grammar may compile (also bounded by the "
                                                       "request's deadline)"),
}


def limits_from_args(args) -> GrammarLimits:
    kw = {attr: getattr(args, attr) for attr, _ in LIMIT_FLAGS.values() if getattr(args, attr, None) is not None}
    return GrammarLimits(**kw)


class LimitExceeded(InvalidParameter):
    """A constraint over one of the bounds; `param` is the engine's name for the field (the gateway renames it to
    what the client wrote)."""


def _over(param: str, what: str, value: int, limit: int, flag: str) -> LimitExceeded:
    return LimitExceeded(param, f"{what} is {value:,}, over this server's limit of {limit:,} ({flag})")


def _walk(schema, lim: GrammarLimits, param: str) -> None:
    """Depth, enum values and patterns, iteratively (a deep document must not overflow the stack)."""
    enums = 0
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > lim.max_schema_depth:
            raise _over(param, "the schema's nesting depth", depth, lim.max_schema_depth, "--max-schema-depth")
        if isinstance(node, dict):
            if isinstance(node.get("enum"), list):
                enums += len(node["enum"])
            if "const" in node:
                enums += 1
            pat = node.get("pattern")
            if isinstance(pat, str) and len(pat) > lim.max_pattern_chars:
                raise _over(param, "a `pattern` in the schema has a length that", len(pat), lim.max_pattern_chars,
                            "--max-pattern-chars")
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
        else:
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))
        if enums > lim.max_enum_values:
            raise _over(param, "the number of enum/const values", enums, lim.max_enum_values, "--max-enum-values")


def check_schema(text: str, lim: GrammarLimits, param: str = "guided.json_schema") -> None:
    size = len(text.encode("utf-8"))
    if size > lim.max_schema_bytes:
        raise _over(param, "the schema's size in bytes", size, lim.max_schema_bytes, "--max-schema-bytes")
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise InvalidParameter(param, f"not valid JSON ({str(e)[:200]})") from None
    if isinstance(schema, (dict, list)):
        _walk(schema, lim, param)


# a rule is `name ::=`; counted anywhere (an over-count inside a string literal only errs towards refusing)
_RULE = re.compile(r"[A-Za-z_][\w.-]*\s*::=")


def count_rules(ebnf: str) -> int:
    return len(_RULE.findall(ebnf))


def check_rules(ebnf: str, lim: GrammarLimits, param: str) -> None:
    n = count_rules(ebnf)
    if n > lim.max_grammar_rules:
        raise _over(param, "the number of grammar rules", n, lim.max_grammar_rules, "--max-grammar-rules")


def check(spec: GuidedSpec | None, lim: GrammarLimits) -> None:
    """Raise LimitExceeded (an InvalidParameter) naming the first bound `spec` is over; cheap (no compile)."""
    if spec is None:
        return
    if spec.json_schema is not None:
        check_schema(spec.json_schema, lim)
    if spec.regex is not None and len(spec.regex) > lim.max_pattern_chars:
        raise _over("guided.regex", "the regex's length", len(spec.regex), lim.max_pattern_chars,
                    "--max-pattern-chars")
    if spec.grammar is not None:
        size = len(spec.grammar.encode("utf-8"))
        if size > lim.max_grammar_bytes:
            raise _over("guided.grammar", "the grammar's size in bytes", size, lim.max_grammar_bytes,
                        "--max-grammar-bytes")
        check_rules(spec.grammar, lim, "guided.grammar")
