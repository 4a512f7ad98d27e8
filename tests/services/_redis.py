"""What the tests against a real Redis share: its URL, whether it is up (they skip without it), a test model's
keys wiped, and `run` for their coroutines."""
from __future__ import annotations

import asyncio

REDIS = "redis://127.0.0.1:6379/0"


def redis_up() -> bool:
    import socket
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", 6379)) == 0


def run(coro):
    return asyncio.run(coro)


async def cleanup(r, model):
    keys = [k async for k in r.scan_iter(f"pdserve:{model}:*")]
    if keys:
        await r.delete(*keys)
    await r.aclose()
