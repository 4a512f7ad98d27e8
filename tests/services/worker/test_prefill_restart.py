"""A prefill worker that dies and comes back under a new address (same worker id, so the same NIXL agent name, new
incarnation): the decode worker's pull of KV pinned by the dead process fails fast, as a FAILED message marked
`retryable` (the gateway then places the request again: gateway/migration.py), and the next hand-off from the new
address shakes hands again, drops the dead process's NIXL peer and serves the same tokens.

Real worker processes, real gRPC, real NIXL READs; the reference tokens are the first process's own hand-off of the
same prompt (greedy).
"""
import asyncio
import signal
import time

from pdserve.engine.sampling_params import SamplingParams
from pdserve.services.convert import params_to_pb
from pdserve.services.grpc_util import channel
from pdserve.services.pb import worker_pb2, worker_pb2_grpc
from pdserve.services.ports import free_port
from tests.services._workers import start_worker, wait_serving
from tests.services.worker.test_kv_handshake import _handoff, _handshakes, _stop

PARAMS = params_to_pb(SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
TRANSFER_TIMEOUT_S = 8.0


def test_prefill_restart_under_a_new_address(tiny_llama):
    dmet = free_port()
    wid = ("--worker-id", "prefill-a")  # kept across the restart, as a pod's name or a fixed id would be
    p1, port1 = start_worker(tiny_llama, "prefill", *wid)
    decode, dport = start_worker(tiny_llama, "decode", "--metrics-port", str(dmet),
                                 "--transfer-timeout", str(TRANSFER_TIMEOUT_S))
    p2 = None
    try:
        async def main():
            nonlocal p2
            await asyncio.gather(wait_serving(port1), wait_serving(dport))
            ps = worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{port1}"))
            ds = worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{dport}"))
            prompt = list(range(2, 60))
            pre1, toks = await _handoff(ps, ds, "a", prompt)
            assert _handshakes(dmet, "initiated") == 1
            # KV pinned by the first process, which then dies before the decode worker pulls it
            pre = await ps.Prefill(worker_pb2.PrefillRequest(request_id="gone", prompt_token_ids=list(range(70, 99)),
                                                             params=PARAMS))
            assert not pre.finished
            p1.send_signal(signal.SIGKILL)
            p1.wait(10)
            t0 = time.monotonic()
            msgs = [m async for m in ds.GenerateFromPrefill(worker_pb2.GenerateFromPrefillRequest(
                request_id="gone", prompt_token_ids=list(range(70, 99)), params=PARAMS,
                first_tokens=pre.first_tokens, kv=pre.kv), timeout=60)]
            took = time.monotonic() - t0
            print(f"pull from a dead prefill incarnation failed after {took:.2f} s")
            last = msgs[-1]
            assert last.finished and last.state == "FAILED" and last.retryable, last
            assert not any(o.token_ids for m in msgs for o in m.outputs)
            assert took < TRANSFER_TIMEOUT_S, f"the pull from a dead peer took {took:.1f} s"
            # the same worker id at a new address: a new handshake, the old agent dropped, the same tokens
            p2, port2 = start_worker(tiny_llama, "prefill", *wid)
            await wait_serving(port2)
            ps2 = worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{port2}"))
            pre2, toks2 = await _handoff(ps2, ds, "a2", prompt)
            assert pre2.kv.incarnation != pre1.kv.incarnation and pre2.kv.worker_address != pre1.kv.worker_address
            assert toks2 == toks
            assert _handshakes(dmet, "initiated") == 2
            _, toks3 = await _handoff(ps2, ds, "a3", prompt)  # known now: no third handshake
            assert toks3 == toks and _handshakes(dmet, "initiated") == 2
            # the decode worker holds nothing for the failed request
            st = await ds.GetStats(worker_pb2.GetStatsRequest())
            assert st.load.kv_blocks_in_use == 0 and not any(st.states.values()), st

        asyncio.run(main())
    finally:
        for p in (p1, p2, decode):
            if p is not None and p.poll() is None:
                _stop(p)
