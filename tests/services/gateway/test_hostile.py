"""Hostile request bodies against the real gateway app, and what its errors reveal.

The app is the real one (create_gateway: parser, params, lifecycle, the real Dispatcher) behind an in-process ASGI
client. Its router address is a closed port, so a body that passes every check ends as 503 `no_workers` at
routing; everything below is about what happens before that.
"""
from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.services.gateway.app import GatewayConfig, _error_response, create_gateway
from pdserve.services.gateway.dispatch import NoWorkersError, UpstreamError
from pdserve.services.gateway.redact import scrub

MODEL = "builtin"
CLOSED = "127.0.0.1:1"  # no router listens here: a request that passes every check is 503 no_workers


class Gateway:
    """The app and an ASGI client on one private event loop (the app's gRPC channel binds to it)."""

    def __init__(self, **cfg):
        self.loop = asyncio.new_event_loop()

        async def make():
            g = create_gateway(GatewayConfig(MODEL, MODEL, CLOSED, **cfg))
            return g, httpx.AsyncClient(transport=httpx.ASGITransport(app=g.app), base_url="http://gw")

        self.gateway, self.client = self.loop.run_until_complete(make())

    def post(self, path: str, raw: bytes, headers: dict | None = None) -> httpx.Response:
        return self.loop.run_until_complete(self.client.post(
            path, content=raw, headers={"content-type": "application/json", **(headers or {})}))

    def get(self, path: str, headers: dict | None = None) -> httpx.Response:
        return self.loop.run_until_complete(self.client.get(path, headers=headers))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.close()


@pytest.fixture(scope="module")
def gw():
    g = Gateway()
    yield g
    g.close()


# ---- bodies that were each a 500 that dropped the keep-alive connection ----

REPRODUCTIONS = [
    ("/v1/completions", '{"prompt": "hi", "stream_options": 5}', "stream_options"),
    ("/v1/completions", '{"prompt": "hi", "stream": true, "stream_options": "x"}', "stream_options"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2147483648}', "max_tokens"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2147483648}',
     "max_completion_tokens"),
    ("/v1/completions", '{"prompt": "ab\\ud800cd"}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "ab\\udfffcd"]}', "prompt[1]"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "ab\\ud800cd"}]}', "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages[0].content[0].text"),
    ("/v1/completions", '{"prompt": "hi", "stop": "ab\\ud800cd"}', "stop"),
    ("/v1/completions", '{"prompt": "hi", "stop": ["x", "ab\\ud800cd"]}', "stop[1]"),
    ("/v1/completions", '{"prompt": [true, false]}', "prompt"),
    ("/v1/completions", '{"prompt": [[1, true]]}', "prompt[0]"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
     "messages[0].content[0].text"),
]


