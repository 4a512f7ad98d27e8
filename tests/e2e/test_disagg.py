"""`pdserve up --mode disagg`: 1 prefill + 2 decode workers; KV moves over NIXL between processes."""
import asyncio
import os
import signal
import time

import httpx
import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.services.convert import params_to_pb
from pdserve.services.grpc_util import channel
from pdserve.services.pb import gateway_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.e2e import _common
from tests.e2e.conftest import Up, metric, wait_until


@pytest.fixture(scope="module")
def up(tiny_llama):
    import shutil
    model = tiny_llama.parent / "ck"
    if not model.exists():
        shutil.copytree(tiny_llama, model)
    d = Up(model, "--mode", "disagg", "--prefill", "1", "--decode", "2", "--lease-ttl", "4",
           "--no-restart")  # test_kill_decode_worker_mid_stream: the killed worker stays dead
    yield d
    d.stop()


def test_greedy_matches_offline_engine(up, offline_greedy):
    _common.check_greedy_batch(up, offline_greedy)
    # the KV really moved: decode workers pulled bytes over NIXL
    pulled = sum(metric(w["metrics_port"], "pdserve_kv_transfer_bytes_total") for w in up.workers("decode"))
    assert pulled > 0
    # the prefill worker's NIXL region went to each decode worker once (one handshake per peer pair), however
    # many requests moved KV: it is not re-shipped in every PrefillResponse
    hs = [metric(w["metrics_port"], "pdserve_kv_handshakes_total", '{side="initiated"}') for w in up.workers("decode")]
    served = metric(up.workers("prefill")[0]["metrics_port"], "pdserve_kv_handshakes_total", '{side="served"}')
    assert all(h == 1 for h in hs if h == h) and served == sum(h for h in hs if h == h) >= 1, (hs, served)


def _pulls(up) -> tuple[float, float, float]:
    """Summed over the decode workers: (bytes pulled, blocks pulled, blocks their prefix caches supplied)."""
    ws = up.workers("decode")
    return tuple(sum(metric(w["metrics_port"], name) for w in ws)
                 for name in ("pdserve_kv_transfer_bytes_total", "pdserve_kv_pull_blocks_total",
                              "pdserve_kv_pull_reused_blocks_total"))


