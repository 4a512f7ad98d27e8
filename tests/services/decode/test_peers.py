"""The decode side's KV handshake (services/decode/peers.py) over real gRPC.

A CI run under load saw a handshake with a live prefill peer fail UNAVAILABLE ~100 ms into its first connection
attempt, which failed that request's hand-off. The handshake now waits for the connection within its timeout: a
peer whose port answers a moment late is reached; one that never answers still fails, as PEER_GONE, by the timeout.
"""
import asyncio
import time

import grpc
import pytest

from pdserve.kv_transfer.agent import KVTransferError, TransferFailure
from pdserve.kv_transfer.layout import KV_PROTOCOL_VERSION, KVLayout, KVRegion
from pdserve.services.convert import region_to_pb
from pdserve.services.decode.peers import KvPeers
from pdserve.services.grpc_util import channel
from pdserve.services.pb import worker_pb2, worker_pb2_grpc
from pdserve.services.ports import free_port

LAYOUT = KVLayout(fingerprint="f" * 16, block_size=16, dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=8)
REGION = KVRegion(agent_name="prefill-x", agent_metadata=b"md", base_addr=4096, num_blocks=8, device_id=0,
                  mem_type="DRAM", layout=LAYOUT)


class _Peer(worker_pb2_grpc.WorkerServicer):
    async def KvHandshake(self, request, context):
        return worker_pb2.KvHandshakeResponse(protocol_version=KV_PROTOCOL_VERSION, incarnation="inc-1",
                                              region=region_to_pb(REGION))


async def _serve_after(port: int, delay_s: float) -> grpc.aio.Server:
    await asyncio.sleep(delay_s)
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(_Peer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server


def _peers(timeout_s: float) -> KvPeers:
    return KvPeers(lambda a: worker_pb2_grpc.WorkerStub(channel(a)), LAYOUT, KV_PROTOCOL_VERSION,
                   forget_remote=lambda name: None, timeout_s=timeout_s)


def test_a_peer_listening_a_moment_late_is_reached():
    async def main():
        port = free_port()
        serving = asyncio.create_task(_serve_after(port, 0.4))  # the first connect attempt is refused
        peers = _peers(timeout_s=5)
        try:
            regions = await peers.region(f"127.0.0.1:{port}", "inc-1")
        finally:
            await (await serving).stop(None)
            await peers.close()
        assert [r.agent_name for r in regions] == ["prefill-x"] and regions[0].layout == LAYOUT
        assert peers.handshakes == 1

    asyncio.run(main())


def test_a_peer_that_never_answers_fails_by_the_timeout():
    async def main():
        peers = _peers(timeout_s=1.0)
        t0 = time.monotonic()
        with pytest.raises(KVTransferError) as e:
            await peers.region(f"127.0.0.1:{free_port()}", "inc-1")
        took = time.monotonic() - t0
        await peers.close()
        assert e.value.kind == TransferFailure.PEER_GONE and "DEADLINE_EXCEEDED" in str(e.value)
        assert 0.9 <= took < 3.0, took

    asyncio.run(main())