@pytest.mark.parametrize("path,raw,param", REPRODUCTIONS, ids=[r[2] + ":" + r[1][:40] for r in REPRODUCTIONS])
def test_issue_reproduction_is_a_400_naming_the_parameter(gw, path, raw, param):
    r = gw.post(path, raw.encode())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and err["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw,param", [
    ('{"prompt": "hi", "temperature": 1' + "0" * 400 + "}", "temperature"),  # int beyond float: OverflowError
    ('{"prompt": "hi", "logit_bias": {"5": 1' + "0" * 400 + "}}", "logit_bias"),
    ('{"prompt": "hi", "logit_bias": {"' + "9" * 5000 + '": 1}}', "logit_bias"),  # int() of it raises
    ('{"prompt": "hi", "n": 2147483648}', "n"),
    ('{"prompt": "hi", "n": 129}', "n"),  # OpenAI's cap; above it one body fans out into too many requests
    ('{"prompt": "hi", "seed": 9223372036854775808}', "seed"),  # int64 in the proto
    ('{"prompt": "hi", "top_k": 2147483648}', "top_k"),
    ('{"prompt": "hi", "timeout": 1' + "0" * 400 + "}", "timeout"),
    ('{"prompt": "hi", "stream": "yes"}', "stream"),
    ('{"prompt": "hi", "stream_options": {"include_usage": "yes"}}', "stream_options.include_usage"),
    ('{"prompt": "hi", "model": ["x"]}', "model"),
    ('{"messages": [{"role": 5, "content": "x"}]}', "messages[0].role"),
    ('{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}',
     "messages[0].content[0].type"),
    ('{"messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
    ('{"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"schema": {"a": [1e999]}}}}',
     "response_format.json_schema.schema"),
])
def test_other_type_and_range_errors_are_400s(gw, raw, param):
    chat = raw.startswith('{"messages"')
    r = gw.post("/v1/chat/completions" if chat else "/v1/completions", raw.encode())
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("raw", [b'{"prompt": NaN}', b'{"prompt": "hi", "top_p": Infinity}',
                                 b'{"prompt": "\xed\xa0\x80"}',  # a surrogate's UTF-8 bytes: not UTF-8
                                 b"[" * 100_000, b'{"prompt": 1' + b"0" * 5000 + b"}"])
def test_not_json_is_400(gw, raw):
    r = gw.post("/v1/completions", raw)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text


def test_a_valid_body_passes_the_checks(gw):
    """The control: the same shapes, valid, get as far as routing (no router here: 503), with no internals."""
    for path, body in (("/v1/completions", {"prompt": "ab\U0001F600cd", "max_tokens": 1000, "n": 128,
                                            "stop": ["x"], "stream_options": {"include_usage": True}}),
                       ("/v1/completions", {"prompt": [[1, 2], [3]], "seed": 2**63 - 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
                           {"type": "text", "text": "hi"}]}], "logit_bias": {"7": -100}})):
        r = gw.post(path, json.dumps(body).encode())
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_workers", r.text
        assert "127.0.0.1" not in r.text and "ipv4" not in r.text  # the router's error is logged, not sent
        assert r.headers["x-request-id"] in r.json()["error"]["message"]
        assert "connection" not in r.headers  # a deliberate 503 (load shed) keeps the connection (guard.HttpGuard)


# ---- chat bodies whose cost is not their content's size ----

def test_contentless_messages_are_refused_by_count_before_rendering(gw, monkeypatch):
    """61,000 `{"role": "user"}` (976 KB, no content) rendered on the event loop for ~0.85 s, then were a 400
    `context_length_exceeded`; now the count is refused before anything renders."""
    rendered = []
    monkeypatch.setattr(gw.gateway.tokenizer, "apply_chat_template", lambda *a, **k: rendered.append(1) or "x")
    raw = json.dumps({"messages": [{"role": "user"}] * 61_000}, separators=(",", ":")).encode()
    r = gw.post("/v1/chat/completions", raw)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "at most 2048 messages" in r.json()["error"]["message"] and not rendered


@pytest.mark.parametrize("msg", [{"role": "user"}, {"role": "user", "content": None}, {"role": "system"},
                                 {"role": "developer"}, {"role": "tool", "tool_call_id": "c1"},
                                 {"role": "assistant"}, {"role": "assistant", "content": None, "tool_calls": None}])
def test_a_message_without_content_is_400(gw, msg):
    """As the OpenAI API answers: only an assistant message with tool_calls may leave content out."""
    r = gw.post("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}, msg]}).encode())
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages[1].content" and "is required" in r.json()["error"]["message"]


def test_chat_templates_render_off_the_event_loop(gw, monkeypatch):
    """Even a one-word message: the template's cost is its own, not the content's (a 10^8 loop in a checkpoint's
    template, or 2,048 empty messages, cost seconds whatever the content's length)."""
    import threading
    tok = gw.gateway.tokenizer
    threads = []

    def spy(*a, **k):
        threads.append(threading.current_thread().name)
        return type(tok).apply_chat_template(tok, *a, **k)

    monkeypatch.setattr(tok, "apply_chat_template", spy)
    r = gw.post("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}]}')
    assert r.status_code == 503 and len(threads) == 1, r.text  # rendered, then no router
    assert threads[0].startswith("pdserve-tokenize") and threads[0] != threading.current_thread().name


# ---- property: no body makes a 5xx ----

JUNK = st.recursive(
    st.none() | st.booleans() | st.integers() | st.sampled_from([2**31, -2**31 - 1, 2**63, 10**40, -1, 0])
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8)
    | st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=12)
TEXT = st.text(max_size=20) | st.builds(lambda a, s, b: a + s + b, st.text(max_size=5),
                                        st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), st.text(max_size=5))
