"""Expert parallelism by all-to-all dispatch (engine/tp/dispatch.py) over real gloo groups of two processes.

The dispatch itself against float64 math (and a group whose second rank claims the first rank's experts must
fail that check); the bytes a step moves, counted by the group, against the formula evaluated on transformers'
own router logits for the same prompt; the deterministic mode's batch invariance kept across the all-to-all.
About 30 s on a 2-vCPU AMD EPYC (load average 6): one child process per dispatch group, six 2-rank engines."""
from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
import torch.distributed as dist

from pdserve.engine.engine import Engine, EngineConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tp.comm import COLLECTIVE_TIMEOUT, TPComm
from pdserve.engine.tp.dispatch import ExpertDispatch, token_slice
from tests.conftest import make_checkpoint

E, K, H, T = 4, 2, 8, 7  # 7 tokens over 2 ranks: slices of 4 and 3


def _case():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=g)
    chosen = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=g)
    return x, weights, chosen


def _expert(x: torch.Tensor, e) -> torch.Tensor:
    """Expert e's stand-in: distinct per expert, so a row computed by the wrong expert shows."""
    return x * (e + 1) + e


def _dispatch_rank(rank: int, port: int, claim: tuple[int, int]) -> dict:
    comm = TPComm("127.0.0.1", port, rank, 2, torch.device("cpu"))
    x, weights, chosen = _case()
    lo, hi, _ = token_slice(T, rank, 2)
    weights_of = claim[0]  # the first expert whose weights this rank computes with
    out, counts = ExpertDispatch(comm, E, range(2, 4))(x[lo:hi], weights[lo:hi], chosen[lo:hi],
                                                      lambda rows, local: _expert(rows, (local + weights_of)[:, None]))
    ref = sum(weights[lo:hi, j, None].double() * _expert(x[lo:hi].double(), chosen[lo:hi, j, None].double())
              for j in range(K))
    return {"err": (out.double() - ref).abs().max().item() if hi > lo else 0.0,
            "counts": counts.tolist(), "sent": comm.bytes_all_to_all}


def _child(port: int, claim: tuple[int, int], q) -> None:
    q.put(_dispatch_rank(1, port, claim))


@pytest.mark.parametrize("rank1_claims", [(2, 4), (0, 2)], ids=["split", "both-ranks-same-experts"])
def test_dispatch_equals_float64_and_catches_rows_sent_to_the_wrong_rank(rank1_claims):
    """Rank 0 holds experts 0-1, rank 1 holds 2-3 ('split': every row of both slices equals the float64 weighted
    sum of its experts) or holds the weights of 0-1 as well ('both-ranks-same-experts': the rows routed to experts
    2-3 are computed as experts 0-1, and the check must fail). A rank whose expert range disagrees with the
    dispatch's ownership fails louder: its received rows do not match its counts."""
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    child = ctx.Process(target=_child, args=(store.port, rank1_claims, q))
    child.start()
    try:
        comm = TPComm("127.0.0.1", store.port, 0, 2, torch.device("cpu"), store=store)
        x, weights, chosen = _case()
        out, counts = ExpertDispatch(comm, E, range(0, 2))(
            x[:4], weights[:4], chosen[:4], lambda rows, local: _expert(rows, local[:, None]))
        ref = sum(weights[:4, j, None].double() * _expert(x[:4].double(), chosen[:4, j, None].double())
                  for j in range(K))
        errs = [(out.double() - ref).abs().max().item(), q.get(timeout=60)["err"]]
    finally:
        child.join(60)
    # every rank's counter sees every token's choices
    assert counts.tolist() == torch.bincount(chosen.flatten(), minlength=E).tolist()
    # rank 0 sends, per token of its slice with any expert on rank 1, the hidden row and K (expert, weight) float64
    # slots; and back, per token of rank 1's slice with any expert here, one partial row
    out, back = int((chosen[:4] >= 2).any(1).sum()), int((chosen[4:] < 2).any(1).sum())
    assert comm.bytes_all_to_all == out * (H * 4 + 16 * K) + back * H * 4
    if rank1_claims == (2, 4):
        assert max(errs) < 1e-5  # fp32 rounding of values up to ~10
    else:
        assert max(errs) > 0.1


