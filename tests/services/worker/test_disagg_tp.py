"""Disaggregated serving between workers of different TP degrees: real `pdserve worker`
processes (each TP worker with its rank processes), real gRPC, real NIXL (UCX over DRAM) between every pair of
pools. Each hand-off's greedy tokens must equal `transformers` on the same tiny random Llama (fp32), and both
sides hold no blocks afterwards.

- 2 KV heads (4 query heads): at TP 2 each rank holds one head, so 1 -> 2 reads a sub-range of a pool, 2 -> 1
  one head from each prefill rank into one pool, 2 -> 2 pool to pool.
- 1 KV head: at TP 2 the head is replicated on both ranks (spec D08); 2 -> 2 reads whole blocks, each decode rank
  from its own prefill rank."""
from __future__ import annotations

import asyncio
import signal

import pytest
import torch
import transformers as tf

from pdserve.engine.sampling_params import SamplingParams
from pdserve.services.convert import params_to_pb
from pdserve.services.grpc_util import channel
from pdserve.services.pb import worker_pb2, worker_pb2_grpc
from tests.conftest import make_checkpoint
from tests.services._workers import start_worker, wait_serving

MAX_TOKENS = 6
PARAMS = params_to_pb(SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
PROMPTS = [list(range(5, 23)), list(range(40, 47))]  # 5 blocks of 4 (the last partial), 2 blocks


def hf_greedy(ck, prompts):
    hf = tf.AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32).eval()
    return [hf.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def _workers(ck, specs: list[tuple[str, int]]):
    procs = {}
    for role, tp in specs:
        procs[(role, tp)] = start_worker(ck, role, "--tensor-parallel-size", str(tp), "--dtype", "float32",
                                         "--threads", "1", "--block-size", "4")
    return procs


def _stop(procs) -> None:
    for p, _ in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p, _ in procs.values():
        try:
            assert p.wait(30) == 0
        except Exception:
            p.kill()
            raise


async def _handoff(ps, ds, rid: str, prompt: list[int]) -> list[int]:
    pre = await ps.Prefill(worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, params=PARAMS))
    assert not pre.finished and pre.kv.block_ids
    msgs = [m async for m in ds.GenerateFromPrefill(worker_pb2.GenerateFromPrefillRequest(
        request_id=rid, prompt_token_ids=prompt, params=PARAMS, first_tokens=pre.first_tokens, kv=pre.kv))]
    assert msgs[-1].state == "FINISHED", msgs[-1]
    return [t for m in msgs for o in m.outputs for t in o.token_ids]


async def _idle(stub) -> None:
    """No blocks held once the hand-off is done (the prefill side's release follows the first token)."""
    for _ in range(100):
        s = await stub.GetStats(worker_pb2.GetStatsRequest())
        if s.load.kv_blocks_in_use == 0 and s.load.pinned_blocks == 0:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"blocks still held: {s.load}")


def _run(ck, pairs: list[tuple[int, int]]):
    specs = sorted({("prefill", p) for p, _ in pairs} | {("decode", d) for _, d in pairs})
    procs = _workers(ck, specs)
    try:
        async def main():
            await asyncio.gather(*(wait_serving(port) for _, port in procs.values()))
            stub = {k: worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{port}")) for k, (_, port) in procs.items()}
            for k, s in stub.items():  # each worker says its degree
                assert (await s.GetStats(worker_pb2.GetStatsRequest())).load.tensor_parallel_size == k[1]
            got = {}
            for p, d in pairs:
                got[(p, d)] = [await _handoff(stub[("prefill", p)], stub[("decode", d)], f"r{p}{d}{i}", prompt)
                               for i, prompt in enumerate(PROMPTS)]
            for s in stub.values():
                await _idle(s)
            return got

        got = asyncio.run(main())
    finally:
        _stop(procs)
    ref = hf_greedy(ck, PROMPTS)
    for pair, toks in got.items():
        assert toks == ref, f"TP {pair[0]} -> {pair[1]}"


def test_sharded_heads_across_tp_degrees(tiny_llama):
    _run(tiny_llama, [(1, 2), (2, 1), (2, 2)])


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("kv1"), "llama", kv_heads=1)


def test_replicated_head_across_tp_degrees(one_kv_head):
    _run(one_kv_head, [(2, 2), (2, 1)])