TOKEN = st.integers(-2, 4100) | st.booleans() | st.sampled_from([2**31, 2**70])
NUM = st.integers(-3, 40) | st.floats(-3, 3) | st.sampled_from([2**31, 2**63, 10**400, 1e300, -(2**31) - 1])


def _or_junk(s):
    return s | JUNK


PART = st.fixed_dictionaries({"type": _or_junk(st.just("text")), "text": _or_junk(TEXT)})
MESSAGE = st.fixed_dictionaries({"role": _or_junk(st.sampled_from(["user", "system", "assistant"]))},
                                optional={"content": _or_junk(TEXT | st.lists(_or_junk(PART), max_size=3)),
                                          "name": _or_junk(TEXT)})
COMMON = {
    "model": st.just(MODEL) | JUNK, "max_tokens": _or_junk(NUM), "temperature": _or_junk(NUM),
    "top_p": _or_junk(NUM), "top_k": _or_junk(NUM), "min_p": _or_junk(NUM), "n": _or_junk(NUM),
    "seed": _or_junk(NUM), "min_tokens": _or_junk(NUM), "presence_penalty": _or_junk(NUM),
    "frequency_penalty": _or_junk(NUM), "repetition_penalty": _or_junk(NUM),
    "stop": _or_junk(TEXT | st.lists(TEXT, max_size=3)), "stream": _or_junk(st.booleans()),
    "stream_options": _or_junk(st.fixed_dictionaries({}, optional={"include_usage": _or_junk(st.booleans())})),
    "logit_bias": _or_junk(st.dictionaries(st.integers(-5, 5000).map(str) | TEXT, NUM, max_size=3)),
    "ignore_eos": JUNK, "return_token_ids": JUNK, "allow_degrade": JUNK, "timeout": _or_junk(NUM),
    "response_format": _or_junk(st.fixed_dictionaries({"type": _or_junk(st.sampled_from(
        ["text", "json_object", "json_schema"]))}, optional={"json_schema": JUNK})),
    "user": JUNK, "echo": JUNK,
}
COMPLETION = st.fixed_dictionaries({}, optional={
    **COMMON, "prompt": _or_junk(TEXT | st.lists(TEXT, max_size=3) | st.lists(TOKEN, max_size=6)
                                 | st.lists(st.lists(TOKEN, max_size=4), max_size=3)),
    "logprobs": _or_junk(NUM), "best_of": _or_junk(NUM)})
CHAT = st.fixed_dictionaries({}, optional={
    **COMMON, "messages": _or_junk(st.lists(_or_junk(MESSAGE), max_size=3)), "logprobs": JUNK,
    "top_logprobs": _or_junk(NUM), "max_completion_tokens": _or_junk(NUM)})


def _encode(body, raw_surrogates: bool) -> bytes:
    # ensure_ascii writes a lone surrogate as its \\u escape; without it, as the surrogate's (invalid) UTF-8 bytes
    return json.dumps(body, ensure_ascii=not raw_surrogates).encode("utf-8", "surrogatepass")


