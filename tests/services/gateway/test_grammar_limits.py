"""Guided-output limits at the gateway (engine/grammar_limits.py): over a bound is a 400 naming the field the
client wrote and the flag, before admission and before any worker compiles."""
from __future__ import annotations

import json

import pytest

from pdserve.engine.grammar_limits import GrammarLimits
from tests.services.gateway.test_hostile import Gateway


@pytest.fixture(scope="module")
def gw():
    g = Gateway(grammar_limits=GrammarLimits(max_enum_values=50))
    yield g
    g.close()


def schema(n: int) -> dict:
    return {"type": "object", "properties": {"k": {"enum": [f"v{i}" for i in range(n)]}}, "required": ["k"]}


def rf(s: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}


TOOL = {"type": "function", "function": {"name": "pick", "parameters": schema(60)}}
CASES = [
    # a 60k-value enum (650 KB) with a 10 s timeout: unbounded, it compiled ~100 s on the worker
    ("/v1/completions", {"prompt": "a", "max_tokens": 5, "timeout": 10,
                         "response_format": rf({"enum": [f"7{i}" for i in range(60000)]})},
     "response_format", "--max-schema-bytes"),
    ("/v1/completions", {"prompt": "a", "response_format": rf(schema(51))}, "response_format", "--max-enum-values"),
    ("/v1/completions", {"prompt": "a", "guided_json": schema(51)}, "guided_json", "--max-enum-values"),
    ("/v1/completions", {"prompt": "a", "guided_regex": "a" * 1001}, "guided_regex", "--max-pattern-chars"),
    ("/v1/completions", {"prompt": "a", "guided_json": {"type": "string", "pattern": "b" * 1001}}, "guided_json",
     "--max-pattern-chars"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [TOOL],
                              "tool_choice": "required"}, "tools", "--max-enum-values"),
]


@pytest.mark.parametrize("path,body,param,flag", CASES, ids=[c[2] + c[3] for c in CASES])
def test_over_a_limit_is_a_400_naming_the_field_and_the_flag(gw, path, body, param, flag):
    r = gw.post(path, json.dumps({"model": "builtin", **body}).encode())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, "invalid_parameter") and flag in err["message"], err


def test_within_the_limits_passes_to_placement(gw):
    """Under every bound the request goes on (no router listens: 503 no_workers, past every check)."""
    for body in ({"response_format": rf(schema(50))}, {"guided_regex": "a" * 1000},
                 {"tools": [{**TOOL, "function": {**TOOL["function"], "parameters": schema(10)}}],
                  "tool_choice": "auto", "messages": [{"role": "user", "content": "x"}]}):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = gw.post(path, json.dumps({"model": "builtin", "prompt": "a", **body} if "messages" not in body
                                     else {"model": "builtin", **body}).encode())
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_workers", r.text
