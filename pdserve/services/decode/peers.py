"""Decode side of the KV handshake: where each prefill peer's KV lives, learnt once per peer incarnation.

A PrefillResponse names its prefill worker by address and incarnation (a fresh id per process) instead of
re-shipping the NIXL region (agent metadata, KB to MB). The first hand-off from a peer, and the first after the
peer restarted (a new incarnation at that address), calls KvHandshake there: both sides check the protocol
version, the decode side gets the region and drops the NIXL connection to the previous incarnation (a restarted
peer keeps its agent name, so the old descriptors would otherwise be reused) - at this address, or at another one
when the peer came back under a new address with the same agent name. Concurrent hand-offs from a new peer share
one handshake.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from pdserve.kv_transfer.agent import KVTransferError, TransferFailure
from pdserve.kv_transfer.layout import KVLayout, KVRegion, check_compatible
from pdserve.kv_transfer.tp_plan import check_ranks
from pdserve.services.convert import layout_to_pb, region_from_pb
from pdserve.services.metrics import worker as M
from pdserve.services.pb import worker_pb2, worker_pb2_grpc

log = logging.getLogger("pdserve.decode.peers")


class KvPeers:
    def __init__(self, stub_for: Callable[[str], worker_pb2_grpc.WorkerStub], layout: KVLayout,
                 protocol_version: int, forget_remote: Callable[[str], None], timeout_s: float = 5.0):
        self._stub_for = stub_for
        self._layout = layout
        self._version = protocol_version
        self._forget_remote = forget_remote  # drops a NIXL peer (KVAgent.forget_remote)
        self._timeout_s = timeout_s
        # address -> (incarnation, its regions: one per TP rank, rank order)
        self._known: dict[str, tuple[str, list[KVRegion]]] = {}
        self._pending: dict[tuple[str, str], asyncio.Task] = {}  # handshakes in flight (owned; close() cancels)
        self.handshakes = 0  # completed handshakes (tests count them)

    async def region(self, address: str, incarnation: str) -> list[KVRegion]:
        """The regions (one per TP rank) of the peer incarnation that pinned a KvHandle; raises KVTransferError
        (PEER_GONE, INCOMPATIBLE) or KVLayoutMismatch."""
        known = self._known.get(address)
        if known is not None and known[0] == incarnation:
            return known[1]
        key = (address, incarnation)
        task = self._pending.get(key)
        if task is None:
            task = self._pending[key] = asyncio.get_running_loop().create_task(self._handshake(address, incarnation))
            task.add_done_callback(lambda t: self._done(key, t))
        return await asyncio.shield(task)  # one caller's cancellation leaves the handshake to the others

    def _done(self, key: tuple[str, str], t: asyncio.Task) -> None:
        self._pending.pop(key, None)
        if not t.cancelled():
            t.exception()  # retrieved: its callers may all have been cancelled

    async def _handshake(self, address: str, incarnation: str) -> list[KVRegion]:
        req = worker_pb2.KvHandshakeRequest(protocol_version=self._version, layout=layout_to_pb(self._layout.to_dict()))
        try:
            # wait_for_ready: the peer answered its Prefill call moments ago, so a first connection attempt that
            # fails (a SYN lost on a loaded link, the channel still in its reconnect backoff) is retried within the
            # timeout instead of failing the request UNAVAILABLE at once; a peer that is really gone still ends it
            resp = await self._stub_for(address).KvHandshake(req, timeout=self._timeout_s, wait_for_ready=True)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise KVTransferError(f"KV handshake with {address} refused: {e.details()}",
                                      TransferFailure.INCOMPATIBLE) from None
            raise KVTransferError(f"KV handshake with {address} failed: {e.code().name}",
                                  TransferFailure.PEER_GONE) from None
        if resp.protocol_version != self._version:
            raise KVTransferError(f"KV protocol version mismatch with {address}: local={self._version} "
                                  f"remote={resp.protocol_version}", TransferFailure.INCOMPATIBLE)
        if resp.incarnation != incarnation:  # it restarted after pinning: those blocks died with it
            raise KVTransferError(f"prefill worker {address} restarted (incarnation {resp.incarnation}, the KV was "
                                  f"pinned by {incarnation})", TransferFailure.PEER_GONE)
        regions = [region_from_pb(r) for r in resp.tp_regions] or [region_from_pb(resp.region)]
        for r in regions:  # the model must match; the TP degrees may differ (tp_plan.py)
            check_compatible(self._layout, r.layout)
        check_ranks([r.layout for r in regions])
        names = {r.agent_name for r in regions}
        # Drop every earlier incarnation of this peer: the one at this address, and one that had the same agent name
        # at another address (a worker restarted under a new address keeps its worker id, hence its agent name:
        # NIXL would otherwise keep the dead process's metadata and descriptors under that name).
        stale = {a for a, (_, rs) in self._known.items() if a == address or names & {r.agent_name for r in rs}}
        for a in stale:
            for r in self._known.pop(a)[1]:
                self._forget_remote(r.agent_name)
        self._known[address] = (incarnation, regions)
        self.handshakes += 1
        M.KV_HANDSHAKES.labels("initiated").inc()
        log.info("KV handshake with %s (incarnation %s, agents %s)", address, incarnation,
                 ", ".join(r.agent_name for r in regions))
        return regions

    async def close(self) -> None:
        for t in list(self._pending.values()):
            t.cancel()
        await asyncio.gather(*list(self._pending.values()), return_exceptions=True)
