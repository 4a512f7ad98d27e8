"""The planner's decisions as Redis holds them: written by the planner (planner/loop.py), read by `pdserve status`
and the gateway's /status (services/status.py). Here, beside the registry, so that the readers need not import
the planner (which imports the simulator).

`pdserve:{model}:planner:last` (the last decision) and `pdserve:{model}:planner:changes` (the last 50 that changed
a pool): JSON, HMAC-signed with the registry key when an internal token is configured (the same key and canonical
form as worker records: registry.record_sig), so a process without the token cannot make status show a decision
the planner never took.
"""
from __future__ import annotations

import hmac
import json

from pdserve.services.registry import record_sig

HISTORY = 50


def last_key(model: str) -> str:
    return f"pdserve:{model}:planner:last"


def changes_key(model: str) -> str:
    return f"pdserve:{model}:planner:changes"


def sign(model: str, body: str, key: bytes | None) -> str:
    rec = {"decision": body}
    if key is not None:
        rec["sig"] = record_sig(key, model, {"decision": body.encode()})
    return json.dumps(rec)


def verify(model: str, raw: bytes | str | None, key: bytes | None) -> dict | None:
    """The stored decision if its signature verifies (or no key is configured); None otherwise."""
    if not raw:
        return None
    rec = json.loads(raw)
    body = rec.get("decision", "")
    if key is not None and not hmac.compare_digest(rec.get("sig", ""),
                                                   record_sig(key, model, {"decision": body.encode()})):
        return None
    return json.loads(body)


async def store(r, model: str, decision: dict, changed: bool, key: bytes | None) -> None:
    """`r`: a redis.asyncio client; `decision`: Decision.to_json(); `changed`: it changed a pool."""
    rec = sign(model, json.dumps(decision), key)
    async with r.pipeline(transaction=True) as p:
        p.set(last_key(model), rec)
        if changed:
            p.lpush(changes_key(model), rec)
            p.ltrim(changes_key(model), 0, HISTORY - 1)
        await p.execute()
