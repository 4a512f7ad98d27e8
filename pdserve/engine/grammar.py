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
Whitespace: JSON schema / object mode are compiled with any_whitespace=False (compact JSON with
", " and ": " separators), so a model cannot wander in unbounded whitespace.

Compilation is cached: one xgrammar.GrammarCompiler per (tokenizer, vocab_size) — it has its own
compile cache — plus a bounded dict of compiled grammars per spec.
"""
from __future__ import annotations

import json
from collections import OrderedDict

import torch
import xgrammar as xgr

from pdserve.engine.sampling_params import GuidedSpec, InvalidParameter

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
    return xgr.TokenizerInfo.from_huggingface(
        fast, vocab_size=vocab_size, stop_token_ids=list(tokenizer.eos_token_ids) or None
    )


def get_compiler(tokenizer, vocab_size: int) -> xgr.GrammarCompiler:
    key = (id(tokenizer), vocab_size)
    hit = _compilers.get(key)
    if hit is None or hit[0] is not tokenizer:  # keep a reference so the id stays unique
        hit = (tokenizer, xgr.GrammarCompiler(tokenizer_info(tokenizer, vocab_size)))
        _compilers[key] = hit
    return hit[1]


def compile_guided(spec: GuidedSpec, tokenizer, vocab_size: int) -> xgr.CompiledGrammar:
    """Compile (or fetch from cache) the grammar for `spec`. Raises ValueError naming the field."""
    if spec.json_schema is not None:
        kind, text = "json_schema", spec.json_schema
        try:
            json.loads(text)
        except (json.JSONDecodeError, TypeError) as e:
            raise _bad("json_schema", f"not valid JSON ({e})") from e
    elif spec.json_object:
        kind, text = "json_object", '{"type": "object"}'
    elif spec.regex is not None:
        kind, text = "regex", spec.regex
    elif spec.grammar is not None:
        kind, text = "grammar", spec.grammar
    else:
        raise InvalidParameter("guided", "no constraint set")
    key = (id(tokenizer), vocab_size, kind, text)
    if key in _compiled:
        _compiled.move_to_end(key)
        return _compiled[key]
    compiler = get_compiler(tokenizer, vocab_size)
    try:
        if kind in ("json_schema", "json_object"):
            compiled = compiler.compile_grammar(_json_schema_ebnf(text))
        elif kind == "regex":
            compiled = compiler.compile_regex(text)
        else:
            compiled = compiler.compile_grammar(text)
    except Exception as e:  # xgrammar raises RuntimeError / InvalidJSONError with the parse problem
        raise _bad("json_schema" if kind == "json_object" else kind, str(e).strip().splitlines()[0][:300]) from e
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
    ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    return ebnf.replace(_XGR_LOOSE_CHAR, _JSON_STRING_CHAR)


class GrammarState:
    """One sequence's position in its grammar (wraps xgrammar.GrammarMatcher)."""

    def __init__(self, compiled: xgr.CompiledGrammar, _matcher: xgr.GrammarMatcher | None = None):
        self.compiled = compiled
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


def make_grammar_state(spec: GuidedSpec, tokenizer, vocab_size: int) -> GrammarState:
    return GrammarState(compile_guided(spec, tokenizer, vocab_size))
