"""Constrained decoding with xgrammar 0.2.9: JSON schema, JSON-object mode, regex, EBNF (GBNF).

Mechanism (spec §3.3, Q9): each step the matcher fills a token bitmask for its current parser
state; the sampler sets the logits of illegal tokens to -inf and samples as usual; the sampled
token is fed back with `accept_token`. The request finishes with "stop" once the matcher is
terminated (it accepted a stop token — EOS — in an accepting state).

Dead ends: xgrammar's masks are computed token-by-token against the grammar's pushdown automaton,
so a token is allowed only if the text so far plus that token is still a prefix of some string in
the language; a sampled legal token can therefore always be continued to acceptance. What can
still happen:
  * max_tokens (or the context limit) cuts the output before acceptance: finish_reason "length",
    and the text is an incomplete prefix of a valid document (clients must check the reason);
  * another hard constraint removes every token the grammar allows (allowed_token_ids disjoint
    from the grammar, or min_tokens masking EOS when EOS is the only legal token): the sampler
    reports a dead end and the request finishes with "stop" (see sampler docs);
  * a schema whose language is empty is rejected by xgrammar at compile time -> ValueError.
Whitespace: JSON schema / object mode are compiled with any_whitespace=False and the separators "," and
":" (compact JSON, no whitespace between tokens), so a model cannot wander in whitespace, and a constrained
answer costs the fewest tokens.

Where it compiles: a serving worker never compiles on its engine thread (a client-sized schema would stall
every request on the worker): grammar_pool.py compiles in child processes under a deadline and hands the
engine the compiled grammar. The offline engine compiles inline, cached: one xgrammar.GrammarCompiler per
(tokenizer, vocab_size) plus a bounded dict of compiled grammars per spec.
"""
from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import TYPE_CHECKING

from pdserve.engine.grammar_limits import GrammarLimits, check_rules
from pdserve.engine.sampling_params import GuidedSpec, InvalidParameter

if TYPE_CHECKING:
    import torch
    import xgrammar as xgr

_MAX_CACHED = 256
_compilers: dict[tuple[int, int], tuple[object, xgr.GrammarCompiler]] = {}
_compiled: "OrderedDict[tuple, xgr.CompiledGrammar]" = OrderedDict()


def _bad(field: str, why: str) -> ValueError:
    return InvalidParameter(f"guided.{field}", why)