def _ep2(ck, **kw) -> Engine:
    return Engine.from_pretrained(ck, EngineConfig(num_gpu_blocks=64, block_size=4, dtype="float32", num_threads=1,
                                                   tensor_parallel_size=2, expert_parallel_size=2, **kw))


def _step_bytes(e: Engine, prompt: list[int]) -> dict:
    comm = e.tp_group.comm
    names = ("bytes_reduced", "bytes_all_to_all", "bytes_all_gathered", "bytes_reduce_scattered")
    before = {n: getattr(comm, n) for n in names}
    e.generate([prompt], SamplingParams(temperature=0, max_tokens=1))  # one prefill step, no decode step
    return {n: getattr(comm, n) - before[n] for n in names}


def test_bytes_per_step_all_to_all_and_all_reduce_follow_the_routing(tmp_path):
    """Mixtral (4 experts, top 2, 2 MoE layers, hidden 64) at TP 2 + EP 2, one prefill step of 29 tokens. Rank 0
    owns tokens 0-14 and experts 0-1. From transformers' router logits (top 2 per token, every layer): rank 0
    sends a hidden row for each of its tokens that chose expert 2 or 3 or both (with its 2 routing slots) and a
    partial output row for each of rank 1's tokens that chose 0 or 1 or both; the slices all-gathered are 15 rows (and the 4 counts); the attention output reduce-scattered
    is 30 rows (29 padded). The all-reduce combine hands the whole 29 x 64 output to an all-reduce per layer."""
    import transformers as tf
    ck = make_checkpoint(tmp_path / "mx", "mixtral")
    prompt = list(range(30, 59))
    t, h, per = len(prompt), 64, 15
    hf = tf.AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt]), output_router_logits=True).router_logits
    chosen = [lg.reshape(t, -1).double().topk(2, dim=-1).indices for lg in logits]
    # a hidden row (with 2 float64 (expert, weight) slots going out) per (token, other rank) pair each way
    out = sum(int((c[:per] >= 2).any(1).sum()) for c in chosen)
    rows = out + sum(int((c[per:] < 2).any(1).sum()) for c in chosen)
    layers = len(chosen)
    engines = []
    try:
        for mode in ("all_to_all", "all_reduce"):
            engines.append(_ep2(ck, expert_dispatch=mode))
        a2a, ar = (_step_bytes(e, prompt) for e in engines)
    finally:
        for e in engines:
            e.close()
    embed = t * h * 4  # the vocab-parallel embedding's all-reduce, the same in both
    assert a2a == {"bytes_reduced": embed, "bytes_all_to_all": rows * h * 4 + out * 2 * 16,
                   "bytes_all_gathered": layers * (per * h * 4 + (4 + 2) * 8),
                   "bytes_reduce_scattered": layers * 2 * per * h * 4}
    assert ar == {"bytes_reduced": embed + layers * 2 * t * h * 4, "bytes_all_to_all": 0, "bytes_all_gathered": 0,
                  "bytes_reduce_scattered": 0}
    print(f"\nbytes rank 0 sent, one 29-token prefill step, 2 MoE layers: all-to-all hidden rows {rows} "
          f"(per (token, expert) choice: {layers * t * 2 / 2:.0f} at uniform routing)")


