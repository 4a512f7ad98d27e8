"""The router prices a hand-off from a TP worker by the replica's bytes: its registry layout is rank 0's pool
(a share of the KV heads), so the block bytes it reports are scaled to the model's heads."""
from pdserve.services.pb import common_pb2
from pdserve.services.router.cache_aware import Policy
from pdserve.services.router.cost import WorkerCost, replica_block_bytes
from tests.services.router.test_routing import BS, _rec

MIB = 1024 * 1024


def test_block_bytes_are_the_replicas():
    one = common_pb2.KvLayout(block_bytes=2 * MIB, num_kv_heads=8, total_kv_heads=8)
    shard = common_pb2.KvLayout(block_bytes=MIB, num_kv_heads=4, total_kv_heads=8, tp_size=2)
    replicated = common_pb2.KvLayout(block_bytes=MIB // 4, num_kv_heads=1, total_kv_heads=2, tp_size=4)
    old = common_pb2.KvLayout(block_bytes=2 * MIB)  # a worker from before TP: no head counts
    assert [replica_block_bytes(x) for x in (one, shard, replicated, old)] == [2 * MIB, 2 * MIB, MIB // 2, 2 * MIB]


def test_transfer_time_of_a_tp_prefill_counts_every_rank():
    pol = Policy("disagg", inflight_ttl_s=0)
    p1, d = _rec("p1", "prefill", bw=1e9), _rec("d", "decode", bw=1e9)
    p2 = _rec("p2", "prefill", bw=1e9)
    p2.layout.CopyFrom(common_pb2.KvLayout(fingerprint=p1.layout.fingerprint, block_size=p1.layout.block_size,
                                           block_bytes=MIB, num_kv_heads=1, total_kv_heads=2, tp_size=2))
    pri = pol.cost.p.priors
    w1, w2, wd = (WorkerCost.of(r, pri) for r in (p1, p2, d))
    e1, e2 = pol.cost.disagg(w1, wd, 64, 0, 0, 8), pol.cost.disagg(w2, wd, 64, 0, 0, 8)
    # 2 MiB a block either way: 64 tokens in blocks of BS at 1 GB/s
    assert abs(e2.transfer_s - 64 // BS * 2 * MIB / 1e9) < 1e-12 and e1.transfer_s == e2.transfer_s
