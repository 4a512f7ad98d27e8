"""KV transfer between pools of different TP degrees (kv_transfer/tp_plan.py, tp_pull.py): real NIXL (UCX, DRAM)
between this process and a peer process holding the prefill side's per-rank pools.

The reference is plain indexing of one full KV tensor [blocks, layers, K/V, tokens, heads, head_dim]: prefill
rank i's pool is its heads' slice of it (engine/tp/shard.py), and after the pull decode rank j's pool must hold
exactly its heads' slice of the source blocks at the destination blocks, and zeros everywhere else."""
import multiprocessing as mp

import pytest
import torch

from pdserve.engine.tp.shard import kv_head_range
from pdserve.kv_transfer.agent import KVAgent
from pdserve.kv_transfer.layout import KVLayout, KVLayoutMismatch
from pdserve.kv_transfer.tp_plan import HeadSlice, plan_reads
from pdserve.kv_transfer.tp_pull import read_for_rank

BLOCKS, LAYERS, BS, HEAD_DIM = 24, 2, 4, 8


def layout(total: int, tp: int, rank: int) -> KVLayout:
    heads = kv_head_range(total, rank, tp)
    return KVLayout("fp-tp", BS, "float32", LAYERS, len(heads), HEAD_DIM, LAYERS * 2 * BS * len(heads) * HEAD_DIM * 4,
                    tp, rank, heads.start, total)


def full_kv(total: int, seed: int = 7) -> torch.Tensor:
    return torch.randn((BLOCKS, LAYERS, 2, BS, total, HEAD_DIM), generator=torch.Generator().manual_seed(seed))


def rank_pool(full: torch.Tensor, total: int, tp: int, rank: int) -> torch.Tensor:
    h = kv_head_range(total, rank, tp)
    return full[:, :, :, :, h.start:h.stop].contiguous()


def _serve(conn, total: int, tp: int):
    """The prefill side: one agent per rank over its pool, all in this process."""
    full = full_kv(total)
    agents = [KVAgent(f"pre-k{total}-tp{tp}-r{r}", rank_pool(full, total, tp, r), layout(total, tp, r))
              for r in range(tp)]
    for a in agents:
        a.start_pump()
    conn.send([a.region() for a in agents])
    conn.poll(120)


@pytest.fixture(scope="module")
def prefill():
    """One peer process per (KV heads, prefill TP), shared by the cases that read from it."""
    ctx = mp.get_context("spawn")
    procs = []
    regions = {}

    def start(total: int, tp: int):
        if (total, tp) not in regions:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(child, total, tp), daemon=True)
            p.start()
            procs.append((p, parent))
            assert parent.poll(60), "prefill peer did not start"
            regions[(total, tp)] = parent.recv()
        return regions[(total, tp)]

    yield start
    for p, conn in procs:
        conn.send("stop")
        p.join(5)
        if p.is_alive():
            p.kill()


def test_plan_follows_the_shard_rule():
    """Spec examples: 2 KV heads read 1 -> 2 (a sub-range of one pool), 2 -> 1 (one head from each rank), and
    1 KV head replicated on 2 prefill ranks: decode ranks spread over the holders."""
    assert plan_reads(layout(2, 2, 1), [layout(2, 1, 0)]) == [HeadSlice(0, 1, 0, 1)]
    assert plan_reads(layout(2, 1, 0), [layout(2, 2, 0), layout(2, 2, 1)]) == [HeadSlice(0, 0, 0, 1),
                                                                               HeadSlice(1, 0, 1, 1)]
    assert plan_reads(layout(1, 2, 1), [layout(1, 2, 0), layout(1, 2, 1)]) == [HeadSlice(1, 0, 0, 1)]
    assert plan_reads(layout(4, 2, 1), [layout(4, 4, r) for r in range(4)]) == [HeadSlice(2, 0, 0, 1),
                                                                                HeadSlice(3, 0, 1, 1)]


def test_incompatible_peers_are_refused_naming_the_fields():
    with pytest.raises(KVLayoutMismatch, match="tp_size"):  # a TP=2 peer that sent only rank 0's region
        plan_reads(layout(2, 1, 0), [layout(2, 2, 0)])
    with pytest.raises(KVLayoutMismatch, match="total_kv_heads"):  # another model (4 KV heads, not 2)
        plan_reads(layout(2, 1, 0), [layout(4, 2, 0), layout(4, 2, 1)])
    with pytest.raises(KVLayoutMismatch, match="tp_rank"):  # regions out of rank order
        plan_reads(layout(2, 1, 0), [layout(2, 2, 1), layout(2, 2, 0)])


@pytest.mark.parametrize("total,p,d,staging", [(2, 1, 2, "exact"), (2, 1, 2, "always"), (2, 2, 1, "exact"),
                                               (2, 2, 1, "off"), (2, 2, 2, "exact"), (1, 2, 1, "exact"),
                                               (1, 1, 2, "exact"), (4, 2, 4, "exact"), (4, 4, 2, "exact"),
                                               (4, 4, 2, "off")])
def test_each_decode_rank_pulls_exactly_its_heads(prefill, monkeypatch, total, p, d, staging):
    """P > D reads whole remote blocks into a staging tensor and copies them into the head range ("exact"), or
    per-row descriptors straight into the pool ("off"); P < D reads per-row descriptors of a remote sub-range
    ("exact") or whole remote blocks, keeping its heads ("always": reads P/D times its share)."""
    monkeypatch.setenv("PDSERVE_KV_TP_STAGING", staging)
    regions = prefill(total, p)
    full = full_kv(total)
    src, dst = [3, 17, 0, 23, 8], [5, 6, 20, 1, 12]
    for j in range(d):
        lay = layout(total, d, j)
        pool = torch.zeros((BLOCKS, LAYERS, 2, BS, lay.num_kv_heads, HEAD_DIM))
        agent = KVAgent(f"dec-k{total}-{p}to{d}-s{staging}-r{j}", pool, lay)
        try:
            moved = read_for_rank(agent, regions, src, dst, timeout_s=20)
            h = lay.heads
            over = d // p if staging == "always" and d > p and total >= d else 1  # the remote pool's other heads
            assert moved == len(src) * agent.block_bytes * over  # its heads only, each byte once (unless "always")
            assert torch.equal(pool[dst], full[src][:, :, :, :, h.start:h.stop])
            untouched = [i for i in range(BLOCKS) if i not in dst]
            assert pool[untouched].abs().sum() == 0
        finally:
            agent.close()