@settings(max_examples=400, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(case=st.one_of(st.tuples(st.just("/v1/completions"), COMPLETION | JUNK),
                      st.tuples(st.just("/v1/chat/completions"), CHAT | JUNK)),
       raw_surrogates=st.booleans())
def test_no_body_gets_a_5xx(gw, case, raw_surrogates):
    path, body = case
    r = gw.post(path, _encode(body, raw_surrogates))
    err = r.json()["error"] if r.status_code != 200 else {}
    # the one 5xx allowed: a body valid in every respect, refused because no router answers in this test
    assert r.status_code < 500 or (r.status_code == 503 and err.get("code") == "no_workers"), (body, r.text)
    assert r.status_code != 200
    assert isinstance(err.get("message"), str) and err.get("type")
    if err.get("code") == "invalid_parameter":
        assert err["param"], r.text


# ---- item 9: errors do not carry internals ----

def test_upstream_errors_reach_the_client_redacted(caplog):
    async def main():
        grpc_path = ("[16:48:31] /project/cpp/json_schema_converter.cc:5088: Cannot find field 'nope' in #/nope")
        bodies = []
        for e in (UpstreamError(grpc.StatusCode.INVALID_ARGUMENT, grpc_path),
                  UpstreamError(grpc.StatusCode.INTERNAL, "worker decode-0-7101 at 10.0.3.7:7101: CUDA error"),
                  UpstreamError(grpc.StatusCode.RESOURCE_EXHAUSTED, "no KV capacity on worker decode-0-7101"),
                  NoWorkersError("failed to connect to all addresses; last error: ipv4:10.0.3.7:7000 refused"),
                  RuntimeError("/usr/lib/python3/site-packages/x.py secret")):
            r = _error_response(e)
            bodies.append((r.status_code, json.loads(r.body)["error"]))
        return bodies

    with caplog.at_level("WARNING", logger="pdserve.gateway"):
        bodies = asyncio.run(main())
    assert [s for s, _ in bodies] == [400, 500, 503, 503, 500]
    assert bodies[0][1]["message"] == "Cannot find field 'nope' in #/nope"  # the client's own schema problem
    for _, err in bodies:
        for secret in ("/project", ".cc", "10.0.3.7", "decode-0-7101", "ipv4", "/usr/lib", "CUDA"):
            assert secret not in err["message"], err
    logged = caplog.text  # ... and every detail is in the gateway's log
    for secret in ("json_schema_converter.cc", "decode-0-7101 at 10.0.3.7:7101", "ipv4:10.0.3.7:7000", "/usr/lib"):
        assert secret in logged


def test_scrub():
    assert scrub("[09:01:02] /a/b/c.cc:12: bad regex at 3") == "bad regex at 3"
    assert scrub("peer ipv4:10.1.2.3:7100 and [::1]:80 and gw-0.svc:8000 gone") == \
        "peer <address> and <address> and <address> gone"
    assert scrub("invalid sampling parameter 'top_p': must be in (0, 1]") == \
        "invalid sampling parameter 'top_p': must be in (0, 1]"  # ordinary messages pass unchanged
    assert len(scrub("x" * 1000)) == 300


KEYS = """
tenants:
  plain: {keys: [sk-plain]}
  ops: {keys: [sk-ops], permissions: [metrics]}
"""


def test_metrics_needs_the_metrics_permission(tmp_path):
    keys = tmp_path / "keys.yaml"
    keys.write_text(KEYS)
    g = Gateway(api_keys_file=str(keys))
    try:
        assert g.post("/v1/completions", b'{"prompt": "hi"}', {"Authorization": "Bearer sk-plain"}).status_code == 503
        assert g.get("/metrics").status_code == 401
        assert g.get("/metrics", {"Authorization": "Bearer sk-wrong"}).status_code == 401
        r = g.get("/metrics", {"Authorization": "Bearer sk-plain"})
        assert r.status_code == 403 and "pdserve_" not in r.text
        r = g.get("/metrics", {"Authorization": "Bearer sk-ops"})
        assert r.status_code == 200 and 'tenant="plain"' in r.text  # what a plain key must not see
    finally:
        g.close()
    open_gw = Gateway()  # no keys file: no authentication anywhere, one trust domain (docs/admission.md)
    try:
        assert open_gw.get("/metrics").status_code == 200
    finally:
        open_gw.close()


def test_keys_file_permissions_are_checked():
    from pdserve.services.gateway.tenants import DEFAULT_TENANT, parse
    t = {x.name: x for x in parse({"tenants": {"a": {"keys": ["k"]}, "b": {"keys": ["j"],
                                                                         "permissions": ["debug_route"]}}})}
    assert not t["a"].can("debug_route") and not t["a"].can("metrics")
    assert t["b"].can("debug_route") and not t["b"].can("metrics")
    assert DEFAULT_TENANT.can("debug_route") and DEFAULT_TENANT.can("metrics")
    with pytest.raises(ValueError, match="permissions"):
        parse({"tenants": {"a": {"keys": ["k"], "permissions": ["admin"]}}})
