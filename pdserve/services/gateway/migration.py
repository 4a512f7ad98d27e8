"""Mid-stream migration at the gateway (docs/reliability.md, "Mid-stream migration").

A sub-request's stream that breaks after tokens went out - its decode or `both` worker died (the stream ends
UNAVAILABLE), stopped answering and left the registry (its heartbeats stopped: `watched`), or a decode worker could
not pull the prompt's KV from a prefill worker that died (a FAILED message marked `retryable`) - continues on
another worker instead of ending FAILED: the dispatcher (dispatch.py) raises `Broken` where it used to end the stream,
and places the request again with the tokens the client already has (`Sent`) as a `Resume`: the new worker
prefills prompt + those tokens and replays them through its sampling state (engine/resume.py), so the client's
stream goes on with the next token, neither repeated nor missing.

A worker switching role hands its streams on the same way (services/role_switch.py, handoff `migrate`): it ends
each one UNAVAILABLE with the `role switch: handoff` detail after a message, and the stream moves with reason
`handoff` (the worker is not suspect; the move does not count against the limit).

Kept per sub-request: the token ids sent (one branch: a request with several visible branches is not migrated
after its first token, its branches' histories differ), and how many times it moved (`--migration-limit`).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

import grpc

from pdserve.services.pb import common_pb2
from pdserve.services.role_switch import is_handoff

# A stream silent this long makes the gateway ask the router whether its worker is still registered (a stopped or
# partitioned worker keeps its TCP connection open, so no error would ever come). A worker leaves the registry one
# heartbeat TTL (3 s by default) after its last heartbeat: the request moves within TTL + this.
STALL_CHECK_S = 1.0

# Reasons (the `reason` label of pdserve_migrations_total)
UNAVAILABLE = "unavailable"  # the stream ended UNAVAILABLE: connection reset, the worker process died
WORKER_LOST = "worker_lost"  # the stream went silent and the worker left the registry
KV_TRANSFER = "kv_transfer"  # the decode worker could not pull the prompt's KV (its prefill worker died)
# the worker is changing role and handed the stream on (services/role_switch.py, handoff `migrate`): it lives, so
# it is not held suspect, and a planned move does not spend the request's --migration-limit
HANDOFF = "handoff"


class Broken(Exception):
    """A sub-request's worker failed it in a way another worker can make good (see the module doc)."""

    def __init__(self, worker_id: str, reason: str, detail: str):
        super().__init__(detail)
        self.worker_id, self.reason, self.detail = worker_id, reason, detail


def broken_by(e: grpc.aio.AioRpcError) -> bool:
    """A stream error that means the worker is gone (not a refusal of this request), or handed the stream on."""
    return e.code() == grpc.StatusCode.UNAVAILABLE


def break_reason(e: grpc.aio.AioRpcError) -> str:
    """Why a stream that `broken_by` broke moves: a role switch's handoff, or the worker's failure."""
    return HANDOFF if is_handoff(e.details()) else UNAVAILABLE


@dataclass
class Sent:
    """What one sub-request's client has been sent so far, message by message."""
    token_ids: dict[int, list[int]] = field(default_factory=dict)  # choice index (sub-local) -> ids sent
    finished: set[int] = field(default_factory=set)  # choices whose finish_reason went out

    def add(self, m: common_pb2.GenerateResponse) -> None:
        for d in m.outputs:
            self.token_ids.setdefault(d.index, []).extend(d.token_ids)
            if d.finish_reason:
                self.finished.add(d.index)

    @property
    def any(self) -> bool:
        return any(self.token_ids.values())

    def resumable(self, num_branches: int) -> bool:
        """Nothing sent (the request starts over), or one branch still running."""
        return not self.any or (num_branches == 1 and 0 not in self.finished)


async def watched(call, worker_id: str, listed) -> AsyncIterator[common_pb2.GenerateResponse]:
    """The stream's messages. A watchdog task (one per stream, not per message: the relay's per-token cost stays
    that of a plain read) asks `listed(worker_id)` whenever the stream has been silent for STALL_CHECK_S; a worker
    no longer registered has its call cancelled here and raises `Broken(WORKER_LOST)`."""
    last = time.monotonic()
    lost: list[Broken] = []

    async def watch() -> None:
        while True:
            await asyncio.sleep(STALL_CHECK_S)
            if time.monotonic() - last >= STALL_CHECK_S and not await listed(worker_id):
                lost.append(Broken(worker_id, WORKER_LOST, f"worker {worker_id} stopped answering and left the "
                                                           f"registry"))
                call.cancel()
                return

    dog = asyncio.get_running_loop().create_task(watch())
    try:
        async for m in call:
            last = time.monotonic()
            yield m
    except (asyncio.CancelledError, grpc.aio.AioRpcError):
        # our own cancel of the call (not the task's: a client that left is still a cancellation)
        if lost and not asyncio.current_task().cancelling():
            raise lost[0] from None
        raise
    finally:
        dog.cancel()
