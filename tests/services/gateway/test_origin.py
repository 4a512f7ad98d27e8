"""Browser-origin requests (origin.py): a POST body must be JSON (415), a loopback gateway answers
only loopback Host names (421: DNS rebinding) unless --allowed-hosts, and CORS is off unless --allowed-origins.

The real app (create_gateway) behind an in-process ASGI client; its router is a closed port, so a request that passes
these checks ends as 503 `no_workers`."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from pdserve.cli import build_parser
from pdserve.services.gateway.app import GatewayConfig, create_gateway
from pdserve.services.gateway.origin import host_name
from pdserve.services.up import LIFECYCLE_FLAGS, _flags

BODY = b'{"model": "builtin", "prompt": "hi", "max_tokens": 1}'
JSON = {"content-type": "application/json"}
PAGE = "https://app.example"


def _call(method: str, path: str, headers: dict, content: bytes | None = None, **cfg) -> httpx.Response:
    async def run():
        app = create_gateway(GatewayConfig("builtin", "builtin", "127.0.0.1:1", **cfg)).app
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
            return await c.request(method, path, content=content, headers=headers)
    return asyncio.run(run())


@pytest.mark.parametrize("kind", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                  "application/jsonx", "text/json"])
def test_a_post_body_that_is_not_json_is_415(kind):
    r = _call("POST", "/v1/completions", {"content-type": kind} if kind else {}, BODY)
    assert r.status_code == 415
    err = r.json()["error"]
    assert err["code"] == "unsupported_media_type" and err["type"] == "invalid_request_error"
    assert "application/json" in err["message"] and r.headers["x-request-id"]


@pytest.mark.parametrize("kind", ["application/json", "application/json; charset=utf-8",
                                  "Application/JSON;charset=UTF-8"])
def test_a_json_body_passes(kind):
    r = _call("POST", "/v1/chat/completions", {"content-type": kind},
              b'{"model": "builtin", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}')
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_workers"


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "localhost.evil.example", "127.0.0.1.nip.io",
                                  "", "10.0.0.1:8000"])
def test_a_loopback_gateway_refuses_other_host_names(host):
    """DNS rebinding: the page's own name, re-pointed at 127.0.0.1, arrives in Host."""
    for method, path, content in (("GET", "/v1/models", None), ("POST", "/v1/completions", BODY)):
        r = _call(method, path, {"host": host, **JSON}, content, host="127.0.0.1")
        assert r.status_code == 421, (method, host)
        assert r.json()["error"]["code"] == "invalid_host" and r.headers["x-request-id"]


@pytest.mark.parametrize("host", ["localhost", "localhost:8000", "127.0.0.1:1234", "[::1]:8000", "[::1]",
                                  "LOCALHOST:8000"])
def test_a_loopback_gateway_answers_loopback_names(host):
    assert _call("GET", "/v1/models", {"host": host}, host="127.0.0.1").status_code == 200
    assert _call("GET", "/v1/models", {"host": host}, host="::1").status_code == 200


def test_allowed_hosts_add_names_and_apply_off_loopback_too():
    extra = {"allowed_hosts": ("gw.example",)}
    assert _call("GET", "/v1/models", {"host": "gw.example:8000"}, host="127.0.0.1", **extra).status_code == 200
    assert _call("GET", "/v1/models", {"host": "evil.example"}, host="127.0.0.1", **extra).status_code == 421
    # on another address the names are unknowable (a Service, an ingress) unless listed
    assert _call("GET", "/v1/models", {"host": "anything"}, host="0.0.0.0").status_code == 200
    assert _call("GET", "/v1/models", {"host": "anything"}, host="0.0.0.0", **extra).status_code == 421
    assert _call("GET", "/v1/models", {"host": "anything"}, host="127.0.0.1",
                 allowed_hosts=("*",)).status_code == 200


def test_host_name_strips_the_port():
    assert [host_name(h) for h in ("a.b:80", "[::1]:8000", "::1", "A.B", "[fe80::1]")] == \
        ["a.b", "::1", "::1", "a.b", "fe80::1"]


def _preflight(**cfg) -> httpx.Response:
    return _call("OPTIONS", "/v1/completions", {"origin": PAGE, "access-control-request-method": "POST",
                                                "access-control-request-headers": "content-type,authorization"},
                 host="127.0.0.1", **cfg)


def test_cors_is_off_by_default():
    r = _preflight()
    assert r.status_code >= 400 and "access-control-allow-origin" not in r.headers
    r = _call("GET", "/v1/models", {"origin": PAGE}, host="127.0.0.1")
    assert "access-control-allow-origin" not in r.headers


def test_allowed_origins_turn_cors_on_for_exactly_those():
    r = _preflight(allowed_origins=(PAGE,))
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE
    assert "POST" in r.headers["access-control-allow-methods"]
    r = _call("GET", "/v1/models", {"origin": PAGE}, host="127.0.0.1", allowed_origins=(PAGE,))
    assert r.headers["access-control-allow-origin"] == PAGE
    r = _call("GET", "/v1/models", {"origin": "https://other.example"}, host="127.0.0.1", allowed_origins=(PAGE,))
    assert "access-control-allow-origin" not in r.headers


def test_the_flags_parse_and_up_forwards_them(monkeypatch):
    args = build_parser().parse_args(["gateway", "--allowed-hosts", "a.example, b.example",
                                      "--allowed-origins", PAGE])
    assert args.allowed_hosts == ("a.example", "b.example") and args.allowed_origins == (PAGE,)
    assert build_parser().parse_args(["gateway"]).allowed_hosts == ()
    monkeypatch.setenv("PDSERVE_ALLOWED_HOSTS", "c.example")
    up = build_parser().parse_args(["up", "--allowed-origins", PAGE])
    forwarded = _flags(up, LIFECYCLE_FLAGS)
    assert forwarded[forwarded.index("--allowed-hosts") + 1] == "c.example"
    assert forwarded[forwarded.index("--allowed-origins") + 1] == PAGE
