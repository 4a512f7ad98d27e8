"""The router weighs the decode side's cached prefix: a disaggregated request's transfer cost counts only the
blocks the decode worker's prefix cache lacks (decode/pull_plan.py pulls exactly those), so over a slow link the
decode worker already holding a chat's last turn wins, and over a fast one the saving is a near-tie."""
import random

from pdserve.services.router.cache_aware import Policy, RouteInput
from pdserve.services.router.cost import CostModel, Priors, WorkerCost
from tests.services.router.test_routing import BS, _index_with, _rec

BLOCK = 2 * 1024 * 1024  # _rec's block bytes


def test_transfer_cost_counts_only_the_blocks_the_decode_side_lacks():
    p, d = WorkerCost.of(_rec("p0", "prefill"), Priors()), WorkerCost.of(_rec("d0", "decode", bw=100e6), Priors())
    cm = CostModel()
    n = 1000  # 63 blocks (62.5)
    cold = cm.disagg(p, d, n, 0, 0, 16).transfer_s
    assert abs(cold - 63 * BLOCK / 100e6) < 1e-9
    warm = cm.disagg(p, d, n, 0, 40 * BS, 16)
    assert abs(warm.transfer_s - 23 * BLOCK / 100e6) < 1e-9
    assert abs((cm.disagg(p, d, n, 0, 0, 16).ttft_s - warm.ttft_s) - 40 * BLOCK / 100e6) < 1e-9


def test_decode_worker_holding_the_last_turn_is_chosen():
    turn1 = list(range(1, 801))
    turn2 = turn1 + list(range(900, 1100))  # the next turn: turn 1 is a 50-block prefix
    req = RouteInput("r", turn2, max_tokens=16)
    for holder in ("d0", "d1"):
        pol = Policy("disagg", index=_index_with(turn1, holder), rng=random.Random(0), inflight_ttl_s=0)
        # 50 MB/s: each block is 42 ms on the link, the 49 cached blocks 2.1 s
        ws = [_rec("p0", "prefill"), _rec("d0", "decode", bw=50e6), _rec("d1", "decode", bw=50e6)]
        picks = {pol.place(ws, req=req).decode.worker_id for _ in range(20)}
        assert picks == {holder}
        # the prefill side holds nothing: it still computes the whole prompt (cached_tokens is its hit); the
        # decode worker's hit goes to the gateway for admission: the index holds turn 1's blocks but the one with
        # its last token, (800 - 1) // 16 = 49 blocks
        pl = pol.place(ws, req=req)
        assert (pl.cached_tokens, pl.decode_cached_tokens) == (0, 49 * BS)
        assert pl.header().endswith(f";decode_cached_tokens={49 * BS}")
    # without the index the two decode workers tie and share the requests
    pol = Policy("disagg", rng=random.Random(0), inflight_ttl_s=0)
    ws = [_rec("p0", "prefill"), _rec("d0", "decode", bw=50e6), _rec("d1", "decode", bw=50e6)]
    assert {pol.place(ws, req=req).decode.worker_id for _ in range(40)} == {"d0", "d1"}