def test_deterministic_mode_keeps_batch_invariance_across_the_all_to_all(tmp_path):
    """--deterministic at TP 2 + EP 2 (Qwen3-MoE): a prompt's logprobs and greedy tokens are bit for bit the same
    served alone and batched with three others (its rows then land in other slices, beside other rows in the
    experts' GEMMs on the other rank)."""
    ck = make_checkpoint(tmp_path / "q3", "qwen3_moe")
    e = _ep2(ck, deterministic=True, enable_prefix_caching=False, expert_dispatch="all_to_all")
    try:
        p = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1, prompt_logprobs=1)
        target = list(range(40, 53))
        alone = e.generate([target], p)[0]
        batched = e.generate([[5, 6, 7], target, list(range(60, 81)), [9]], p)[1]
    finally:
        e.close()
    assert e.tp_group.comm.bytes_all_to_all > 0
    assert alone.outputs[0].token_ids == batched.outputs[0].token_ids
    assert [r.logprob for r in alone.outputs[0].logprobs] == [r.logprob for r in batched.outputs[0].logprobs]
    assert [x.logprob for x in alone.prompt_logprobs[1:]] == [x.logprob for x in batched.prompt_logprobs[1:]]


@pytest.mark.parametrize("arch,dispatch", [("mixtral", "all_to_all"), ("deepseek_v3", "all_to_all"),
                                           ("gpt_oss", "all_reduce")])
def test_expert_parallel_2_without_tensor_parallelism_equals_one_rank_and_transformers(tmp_path, arch, dispatch):
    """--expert-parallel-size 2 at TP 1: two ranks, each with every head, the whole KV and LM head, and half the
    routed experts. Greedy tokens equal transformers' and one rank's, prompt logprobs within 2e-4 of one rank's."""
    from tests.engine.test_tp import PROMPTS, config, hf_greedy
    ck = make_checkpoint(tmp_path / arch, arch, kv_heads=2)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    lp = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    e2 = Engine.from_pretrained(ck, config(1, expert_parallel_size=2, expert_dispatch=dispatch))
    try:
        net = e2.runner.model
        layer = next(m for m in net.layers if m.moe is not None)
        assert net.shard.replicated and len(net.shard.heads) == 4 and e2.tp_group.comm.size == 2
        assert len(layer.moe.gate_up) == layer.moe.router.shape[0] // 2
        ours = [o.outputs[0].token_ids for o in e2.generate(PROMPTS, greedy)]
        a = e2.generate([PROMPTS[2]], lp)[0].prompt_logprobs
        comm = e2.tp_group.comm
        assert (comm.bytes_all_to_all > 0, comm.bytes_reduced > 0) == ((True, False) if dispatch == "all_to_all"
                                                                      else (False, True))
    finally:
        e2.close()
    assert ours == hf_greedy(ck, PROMPTS, 8)
    e1 = Engine.from_pretrained(ck, config(1))
    assert ours == [o.outputs[0].token_ids for o in e1.generate(PROMPTS, greedy)]
    b = e1.generate([PROMPTS[2]], lp)[0].prompt_logprobs
    assert max(abs(x.logprob - y.logprob) for x, y in zip(a[1:], b[1:])) <= 2e-4


@pytest.mark.parametrize("ranks,top_k,replicated,want", [
    (2, 2, False, False), (4, 2, False, True), (8, 8, False, False), (2, 1, False, True),
    (4, 2, True, False), (8, 2, True, True), (2, 2, True, False)])
def test_auto_dispatch_takes_all_to_all_only_where_it_moves_fewer_bytes(ranks, top_k, replicated, want):
    """The rows of hidden each rank sends per sparse layer, per token, from the formulas in docs/engine.md:
    all-to-all is chosen exactly where it sends fewer."""
    from pdserve.engine.tp.dispatch import uses_all_to_all
    n, k = ranks, top_k
    all_reduce = (2 if replicated else 4) * (n - 1) / n
    all_to_all = (n - 1) / n * ((1 if replicated else 2) + 2 * k / n)
    assert (all_to_all < all_reduce) == want
    assert uses_all_to_all("auto", n, k, replicated) == want
    assert uses_all_to_all("all_to_all", n, k, replicated) and not uses_all_to_all("all_reduce", n, k, replicated)