def test_next_turn_pulls_only_the_missing_blocks(up, tiny_llama):
    """A chat's next turn: the decode worker already holds the last turn (prompt + answer) in its prefix cache, so it
    pulls only the blocks after it, and the tokens are still the offline engine's."""
    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.sampling_params import SamplingParams
    bs = 16  # the engine's default block size (EngineConfig)
    turn1 = [(13 * i) % 250 + 3 for i in range(70)]

    def ask(prompt):
        r = httpx.post(up.base_url + "/v1/completions", timeout=30, json={
            "model": "ck", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    b0 = _pulls(up)
    answer = ask(turn1)
    b1 = _pulls(up)
    cold = (b1[0] - b0[0], b1[1] - b0[1], b1[2] - b0[2])  # a new prompt: every block pulled
    assert cold[1:] == (-(-len(turn1) // bs), 0), cold
    per_block = cold[0] / cold[1]
    # The next turn (a new message each try). Its decode worker holds turn 1's prompt and answer but the last
    # answer token (sampled, never fed back): 81 tokens, 5 full blocks; a hit never covers the block with the
    # prompt's last token. The other decode worker (the router breaks near-equal ties at random, and over this
    # memcpy link a few blocks are a near-tie) holds nothing of it, until a try lands there: it then holds the
    # pulled prompt, which shares the same 5 blocks with the next try, so at most two tries are needed.
    held = (len(turn1) + len(answer) - 1) // bs
    eng = Engine.from_pretrained(str(tiny_llama), EngineConfig(num_gpu_blocks=64))
    for k in range(2):
        turn2 = turn1 + answer + [(7 * i + k) % 250 + 3 for i in range(30)]
        b0 = _pulls(up)
        got = ask(turn2)
        b1 = _pulls(up)
        reused, pulled = b1[2] - b0[2], b1[1] - b0[1]
        want = eng.generate([turn2], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
        assert got == list(want.token_ids)
        assert reused + pulled == -(-len(turn2) // bs) == 7 and b1[0] - b0[0] == pulled * per_block
        if reused:
            break
    assert (reused, pulled) == (min(held, (len(turn2) - 1) // bs), 2) == (5, 2), (b0, b1)


def test_seeded_sampling_matches_offline_engine(up, offline_seeded):
    assert _common.seeded_ids(up) == offline_seeded


def test_openai_client(up):
    _common.check_openai_client(up)


def test_grpc_front_door(up):
    async def main():
        gw = up.process("gateway")
        stub = gateway_pb2_grpc.GatewayStub(channel(f"127.0.0.1:{gw['grpc_port']}"))
        toks, last = [], None
        async for m in stub.Generate(worker_pb2.GenerateRequest(
                prompt="the quick brown fox", params=params_to_pb(SamplingParams(temperature=0, max_tokens=12)))):
            for o in m.outputs:
                toks += list(o.token_ids)
            last = m
        return toks, last

    toks, last = asyncio.run(main())
    assert last.finished and last.state == "FINISHED" and last.usage.completion_tokens == len(toks) == 12


def test_disconnect_frees_blocks(up):
    _common.check_disconnect_frees_blocks(up)


def test_orphaned_prefill_blocks_freed_by_lease(up):
    """A Prefill whose KV nobody pulls (its gateway/decode died): the lease reaper frees the blocks."""
    pw = up.workers("prefill")[0]

    async def prefill():
        stub = worker_pb2_grpc.WorkerStub(channel(f"127.0.0.1:{pw['port']}"))
        return await stub.Prefill(worker_pb2.PrefillRequest(
            request_id="orphan-1", prompt_token_ids=list(range(2, 60)),
            params=params_to_pb(SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))),
            metadata=up.grpc_metadata())

    r = asyncio.run(prefill())
    assert not r.finished and len(r.kv.block_ids) == 4 and r.kv.lease_expiry_unix > time.time()
    assert wait_until(lambda: metric(pw["metrics_port"], "pdserve_kv_blocks_in_use") >= 4, 5)
    assert wait_until(lambda: metric(pw["metrics_port"], "pdserve_kv_blocks_in_use") == 0, 15)
    assert metric(pw["metrics_port"], "pdserve_kv_leases_expired_total") >= 1


def test_kill_decode_worker_mid_stream(up):
    """kill -9 of the decode worker serving a stream: the stream migrates to the surviving decode worker and ends
    with [DONE] (docs/reliability.md, Mid-stream migration; the output's equality with an uninterrupted run is
    tests/e2e/test_migration.py's), the gateway stays up, new requests go to the surviving decode worker."""
    decs = up.workers("decode")

    # The debug header names the decode worker. The first token comes from the Prefill reply (before the decode
    # worker is even called, so killing it then only reroutes the pickup); killing it at the third token-bearing
    # event hits a stream the decode worker is serving, and leaves no race with a stream that could finish first
    # (500 tokens take far longer than one kill).
    body = {"model": "ck", "prompt": "pack my box", "max_tokens": 500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    victim = None
    events = []
    with httpx.stream("POST", up.base_url + "/v1/completions", json=body, timeout=60,
                      headers={"x-pdserve-debug": "route"}) as r:
        route = dict(kv.split("=", 1) for kv in r.headers["x-pdserve-route"].split(";"))
        assert route["mode"] == "disagg", route
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if victim is None and len(events) == 3:
                victim = next(w for w in decs if w["worker_id"] == route["decode"])
                os.kill(victim["pid"], signal.SIGKILL)
    assert victim is not None
    assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-3:]
    assert metric(up.port, "pdserve_migrations_total", '{reason="unavailable"}') >= 1
    # the gateway is up and routes around the dead worker (before and after its registry entry lapses)
    survivor = next(w for w in decs if w is not victim)
    for _ in range(4):
        r = httpx.post(up.base_url + "/v1/completions", json={"model": "ck", "prompt": "judge my vow",
                                                              "max_tokens": 4, "temperature": 0}, timeout=30)
        assert r.status_code == 200, r.text
    assert httpx.get(up.base_url + "/health", timeout=5).status_code == 200
    assert metric(survivor["metrics_port"], "pdserve_engine_requests_terminal_total", '{state="FINISHED"}') >= 1
    # the prefill side holds nothing for the dead worker's requests (released after the pull, or by lease)
    pw = up.workers("prefill")[0]
    assert wait_until(lambda: metric(pw["metrics_port"], "pdserve_kv_blocks_in_use") == 0, 15)


def test_stage_times(up):
    _common.check_stage_times(up)


def test_echo_prompt_logprobs(up, tiny_llama):
    _common.check_echo(up, tiny_llama)


def test_worker_refusal_names_the_field(up):
    _common.check_worker_refusal_names_the_field(up)


def test_n_branches_share_one_prefill(up, tiny_llama):
    _common.check_n_branches(up, tiny_llama)


def test_each_answer_says_the_kv_it_moved(up):
    """The KV a request pulled, on the answer (x-pdserve-kv-bytes / -transfer-ms on a whole answer, usage.kv_transfer
    on both forms), equals what the decode workers counted for that request, per prefill peer too."""
    import json
    decs, pw = up.workers("decode"), up.workers("prefill")[0]

    def pulled() -> float:
        got = []
        for w in decs:
            try:
                got.append(metric(w["metrics_port"], "pdserve_kv_pair_transfer_bytes_sum",
                                  f'{{peer="{pw["worker_id"]}"}}'))
            except OSError:  # the worker test_kill_decode_worker_mid_stream killed (no restart here)
                pass
        return sum(x for x in got if x == x)  # NaN: a decode worker that has not pulled yet

    b0 = pulled()
    body = {"model": "ck", "prompt": "sphinx of black quartz " * 8, "max_tokens": 3, "temperature": 0}
    r = httpx.post(up.base_url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.headers["x-pdserve-path"].startswith("disagg"), r.text
    moved = pulled() - b0
    assert int(r.headers["x-pdserve-kv-bytes"]) == moved > 0
    kv = r.json()["usage"]["kv_transfer"]
    assert kv["bytes"] == moved and kv["pulls"] == 1
    assert abs(float(r.headers["x-pdserve-kv-transfer-ms"]) - kv["seconds"] * 1e3) < 0.01
    b1, usage = pulled(), None
    with httpx.stream("POST", up.base_url + "/v1/completions", timeout=30, json={
            **body, "prompt": "how vexingly quick daft zebras jump " * 6, "stream": True,
            "stream_options": {"include_usage": True}}) as s:
        assert "x-pdserve-kv-bytes" not in s.headers  # sent before the pull: the usage chunk says it
        for line in s.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("usage"):
                usage = json.loads(line[6:])["usage"]
    assert usage["kv_transfer"]["bytes"] == pulled() - b1 > 0
