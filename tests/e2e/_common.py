"""Checks shared by the disagg and colocated modules (each runs them against its own deployment)."""
from __future__ import annotations

import concurrent.futures as cf
import json
import time

import httpx
import openai

from tests.e2e.conftest import PROMPTS, SEEDED, metric, wait_until


def check_greedy_batch(up, offline_greedy):
    def one(p):
        r = httpx.post(up.base_url + "/v1/completions", json={"model": "ck", "prompt": p, "max_tokens": 12,
                                                              "temperature": 0, "return_token_ids": True}, timeout=30)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return c["token_ids"], c["text"]

    with cf.ThreadPoolExecutor(len(PROMPTS)) as ex:  # concurrently: they batch on the workers
        got = [tuple(x) for x in ex.map(one, PROMPTS)]
    offline_greedy = [tuple(x) for x in offline_greedy]
    assert got == offline_greedy, (got, offline_greedy)
    # gateway latency histograms carry the router's decision (observed as each response completes, which may
    # trail the client's read of the body by a moment)
    mode = up.info["mode"]
    assert wait_until(lambda: metric(up.port, "pdserve_ttft_seconds_count", f'{{mode="{mode}"}}') >= len(PROMPTS), 5)
    assert wait_until(lambda: metric(up.port, "pdserve_tpot_seconds_count", f'{{mode="{mode}"}}') >= len(PROMPTS), 5)


