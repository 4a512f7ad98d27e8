"""Big echo / log-probs answers: their volume is bounded with a 400 naming the field, they are
built one choice at a time without stalling the gateway's event loop, and the deadline covers building them.

Before: `echo: true, logprobs: 20, max_tokens: 0` over 300 prompts x 300 tokens with `timeout: 60` answered 200
after 63.1 s, and building the answer held the loop ~1.6 s per 100 prompts."""
from __future__ import annotations

import asyncio
import gc
import json
import time
from types import SimpleNamespace

import pytest

from pdserve.engine.checkpoint import resolve_model_dir
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.services.gateway import responses
from pdserve.services.gateway.errors import RequestFailed
from pdserve.services.gateway.params import DEFAULT_MAX_LOGPROB_ENTRIES, logprob_entries
from pdserve.services.gateway.schema import Delta
from pdserve.services.pb import common_pb2
from tests.services.gateway.test_hostile import Gateway


def test_logprob_entries_by_hand():
    prompts = [[1] * 10, [2] * 4]
    # output: n=2 choices x 5 tokens x (1 + 3) per prompt = 40, two prompts = 80
    assert logprob_entries(prompts, SamplingParams(n=2, max_tokens=5, logprobs=3), False, 100) == 80
    # + prompt tokens after the first: (9 + 3) x (1 + 3) x n=2 = 96
    assert logprob_entries(prompts, SamplingParams(n=2, max_tokens=5, logprobs=3, prompt_logprobs=3), False,
                           100) == 80 + 96
    # a prompt-only echo returns no output tokens; no max_tokens: the context left (100 - 10, 100 - 4)
    assert logprob_entries(prompts, SamplingParams(max_tokens=1, logprobs=0, prompt_logprobs=0), True, 100) == 12
    assert logprob_entries(prompts, SamplingParams(max_tokens=None, logprobs=0), False, 100) == 90 + 96
    assert logprob_entries(prompts, SamplingParams(max_tokens=5), False, 100) == 0  # no log-probs asked


@pytest.fixture(scope="module")
def gw():
    g = Gateway()
    yield g
    g.close()


def _post(gw, path: str, body: dict):
    return gw.post(path, json.dumps(body).encode())


