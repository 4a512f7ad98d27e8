"""docs/sampling.md's dead-end claim under xgrammar: any token the mask allows can be continued to acceptance.
Checked by uniform random walks over the allowed tokens (not the model's preferences, which would steer away
from odd corners): at every step the mask must allow something (no dead end), and since these grammars only
accept documents of bounded length, a walk that never dead-ends must reach acceptance within that bound."""
from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr

from pdserve.engine.grammar import make_grammar_state
from pdserve.engine.sampling_params import GuidedSpec
from tests.engine.test_grammar import REGEX, SCHEMA, V

BOUND = 400  # tokens: more than any document these grammars accept (single-byte tokens included)


def _byte_of() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character a byte-level BPE token spells each byte with."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
          *range(ord("\u00ae"), ord("\u00ff") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


BYTE_OF = _byte_of()


def _raw(tok, ids: list[int]) -> bytes:
    return bytes(BYTE_OF[ch] for t in ids for ch in tok.id_to_token(t))


def _text(raw: bytes) -> str:
    """The output's text. xgrammar 0.2.9's JSON strings admit UTF-8-encoded surrogates (ED A0..BF xx: invalid
    UTF-8, RFC 3629), so the one invalidity allowed is that; any other would fail the strict decode here."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("utf-8", "surrogatepass")


def _allowed(state, bitmask: torch.Tensor) -> list[int]:
    state.fill_bitmask(bitmask, 0)
    bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return torch.nonzero(bits.flatten()[:V]).flatten().tolist()


def _walk(tok, spec: GuidedSpec, seed: int) -> tuple[list[int], bool]:
    """(tokens taken, terminated): each step a token drawn uniformly from what the mask allows."""
    rng = random.Random(seed)
    state = make_grammar_state(spec, tok, V)
    bitmask = xgr.allocate_token_bitmask(1, V)
    taken: list[int] = []
    for _ in range(BOUND):
        allowed = _allowed(state, bitmask)
        assert allowed, f"dead end after {tok.decode(taken)!r}"
        t = rng.choice(allowed)
        assert state.accept_token(t)
        if state.is_terminated():
            return taken, True
        taken.append(t)
    return taken, False


@pytest.mark.parametrize("kind", ["schema", "regex"])
def test_random_walks_over_allowed_tokens_reach_acceptance(bpe_tokenizer, kind):
    spec = GuidedSpec(json_schema=json.dumps(SCHEMA)) if kind == "schema" else GuidedSpec(regex=REGEX)
    lengths, surrogates = [], 0
    for seed in range(40):
        taken, terminated = _walk(bpe_tokenizer, spec, seed)
        assert terminated, f"walk {seed} still open after {BOUND} tokens: {bpe_tokenizer.decode(taken)!r}"
        raw = _raw(bpe_tokenizer, taken)
        if not raw.decode("utf-8", "replace").encode() == raw:
            surrogates += 1
        text = _text(raw)
        if kind == "schema":  # what it accepted is a document of the schema, checked by jsonschema
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert re.fullmatch(REGEX, text), text
        lengths.append(len(taken))
    assert max(lengths) > min(lengths)  # the walks really went different ways
    print(f"{kind}: 40 walks of {min(lengths)}..{max(lengths)} tokens accepted, {surrogates} with a surrogate")