def check_openai_client(up):
    c = openai.OpenAI(base_url=up.base_url + "/v1", api_key="unused", max_retries=0, timeout=30)
    assert [m.id for m in c.models.list().data] == ["ck"]
    r = c.completions.create(model="ck", prompt="the quick brown fox", max_tokens=5, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens <= 5
    text = r.choices[0].text
    chunks = list(c.completions.create(model="ck", prompt="the quick brown fox", max_tokens=5, temperature=0,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
    msgs = [{"role": "user", "content": "judge my vow"}]
    r = c.chat.completions.create(model="ck", messages=msgs, max_tokens=6, temperature=0)
    assert r.choices[0].message.role == "assistant"
    chat_text = r.choices[0].message.content
    s = c.chat.completions.create(model="ck", messages=msgs, max_tokens=6, temperature=0, stream=True,
                                  stream_options={"include_usage": True})
    parts, usage = [], None
    for ch in s:
        if ch.choices:
            parts.append(ch.choices[0].delta.content or "")
        if ch.usage:
            usage = ch.usage
    assert "".join(parts) == chat_text
    assert usage is not None and usage.completion_tokens == r.usage.completion_tokens
    # the Responses API is the same chat completion (gateway/responses_api/), in this serving mode too
    resp = c.responses.create(model="ck", input="judge my vow", max_output_tokens=6, temperature=0)
    assert resp.output_text == chat_text and resp.usage.output_tokens == r.usage.completion_tokens
    events = list(c.responses.create(model="ck", input="judge my vow", max_output_tokens=6, temperature=0,
                                     stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == chat_text
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.usage.input_tokens == r.usage.prompt_tokens
    # logprobs, both APIs
    r = c.completions.create(model="ck", prompt="the quick brown fox", max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == r.usage.completion_tokens and all(len(t) == 2 for t in lp.top_logprobs)
    r = c.chat.completions.create(model="ck", messages=msgs, max_tokens=3, temperature=0, logprobs=True,
                                  top_logprobs=2)
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in r.choices[0].logprobs.content)
    # n > 1 with a seed: n choices, reproducible
    a = c.completions.create(model="ck", prompt="judge my vow", max_tokens=4, n=2, seed=5, temperature=1.0)
    b = c.completions.create(model="ck", prompt="judge my vow", max_tokens=4, n=2, seed=5, temperature=1.0)
    assert [x.index for x in a.choices] == [0, 1] and [x.text for x in a.choices] == [x.text for x in b.choices]
    # errors: 400 naming the field, 404 unknown model
    try:
        c.completions.create(model="ck", prompt="x", temperature=-1)
        raise AssertionError("expected 400")
    except openai.BadRequestError as e:
        assert e.body["param"] == "temperature"
    try:
        c.completions.create(model="nope", prompt="x")
        raise AssertionError("expected 404")
    except openai.NotFoundError:
        pass


def check_disconnect_frees_blocks(up):
    """Abort mid-stream: every worker's pdserve_kv_blocks_in_use returns to 0."""
    body = {"model": "ck", "prompt": "the quick brown fox", "max_tokens": 300, "temperature": 0,
            "ignore_eos": True, "stream": True}
    for _ in range(2):
        with httpx.stream("POST", up.base_url + "/v1/completions", json=body, timeout=30) as r:
            n = 0
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    n += 1
                    if n == 3:
                        break  # leaving the context manager closes the connection mid-stream
            assert n == 3
    for w in up.workers():
        assert wait_until(lambda: metric(w["metrics_port"], "pdserve_kv_blocks_in_use") == 0, 15), \
            f"{w['name']} still holds blocks"
    # the cancellation reached the engine (not just a finished request)
    assert any(metric(w["metrics_port"], "pdserve_engine_requests_terminal_total", '{state="CANCELLED"}') >= 1
               for w in up.workers())


def seeded_ids(up):
    r = httpx.post(up.base_url + "/v1/completions", json={"model": "ck", "prompt": PROMPTS[0], **SEEDED,
                                                          "return_token_ids": True}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


# stage_times (docs/services.md "Stage times"): the chain every served request must follow, in order
_CHAIN = ("arrival", "admitted", "routed", "worker_arrival", "first_scheduled", "first_token")
_DISAGG_CHAIN = ("decode_arrival", "kv_transfer_start", "kv_transfer_end")
SUM_TOL_S = 1e-4  # durations are differences of the same timestamps: only float rounding (~1e-6 s) may differ


def _check_stage_times(st: dict, mode: str, t_before: float, t_after: float) -> None:
    # disagg: the first token is emitted from the Prefill reply, so the decode side's pickup (decode_arrival,
    # kv_transfer_*) runs in parallel with first_emit and is only bounded by first_token and last_emit
    chain = [*_CHAIN, "first_emit", "last_emit"]
    if mode == "disagg":
        pickup = ["first_token", *_DISAGG_CHAIN, "last_emit"]
        for ka, kb in zip(pickup, pickup[1:]):
            assert st[ka] is not None and st[kb] is not None and st[ka] <= st[kb], f"{ka}={st[ka]} > {kb}={st[kb]}"
        assert st["kv_on_ttft_path"] is False  # the first token did not wait for the transfer
    vals = [st[k] for k in chain]
    assert all(v is not None for v in vals), {k: st[k] for k in chain}  # complete
    # monotone across three or four processes' clocks (same host: one CLOCK_REALTIME)
    for (ka, a), (kb, b) in zip(zip(chain, vals), zip(chain[1:], vals[1:])):
        assert a <= b, f"{ka}={a} > {kb}={b}"
    assert t_before <= st["arrival"] and st["last_emit"] <= t_after  # inside the client's own request window
    assert st["first_token"] <= st["worker_finished"] <= st["last_emit"]
    if mode != "disagg":
        assert all(st[k] is None for k in _DISAGG_CHAIN)
    d = st["durations"]
    on_path = ("handoff", "kv_transfer") if st["kv_on_ttft_path"] else ()
    parts = [d[k] for k in ("admission", "route", "dispatch", "queue", "prefill", *on_path, "first_emit", "decode")]
    assert d["handoff"] >= 0 and d["kv_transfer"] >= 0
    assert all(p is not None and p >= 0 for p in parts), d
    assert abs(sum(parts) - d["e2e"]) <= SUM_TOL_S, (sum(parts), d["e2e"])
    assert abs(d["e2e"] - (st["last_emit"] - st["arrival"])) <= SUM_TOL_S
    assert d["prefill"] > 0 and d["decode"] > 0  # real work was timed, not zero-filled
    if mode == "disagg":
        assert d["kv_transfer"] > 0
    assert st["mode"] == mode


def check_stage_times(up):
    """Asked for (`x-pdserve-debug: stage-times` or `return_stage_times`), the non-streaming body and the final
    include_usage chunk both carry complete, monotone stage_times; not asked for, neither carries any."""
    import time
    mode = up.info["mode"]
    body = {"model": "ck", "prompt": "pack my box with five dozen", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    r = httpx.post(up.base_url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and "stage_times" not in r.json()["usage"], r.text
    t0 = time.time()
    r = httpx.post(up.base_url + "/v1/completions", json=body, timeout=30, headers={"x-pdserve-debug": "stage-times"})
    t1 = time.time()
    assert r.status_code == 200, r.text
    _check_stage_times(r.json()["usage"]["stage_times"], mode, t0, t1)
    usage = None
    t0 = time.time()
    with httpx.stream("POST", up.base_url + "/v1/chat/completions", timeout=30, json={
            "model": "ck", "messages": [{"role": "user", "content": "judge my vow"}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "return_stage_times": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
    t1 = time.time()
    assert usage is not None
    _check_stage_times(usage["stage_times"], mode, t0, t1)


def check_echo(up, tiny_llama):
    """`echo` on /v1/completions, shaped like lm-eval-harness' loglikelihood requests (echo, max_tokens 0 or 1,
    logprobs 1): the prompt comes back as written, each prompt token with its log-prob given its prefix (the first
    null), equal to transformers' on the same checkpoint, its top-1 the model's argmax, and `text_offset` the
    characters before each token in the returned text."""
    import torch
    import transformers as tf

    from pdserve.engine.tokenizer import Tokenizer
    tok = Tokenizer(tiny_llama)
    text = "the quick brown fox jumps over the lazy dog"
    ids = tok.encode(text)
    hf = tf.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    for max_tokens in (0, 1):
        r = httpx.post(up.base_url + "/v1/completions", timeout=30, json={
            "model": "ck", "prompt": text, "echo": True, "max_tokens": max_tokens, "logprobs": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        c, u = body["choices"][0], body["usage"]
        assert u["completion_tokens"] == max_tokens and u["prompt_tokens"] == len(ids)
        lp = c["logprobs"]
        n = len(ids) + max_tokens
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
        assert c["text"].startswith(text) and (max_tokens or c["text"] == text)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for j in range(1, len(ids)):
            assert abs(lp["token_logprobs"][j] - ref[j - 1, ids[j]].item()) < 1e-4, j
            (best, best_lp), = lp["top_logprobs"][j].items()
            assert best == tok.decode([int(ref[j - 1].argmax())], skip_special_tokens=False)
            assert abs(best_lp - ref[j - 1].max().item()) < 1e-4
        # offsets: each token's text starts where the returned text has it
        offs = lp["text_offset"]
        assert offs == sorted(offs) and offs[0] == 0
        for j in range(len(ids)):
            piece = tok.decode([ids[j]])
            assert c["text"][offs[j]:offs[j] + len(piece)] == piece, (j, piece)
        if max_tokens:  # the sampled token continues the text right after the echoed prompt
            assert offs[-1] == len(text) and lp["token_logprobs"][-1] <= 0
            greedy = int(ref[len(ids) - 1].argmax())
            assert lp["tokens"][-1] == tok.decode([greedy], skip_special_tokens=False)
    # without echo, text_offset is filled too: offsets into the completion's own text
    r = httpx.post(up.base_url + "/v1/completions", timeout=30, json={
        "model": "ck", "prompt": text, "max_tokens": 5, "logprobs": 0, "temperature": 0, "ignore_eos": True})
    c = r.json()["choices"][0]
    offs = c["logprobs"]["text_offset"]
    assert len(offs) == 5 and offs[0] == 0 and offs == sorted(offs)
    for t, o in zip(c["logprobs"]["tokens"], offs):
        assert c["text"][o:o + len(t)] == t
    # refused shapes name the field
    for body in ({"echo": True, "stream": True}, {"max_tokens": 0}):
        r = httpx.post(up.base_url + "/v1/completions", timeout=30, json={"model": "ck", "prompt": text, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] in ("echo", "max_tokens"), r.text


def check_worker_refusal_names_the_field(up):
    """A schema only the worker's grammar compiler can refuse: 400 naming `response_format`, carried typed from
    the worker (its `pdserve-param` trailing metadata), not parsed out of the message."""
    schema = {"type": "object", "properties": {"a": {"$ref": "#/definitions/nope"}}}

    def counts() -> dict:
        def nan0(v):
            return 0.0 if v != v else v

        def worker_sum(name, labels):
            return sum(nan0(metric(w["metrics_port"], name, labels)) for w in _live_workers(up))
        return {"gw_terminal": nan0(metric(up.port, "pdserve_requests_terminal_total", '{state="REJECTED"}')),
                "gw_failed": nan0(metric(up.port, "pdserve_requests_terminal_total", '{state="FAILED"}')),
                "records": nan0(metric(up.port, "pdserve_usage_records_total", '{state="REJECTED"}')),
                "billed_prompt": nan0(metric(up.port, "pdserve_usage_tokens_total", '{kind="prompt"}')),
                "engine_terminal": nan0(worker_sum("pdserve_engine_requests_terminal_total", '{state="REJECTED"}')),
                "engine_entries": nan0(worker_sum("pdserve_request_state_entries_total", '{state="REJECTED"}'))}
    before = counts()
    # the worker's answer took 20-31 s on a loaded 2-core box (its grammar compile of this schema), so no 30 s cap
    t0 = time.monotonic()
    r = httpx.post(up.base_url + "/v1/completions", timeout=120, json={
        "model": "ck", "prompt": "x", "max_tokens": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
    print(f"refused schema answered in {time.monotonic() - t0:.2f} s")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("response_format", "invalid_parameter"), err
    # REJECTED, not FAILED, and not billed: the same end as a refusal at the gateway, on both sides' metrics
    want = {"gw_terminal": 1, "gw_failed": 0, "records": 1, "billed_prompt": 0, "engine_terminal": 1,
            "engine_entries": 1}
    got: dict = {}
    assert wait_until(lambda: (got.update({k: v - before[k] for k, v in counts().items()}) or got) == want,
                      timeout=10), got


N_PROMPT = "seven wizards quietly hex every jolly sphinx of black quartz " * 6  # ~23 KV blocks
N_SAMPLED = dict(temperature=1.0, seed=4242, ignore_eos=True)


def _blocks_in_use(up, w) -> int:
    """Exactly what the worker's engine holds now (the GetStats RPC runs on its engine thread)."""
    import grpc

    from pdserve.services.pb import worker_pb2, worker_pb2_grpc
    with grpc.insecure_channel(f"127.0.0.1:{w['port']}") as ch:
        st = worker_pb2_grpc.WorkerStub(ch).GetStats(worker_pb2.GetStatsRequest(), metadata=up.grpc_metadata(),
                                                     timeout=10)
    return st.load.kv_blocks_in_use


def _live_workers(up) -> list[dict]:
    """The deployment's workers whose process runs (an earlier test of the module may have killed one). Judged by
    the process, not by one RPC: on a loaded box a live worker's GetStats can fail once, and a live worker left out
    made the checks below vacuous (no blocks polled, no lookups counted)."""
    def running(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a killed, unreaped child is Z
        except (FileNotFoundError, ProcessLookupError):
            return False
    return [w for w in up.workers() if running(w["pid"])]


def _prompt_lookups(workers) -> float:
    """Prompt tokens the workers' engines looked up to allocate a sequence's prompt (a forked branch looks
    nothing up: it shares its parent's blocks)."""
    return sum(metric(w["metrics_port"], "pdserve_prefix_cache_queries_total") for w in workers)


def check_n_branches(up, tiny_llama):
    """Served n=3 (seeded) is one engine request with three copy-on-write branches: the prompt is allocated once
    per engine it passes through (one prefill; disaggregated: one decode-side allocation, one transfer), the
    branches share its KV while they run, and each branch's tokens equal the offline engine's n=3 branches with
    the same seed. best_of=3, n=1 returns the branch of highest cumulative logprob; streaming it is a 400."""
    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.sampling_params import SamplingParams
    from tests.e2e.conftest import NUM_BLOCKS
    eng = Engine.from_pretrained(str(tiny_llama), EngineConfig(num_gpu_blocks=NUM_BLOCKS))
    prompt_ids = eng.tokenizer.encode(N_PROMPT)
    ref = eng.generate([prompt_ids], SamplingParams(n=3, max_tokens=8, **N_SAMPLED))[0].outputs
    assert len({tuple(c.token_ids) for c in ref}) > 1  # the branches really differ

    def post(**body):
        return httpx.post(up.base_url + "/v1/completions", timeout=60, json={
            "model": "ck", "prompt": N_PROMPT, "return_token_ids": True, **N_SAMPLED, **body})

    workers = _live_workers(up)
    for w in workers:  # nothing else running: the lookup counters move for this request only
        assert wait_until(lambda: _blocks_in_use(up, w) == 0, 15)
    before = _prompt_lookups(workers)
    r = post(n=3, max_tokens=8)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in body["choices"]] == [c.token_ids for c in ref]
    assert body["usage"]["prompt_tokens"] == len(prompt_ids) and body["usage"]["completion_tokens"] == 24
    # one prompt allocation per engine it passed through (fanned out, it was three per engine): one worker, or a
    # prefill and a decode worker (the router may also serve a request whole on one worker in disagg mode). The
    # exporter refreshes from engine snapshots.
    assert wait_until(lambda: _prompt_lookups(workers) - before in (len(prompt_ids), 2 * len(prompt_ids)), 10), \
        (_prompt_lookups(workers) - before, len(prompt_ids))
    # streamed, each branch's deltas (disagg: its first token from the Prefill reply, the rest from the decode
    # stream, never twice) add up to the same text
    texts = ["", "", ""]
    with httpx.stream("POST", up.base_url + "/v1/completions", timeout=60, json={
            "model": "ck", "prompt": N_PROMPT, "n": 3, "max_tokens": 8, "stream": True, **N_SAMPLED}) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] += c["text"]
    assert texts == [c["text"] for c in body["choices"]]

    # best_of=3, n=1: the offline n=3 branch of highest cumulative logprob (the engine's own choice is not the
    # reference: the test ranks the offline branches itself)
    best = max(ref, key=lambda c: c.cumulative_logprob)
    gen0 = metric(up.port, "pdserve_generation_tokens_total")
    committed0 = metric(up.port, "pdserve_usage_tokens_total", '{kind="committed"}')
    r = post(n=1, best_of=3, max_tokens=8)
    assert r.status_code == 200, r.text
    assert [c["token_ids"] for c in r.json()["choices"]] == [best.token_ids]
    assert r.json()["usage"]["completion_tokens"] == 8  # the returned choice, not the three sampled
    # the record: 24 tokens generated (three branches), 8 committed (billed with the prompt)
    assert wait_until(lambda: metric(up.port, "pdserve_generation_tokens_total") - gen0 == 24, 5), \
        metric(up.port, "pdserve_generation_tokens_total") - gen0
    assert metric(up.port, "pdserve_usage_tokens_total", '{kind="committed"}') - committed0 == 8
    r = post(n=1, best_of=3, max_tokens=8, stream=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of", r.text

    # while an n=3 request runs, the workers decoding it hold the prompt's blocks once, not three times: polled
    # (exactly, through each engine thread) for the request's whole life, the most they held at once is the
    # prompt's blocks plus each branch's own (its copied tail and its output), far below three prompts' worth.
    # The tiny model decodes 100 tokens in a few hundred ms: on a loaded box a poll may miss the whole request,
    # so the request is repeated (at most 5 times) until a poll saw it running; every poll is checked.
    import threading

    import grpc

    from pdserve.services.pb import worker_pb2, worker_pb2_grpc
    block_size, max_tokens = 16, 100
    prompt_blocks = -(-len(prompt_ids) // block_size)
    own = -(-(block_size + max_tokens) // block_size)  # a branch's blocks beyond the shared ones, at most
    decoders = [w for w in workers if w["role"] in ("decode", "both")]
    assert decoders, workers
    channels = [grpc.insecure_channel(f"127.0.0.1:{w['port']}") for w in decoders]  # one each: polls are fast
    stubs = [worker_pb2_grpc.WorkerStub(ch) for ch in channels]
    held: list[int] = []

    def poll(done: threading.Event) -> None:
        while not done.is_set():
            held.append(sum(s.GetStats(worker_pb2.GetStatsRequest(), metadata=up.grpc_metadata(),
                                       timeout=10).load.kv_blocks_in_use for s in stubs))

    try:
        for _ in range(5):
            done = threading.Event()
            t = threading.Thread(target=poll, args=(done,))
            t.start()
            try:
                r = post(n=3, max_tokens=max_tokens)
            finally:
                done.set()
                t.join()
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3 * max_tokens, r.text
            if max(held) >= prompt_blocks:  # a poll saw the request running
                break
    finally:
        for ch in channels:
            ch.close()
    assert max(held) >= prompt_blocks, (max(held), prompt_blocks, len(held))
    assert max(held) <= prompt_blocks + 3 * own < 3 * prompt_blocks, (max(held), prompt_blocks, own)