def test_the_issue_reproduction_is_a_400_naming_logprobs(gw):
    body = {"model": "builtin", "prompt": [[5 + (i + j) % 200 for j in range(300)] for i in range(300)],
            "echo": True, "logprobs": 20, "max_tokens": 0, "timeout": 60}
    t0 = time.monotonic()
    r = _post(gw, "/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "logprobs" and err["code"] == "logprobs_too_large"
    assert "1,883,700" in err["message"] and "--max-logprob-entries" in err["message"]  # 300 x 299 x 21
    assert time.monotonic() - t0 < 5  # refused before anything is built (was: 200 after 63 s)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 20,
                              "n": 128, "max_tokens": 400}, "top_logprobs"),
    ("/v1/completions", {"prompt": [[7] * 400] * 128, "prompt_logprobs": 20, "max_tokens": 1}, "prompt_logprobs"),
])
def test_other_fields_that_make_an_answer_big_are_named(gw, path, body, param):
    r = _post(gw, path, {"model": "builtin", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_an_answer_under_the_limit_is_not_refused(gw):
    # 100 prompts x 100 tokens x 21 = 207,900 values: passes every check, then finds no worker (a closed router)
    body = {"model": "builtin", "prompt": [[9] * 100] * 100, "echo": True, "logprobs": 20, "max_tokens": 0}
    assert 100 * 99 * 21 < DEFAULT_MAX_LOGPROB_ENTRIES
    r = _post(gw, "/v1/completions", body)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_workers", r.text


def test_the_limit_is_a_flag():
    g = Gateway(max_logprob_entries=1000)
    try:
        r = _post(g, "/v1/completions", {"model": "builtin", "prompt": [[9] * 100] * 2, "echo": True, "logprobs": 5,
                                         "max_tokens": 0})
        assert r.status_code == 400 and "1,188" in r.json()["error"]["message"], r.text  # 2 x 99 x 6
    finally:
        g.close()


# ---- building the answer: a fake upstream of real messages, the real `collect` ----

CHOICES, TOKENS, TOP = 60, 300, 20


class FakeHandler:
    """What `collect` needs of the RequestHandler: the counted deltas, and `finish` (recorded)."""

    def __init__(self, msgs):
        self.msgs, self.finished = msgs, 0

    async def consume(self, st, finish: bool = True):
        assert not finish  # collect ends the request itself, once the body is built
        for m in self.msgs:
            yield Delta(0, m, 0)

    async def finish(self, st):
        self.finished += 1

    def stage_times(self, st):
        return None


def _big_answer(deadline: float | None):
    tok = Tokenizer(resolve_model_dir("builtin"))
    msgs = []
    for c in range(CHOICES):
        lps = [common_pb2.TokenLogprob(token_id=t % 200, token=f"t{t}", logprob=-0.5,
                                       top=[common_pb2.TopLogprob(token_id=k, token=f"k{k}", logprob=-1.0 - k)
                                            for k in range(TOP)]) for t in range(TOKENS)]
        msgs.append(common_pb2.GenerateResponse(outputs=[common_pb2.CompletionDelta(
            index=c, text="x" * TOKENS, token_ids=[t % 200 for t in range(TOKENS)], logprobs=lps,
            finish_reason="length")]))
    call = SimpleNamespace(prompts=[[1, 2, 3]], params=SamplingParams(max_tokens=TOKENS, logprobs=TOP),
                           prompt_only=False)
    st = SimpleNamespace(n_choices=CHOICES, call=call, rec=SimpleNamespace(deadline=deadline),
                         finish_reasons=["length"] * CHOICES, prompt_logprobs=[[] for _ in range(CHOICES)],
                         rid="cmpl-x", created=0, degraded=None, prompt_tokens=3, completion_tokens=CHOICES * TOKENS,
                         cached_tokens=0, traces=[])
    form = responses.OpenAIForm("builtin", chat=False, tokenizer=tok)
    return FakeHandler(msgs), st, form


async def _build_while_ticking(handler, st, form):
    """collect's result (or error) and the longest time the event loop went without running a 1 ms ticker."""
    gaps, stop = [], asyncio.Event()

    async def ticker():
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.001)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    # as the gateway does at start (procutil.freeze_startup_heap): a full collection of the test process's heap
    # would otherwise be the longest pause, whatever collect does
    gc.collect()
    gc.freeze()
    t = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    t0 = time.monotonic()
    try:
        out = await responses.collect(handler, st, form)
    except RequestFailed as e:
        out = e
    took = time.monotonic() - t0
    stop.set()
    await t
    gc.unfreeze()
    return out, took, max(gaps)


def test_a_big_answer_is_built_without_stalling_the_loop_and_is_valid_json():
    handler, st, form = _big_answer(deadline=None)
    st.rec.deadline = time.time() + 120
    out, took, worst_gap = asyncio.run(_build_while_ticking(handler, st, form))
    body = json.loads(out)
    assert [c["index"] for c in body["choices"]] == list(range(CHOICES))
    c = body["choices"][7]
    assert c["text"] == "x" * TOKENS and c["finish_reason"] == "length"
    assert len(c["logprobs"]["tokens"]) == TOKENS and len(c["logprobs"]["top_logprobs"][0]) == TOP
    assert c["logprobs"]["top_logprobs"][0]["k3"] == -4.0
    assert body["usage"]["completion_tokens"] == CHOICES * TOKENS and body["object"] == "text_completion"
    assert handler.finished == 1
    # one choice at a time: the loop waits at most about one choice's build, not the whole answer's (which was
    # one block before); the ratio holds on a slow or loaded machine alike
    assert worst_gap < took / 5, (worst_gap, took)


def test_the_deadline_covers_building_the_answer():
    handler, st, form = _big_answer(deadline=None)
    _, took, _ = asyncio.run(_build_while_ticking(handler, st, form))
    handler, st, form = _big_answer(deadline=None)
    st.rec.deadline = time.time() + took / 3  # passes part-way through the build
    out, took2, _ = asyncio.run(_build_while_ticking(handler, st, form))
    assert isinstance(out, RequestFailed) and out.state == "TIMED_OUT", out
    assert handler.finished == 0  # not FINISHED: the client gets a 504, and nothing is billed as delivered
    assert took2 < took
