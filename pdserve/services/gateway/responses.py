"""OpenAI response bodies (completions and chat, whole or as server-sent events) from the handler's one consumer.

Both renderings read the same `Delta`s from `RequestHandler.consume`; neither counts tokens or ends the request
itself. A failure is rendered by the caller of `collect` (an error reply) or inside `stream` (an error event and
no `[DONE]`), from the handler's `fail`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import AsyncIterator

from pdserve.services.gateway.errors import RequestFailed
from pdserve.services.gateway.handler import RequestHandler
from pdserve.services.gateway.schema import FINISH_REASONS, RequestState


@dataclass
class OpenAIForm:
    """How the client asked to see the answer (the OpenAI body's presentation fields)."""
    model: str  # the served model name
    chat: bool
    return_token_ids: bool = False  # extension (vLLM-style): exact ids, for clients that detokenize
    include_usage: bool = False  # stream_options.include_usage


def sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def choice_logprobs(chat: bool, lps: list) -> dict:
    if chat:
        return {"content": [{"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token.encode()),
                             "top_logprobs": [{"token": t.token, "logprob": t.logprob,
                                               "bytes": list(t.token.encode())} for t in lp.top]}
                            for lp in lps]}
    return {"tokens": [lp.token for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{t.token: t.logprob for t in lp.top} for lp in lps], "text_offset": []}


def usage(handler: RequestHandler, st: RequestState) -> dict:
    pt, ct = st.prompt_tokens, st.completion_tokens
    u = {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct,
         "prompt_tokens_details": {"cached_tokens": st.cached_tokens}}
    times = handler.stage_times(st)
    if times is not None:
        u["stage_times"] = times
    return u


def _base(form: OpenAIForm, st: RequestState, obj: str) -> dict:
    return {"id": st.rid, "object": obj, "created": st.created, "model": form.model}


async def collect(handler: RequestHandler, st: RequestState, form: OpenAIForm) -> dict:
    """The whole answer's body. Raises what `consume` raises (the caller renders it with `fail`)."""
    chat = form.chat
    n = st.n_choices
    texts = [""] * n
    ids: list[list[int]] = [[] for _ in range(n)]
    lps: list[list] = [[] for _ in range(n)]
    async for d in handler.consume(st):
        for o in d.msg.outputs:
            texts[o.index] += o.text
            ids[o.index].extend(o.token_ids)
            lps[o.index].extend(o.logprobs)
    want_lp = st.call.params.logprobs is not None
    choices = []
    for i, t in enumerate(texts):
        c = {"index": i, "finish_reason": st.finish_reasons[i] or "stop",
             "logprobs": choice_logprobs(chat, lps[i]) if want_lp else None}
        if chat:
            c["message"] = {"role": "assistant", "content": t}
        else:
            c["text"] = t
        if form.return_token_ids:
            c["token_ids"] = ids[i]
        choices.append(c)
    out = {**_base(form, st, "chat.completion" if chat else "text_completion"), "choices": choices,
           "usage": usage(handler, st)}
    if st.degraded is not None:  # DEGRADED: fewer choices than asked, in the body and the x-pdserve-degraded header
        out["pdserve"] = {"degraded": st.degraded.to_json()}
    return out


async def stream(handler: RequestHandler, st: RequestState, form: OpenAIForm) -> AsyncIterator[bytes]:
    """Server-sent events, ending with `[DONE]` or, if the request fails on the way, with one error event.
    A client that leaves mid-stream leaves this generator unfinished: the caller's `cancel` ends the request."""
    chat = form.chat
    base = _base(form, st, "chat.completion.chunk" if chat else "text_completion")
    want_lp = st.call.params.logprobs is not None
    try:
        if st.degraded is not None:
            yield sse({**base, "choices": [], "pdserve": {"degraded": st.degraded.to_json()}})
        if chat:
            yield sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None} for i in range(st.n_choices)]})
        async for d in handler.consume(st):
            choices = []
            for o in d.msg.outputs:
                fr = FINISH_REASONS.get(o.finish_reason, "stop") if o.finish_reason else None
                if not o.text and not o.token_ids and fr is None:
                    continue
                c = {"index": o.index, "finish_reason": fr,
                     "logprobs": choice_logprobs(chat, list(o.logprobs)) if want_lp and o.logprobs else None}
                if chat:
                    c["delta"] = {"content": o.text} if o.text or fr is None else {}
                else:
                    c["text"] = o.text
                choices.append(c)
            if choices:
                yield sse({**base, "choices": choices})
    except Exception as e:  # noqa: BLE001 - every failure ends the stream with its error event
        reply = await handler.fail(st.rec, e)
        body = reply.body()
        if isinstance(e, RequestFailed):  # the request failed or timed out mid-stream
            body["error"]["code"] = e.state.lower()
        yield sse(body)
        return
    if form.include_usage:
        yield sse({**base, "choices": [], "usage": usage(handler, st)})
    yield b"data: [DONE]\n\n"
