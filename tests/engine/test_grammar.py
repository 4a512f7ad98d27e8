"""Constrained decoding: random logits sampled under the grammar mask always yield valid output."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pdserve.engine.grammar import compile_guided, make_grammar_state
from pdserve.engine.sampler import Sampler, SamplingState
from pdserve.engine.sampling_params import GuidedSpec, SamplingParams
from pdserve.engine.stop import OutputProcessor

torch.set_num_threads(1)
V = 448  # logits wider than the 420-token tokenizer, as with padded model vocabularies

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "kind": {"enum": ["x", "y", "z"]},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{1,8}@[a-z]{1,5}\.(com|org)"
EBNF = 'root ::= term ("+" term)*\nterm ::= [0-9]+ | "(" root ")"'


def generate(tok, spec, seed, max_tokens=3000, params=None):
    """Sample with random logits under the mask until the output processor finishes."""
    params = params or SamplingParams(seed=seed, max_tokens=max_tokens)
    st = SamplingState(params, [], V, tok.eos_token_ids, grammar=make_grammar_state(spec, tok, V))
    op = OutputProcessor(params, tok, tok.eos_token_ids)
    gen = torch.Generator().manual_seed(seed)
    sampler, text, reason = Sampler(V), "", None
    while reason is None:
        r = sampler.sample(torch.randn(1, V, generator=gen) * 2.0, [st])[0]
        delta, reason = op.step(r.token_id, st)
        text += delta
    return text, reason, st


@pytest.mark.parametrize("seed", range(30))
def test_json_schema_output_validates(bpe_tokenizer, seed):
    text, reason, st = generate(bpe_tokenizer, GuidedSpec(json_schema=json.dumps(SCHEMA)), seed)
    assert reason == "stop" and st.grammar_terminated and not st.dead_end
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("seed", range(15))
def test_json_object_mode_parses_to_object(bpe_tokenizer, seed):
    text, reason, st = generate(bpe_tokenizer, GuidedSpec(json_object=True), seed)
    assert reason == "stop" and st.grammar_terminated
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("seed", range(30))
def test_regex_and_ebnf_outputs_match(bpe_tokenizer, seed):
    text, reason, _ = generate(bpe_tokenizer, GuidedSpec(regex=REGEX), seed)
    assert reason == "stop" and re.fullmatch(REGEX, text), text
    text, reason, _ = generate(bpe_tokenizer, GuidedSpec(grammar=EBNF), seed)
    assert reason == "stop"
    # independent check of the EBNF language: balanced parentheses around digit sums
    assert re.fullmatch(r"[0-9+()]+", text) and text.count("(") == text.count(")")
    flat = text
    while "(" in flat:
        flat = re.sub(r"\(([0-9]+(\+[0-9]+)*)\)", "0", flat)
    assert re.fullmatch(r"[0-9]+(\+[0-9]+)*", flat), text


def test_max_tokens_cuts_with_length(bpe_tokenizer):
    params = SamplingParams(seed=1, max_tokens=3)
    text, reason, st = generate(bpe_tokenizer, GuidedSpec(json_schema=json.dumps(SCHEMA)), 1, params=params)
    assert reason == "length" and not st.grammar_terminated and text.startswith("{")


def test_dead_end_when_other_constraints_exclude_grammar(bpe_tokenizer):
    x = bpe_tokenizer.encode("x", add_special_tokens=False)[0]
    params = SamplingParams(seed=0, allowed_token_ids=[x])
    text, reason, st = generate(bpe_tokenizer, GuidedSpec(regex="[0-9]+"), 0, params=params)
    assert reason == "stop" and st.dead_end and text == ""


def test_compile_cache_and_fork(bpe_tokenizer):
    spec = GuidedSpec(regex=REGEX)
    assert compile_guided(spec, bpe_tokenizer, V) is compile_guided(GuidedSpec(regex=REGEX), bpe_tokenizer, V)
    st = SamplingState(SamplingParams(seed=3), [], V, bpe_tokenizer.eos_token_ids,
                       grammar=make_grammar_state(spec, bpe_tokenizer, V))
    for t in bpe_tokenizer.encode("ab", add_special_tokens=False):
        st.append(t)
    f = st.fork(1)
    for t in bpe_tokenizer.encode("@c.com", add_special_tokens=False):
        f.append(t)
    assert not f.dead_end and not st.dead_end
    assert st.grammar.accept_token(bpe_tokenizer.encode("@", add_special_tokens=False)[0])  # original unaffected


@pytest.mark.parametrize(
    "spec,field",
    [
        (GuidedSpec(json_schema="{not json"), "guided.json_schema"),
        (GuidedSpec(json_schema='{"type": "no-such-type"}'), "guided.json_schema"),
        (GuidedSpec(regex="[a-"), "guided.regex"),
        (GuidedSpec(grammar="root ::= undefined_rule"), "guided.grammar"),
    ],
)
def test_invalid_specs_name_field(bpe_tokenizer, spec, field):
    with pytest.raises(ValueError, match=re.escape(f"'{field}'")):
        compile_guided(spec, bpe_tokenizer, V)
