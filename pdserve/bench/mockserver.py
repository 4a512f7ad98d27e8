"""A tiny OpenAI-compatible streaming server with scripted timing, for testing the load generator itself.

`python -m pdserve.bench.mockserver --port P [--ttft S] [--itl S] [--stall-at K --stall-s S]`

Every request streams `max_tokens` chunks: the first after --ttft, the rest --itl apart. The server behaves
like one engine: a stall (--stall-at K: when the K-th request arrives, 0-based) freezes token emission for
every request for --stall-s seconds, as a blocked scheduler would. Loopback only.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route


def create_app(ttft: float = 0.01, itl: float = 0.005, stall_at: int = -1, stall_s: float = 0.0,
               model: str = "mock") -> Starlette:
    state = {"n": 0, "frozen_until": 0.0}

    async def wait_unfrozen():
        while True:
            d = state["frozen_until"] - time.monotonic()
            if d <= 0:
                return
            await asyncio.sleep(d)

    async def reset(request: Request):  # restart the request count (and so the scripted stall)
        state["n"], state["frozen_until"] = 0, 0.0
        return JSONResponse({"ok": True})

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": model, "object": "model"}]})

    async def completions(request: Request):
        body = await request.json()
        k = state["n"]
        state["n"] += 1
        if k == stall_at:
            state["frozen_until"] = time.monotonic() + stall_s
        chat = request.url.path.endswith("/chat/completions")
        n_out = int(body.get("max_tokens") or 16)
        p = body.get("prompt", body.get("messages", ""))
        n_in = len(p) if isinstance(p, list) else len(str(p).split())

        async def gen():
            await asyncio.sleep(ttft)
            for j in range(n_out):
                if j:
                    await asyncio.sleep(itl)
                await wait_unfrozen()
                c = {"index": 0, "finish_reason": "length" if j == n_out - 1 else None}
                if chat:
                    c["delta"] = {"content": f"t{j} "}
                else:
                    c["text"] = f"t{j} "
                yield f"data: {json.dumps({'id': f'mock-{k}', 'choices': [c]})}\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                u = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
                yield f"data: {json.dumps({'id': f'mock-{k}', 'choices': [], 'usage': u})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"]),
                             Route("/v1/chat/completions", completions, methods=["POST"]),
                             Route("/reset", reset, methods=["POST"])])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pdserve.bench.mockserver")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ttft", type=float, default=0.01)
    ap.add_argument("--itl", type=float, default=0.005)
    ap.add_argument("--stall-at", type=int, default=-1)
    ap.add_argument("--stall-s", type=float, default=0.0)
    a = ap.parse_args(argv)
    import uvicorn
    uvicorn.run(create_app(a.ttft, a.itl, a.stall_at, a.stall_s), host="127.0.0.1", port=a.port,
                log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
