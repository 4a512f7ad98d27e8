"""This worker as a KV transfer peer: what its KvHandles and its side of the KV handshake say about it."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.kv_transfer.layout import KVLayout
from pdserve.services.pb import common_pb2


@dataclass(frozen=True)
class KvEndpoint:
    worker_id: str
    address: str              # its gRPC address (ReleaseKV and KvHandshake go there)
    incarnation: str          # drawn per process: a peer that sees it change shakes hands again
    protocol_version: int     # KV_PROTOCOL_VERSION (a fault injection may override it)
    layout: KVLayout
    region: common_pb2.KvRegion  # where its KV lives (empty for a worker without a NIXL agent)
    # under tensor parallelism, every rank's region in rank order (region is rank 0's); empty otherwise
    tp_regions: list[common_pb2.KvRegion] = field(default_factory=list)