def tokenizer_info(tokenizer, vocab_size: int) -> xgr.TokenizerInfo:
    """xgrammar vocabulary from the checkpoint's tokenizer.json. vocab_size is the model's logits
    width, which may exceed the tokenizer's vocabulary (padding rows are never allowed)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer.hf)
    import xgrammar as xgr  # on first use: start-up does not pay its imports (docs/engine.md)

    return xgr.TokenizerInfo.from_huggingface(
        fast, vocab_size=vocab_size, stop_token_ids=list(tokenizer.eos_token_ids) or None
    )


def get_compiler(tokenizer, vocab_size: int) -> xgr.GrammarCompiler:
    key = (id(tokenizer), vocab_size)
    hit = _compilers.get(key)
    if hit is None or hit[0] is not tokenizer:  # keep a reference so the id stays unique
        import xgrammar as xgr  # on first use: start-up does not pay its imports (docs/engine.md)

        hit = (tokenizer, xgr.GrammarCompiler(tokenizer_info(tokenizer, vocab_size)))
        _compilers[key] = hit
    return hit[1]


# xgrammar prefixes its messages with a time and its source file: "[08:59:38] /project/cpp/x.cc:94: "
_XGR_WHERE = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def grammar_source(spec: GuidedSpec) -> tuple[str, object]:
    """(kind, text) of a constraint: what compiles, and its cache key. A schema's JSON is re-serialized compactly
    (key order kept: it is the order the model writes properties in), so spacing alone does not miss the cache.
    Raises ValueError naming the field."""
    if spec.json_schema is not None:
        try:
            schema = json.dumps(json.loads(spec.json_schema), separators=(",", ":"), ensure_ascii=False)
        except (ValueError, TypeError, RecursionError) as e:
            raise _bad("json_schema", f"not valid JSON ({str(e)[:200]})") from e
        if spec.grammar is not None:
            return "wrapped_json", (spec.grammar, schema)
        return "json_schema", schema
    if spec.json_object:
        return "json_object", '{"type": "object"}'
    if spec.regex is not None:
        return "regex", spec.regex
    if spec.grammar is not None:
        return "grammar", spec.grammar
    raise InvalidParameter("guided", "no constraint set")


def compile_source(compiler: xgr.GrammarCompiler, kind: str, text, limits: GrammarLimits | None = None):
    """Compile one grammar_source. With `limits`, the EBNF a schema converts to is held to max_grammar_rules
    before the (costly) compile. Raises ValueError naming the field."""
    field = {"json_object": "json_schema", "wrapped_json": "grammar"}.get(kind, kind)
    try:
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "wrapped_json":
            ebnf = wrapped_json_ebnf(*text)
        elif kind in ("json_schema", "json_object"):
            ebnf = _json_schema_ebnf(text)
        else:
            ebnf = text
        if limits is not None:
            check_rules(ebnf, limits, f"guided.{field}")
        return compiler.compile_grammar(ebnf)
    except InvalidParameter:
        raise
    except Exception as e:  # xgrammar raises RuntimeError / InvalidJSONError with the parse problem
        raise _bad(field, _XGR_WHERE.sub("", str(e).strip().splitlines()[0])[:300]) from e


def compile_guided(spec: GuidedSpec, tokenizer, vocab_size: int) -> xgr.CompiledGrammar:
    """Compile (or fetch from cache) the grammar for `spec`, in this thread: for the offline engine and tests. A
    serving worker compiles in its GrammarPool's processes instead (grammar_pool.py), never on the engine
    thread. Raises ValueError naming the field."""
    kind, text = grammar_source(spec)
    key = (id(tokenizer), vocab_size, kind, text)
    if key in _compiled:
        _compiled.move_to_end(key)
        return _compiled[key]
    compiled = compile_source(get_compiler(tokenizer, vocab_size), kind, text)
    _compiled[key] = compiled
    if len(_compiled) > _MAX_CACHED:
        _compiled.popitem(last=False)
    return compiled


# xgrammar 0.2.9 compiles length-bounded strings (minLength / maxLength) to the character class
# below, which admits raw control characters U+0000-U+001F; RFC 8259 forbids them unescaped, so
# e.g. Python's json.loads rejects the output. We patch the class to the one xgrammar itself uses
# for unbounded strings. (Found by tests/engine/test_grammar.py with random logits.)
_XGR_LOOSE_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def _json_schema_ebnf(schema: str) -> str:
    import xgrammar as xgr  # on first use: start-up does not pay its imports (docs/engine.md)

    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=(",", ":")))
    return ebnf.replace(_XGR_LOOSE_CHAR, _JSON_STRING_CHAR)


def wrapped_json_ebnf(grammar: str, schema: str) -> str:
    """`grammar` (which must not define rules named like the schema's: `json_root`, `basic_*`, `root_*`) plus the
    schema's rules, its `root` renamed `json_root`."""
    rules = re.sub(r"(?<![\w])root(?![\w])", "json_root", _json_schema_ebnf(schema))
    return grammar.rstrip() + "\n" + rules


class GrammarState:
    """One sequence's position in its grammar (wraps xgrammar.GrammarMatcher)."""

    def __init__(self, compiled: xgr.CompiledGrammar, _matcher: xgr.GrammarMatcher | None = None):
        self.compiled = compiled
        import xgrammar as xgr  # on first use: start-up does not pay its imports (docs/engine.md)

        self.matcher = _matcher or xgr.GrammarMatcher(compiled)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write this step's legal-token bitmask into row `row` of an xgrammar bitmask tensor."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.accept_token(int(token_id))

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fork(self) -> "GrammarState":
        return GrammarState(self.compiled, self.matcher.fork())


def make_grammar_state(spec: GuidedSpec, tokenizer, vocab_size: int,
                       compiled: xgr.CompiledGrammar | None = None) -> GrammarState:
    """`compiled`: the grammar a GrammarPool compiled for `spec` off this thread; None compiles it here."""
    return GrammarState(compiled if compiled is not None else compile_guided(spec, tokenizer, vocab_size))
