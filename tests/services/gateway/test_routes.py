"""OpenAI clients parse `error` objects: `/v1/models/{id}` for the served model (404 `model_not_found` for any
other), and unknown routes or methods answer with an OpenAI error body, not the framework's `{"detail": ...}`."""
from __future__ import annotations

import asyncio


def _client(tiny_llama):
    import httpx

    from pdserve.services.gateway.app import GatewayConfig, create_gateway
    app = create_gateway(GatewayConfig(str(tiny_llama), "org/ck-1", "127.0.0.1:1")).app
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")


def test_model_by_id(tiny_llama):
    async def main():
        async with _client(tiny_llama) as c:
            r = await c.get("/v1/models/org/ck-1")  # served names may hold a slash, as hub ids do
            assert r.status_code == 200 and r.json()["id"] == "org/ck-1" and r.json()["object"] == "model"
            assert r.json() == (await c.get("/v1/models")).json()["data"][0]
            r = await c.get("/v1/models/other")
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            assert r.json()["error"]["param"] == "model"

    asyncio.run(main())


def test_unknown_route_and_method_are_openai_errors(tiny_llama):
    async def main():
        async with _client(tiny_llama) as c:
            r = await c.post("/v1/embeddings", json={"input": "x"})
            assert r.status_code == 404 and "detail" not in r.json()
            e = r.json()["error"]
            assert e["code"] == "unknown_url" and "/v1/embeddings" in e["message"]
            assert e["type"] == "invalid_request_error"
            r = await c.get("/v1/completions")
            assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"

    asyncio.run(main())
