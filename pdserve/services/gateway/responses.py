"""OpenAI response bodies (completions and chat, whole or as server-sent events) from the handler's one consumer.

Both renderings read the same `Delta`s from `RequestHandler.consume`; neither counts tokens or ends the request
itself. A failure is rendered by the caller of `collect` (an error reply) or inside `stream` (an error event and
no `[DONE]`), from the handler's `fail`.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import AsyncIterator

from pdserve.engine.tokenizer import Tokenizer
from pdserve.services.gateway.errors import RequestFailed
from pdserve.services.gateway.handler import RequestHandler, timed_out
from pdserve.services.gateway.schema import FINISH_REASONS, ActiveRequest
from pdserve.services.gateway.stages import kv_moved
from pdserve.services.gateway.tools.output import ToolOutput


@dataclass
class OpenAIForm:
    """How the client asked to see the answer (the OpenAI body's presentation fields)."""
    model: str  # the served model name
    chat: bool
    return_token_ids: bool = False  # extension (vLLM-style): exact ids, for clients that detokenize
    include_usage: bool = False  # stream_options.include_usage
    echo_prompts: list[str] | None = None  # completions `echo`: each prompt's text, prepended to its choices
    tokenizer: Tokenizer | None = None  # token texts for `text_offset` and the echoed prompt's first token
    tools: ToolOutput | None = None  # chat with tools (tool_choice other than none): choices are read for calls


def sse(obj) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def choice_logprobs(chat: bool, lps: list, offset: int = 0, tok: Tokenizer | None = None) -> dict:
    if chat:
        return {"content": [{"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token.encode()),
                             "top_logprobs": [{"token": t.token, "logprob": t.logprob,
                                               "bytes": list(t.token.encode())} for t in lp.top]}
                            for lp in lps]}
    return {"tokens": [lp.token for lp in lps], "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{t.token: t.logprob for t in lp.top} for lp in lps],
            "text_offset": text_offsets([lp.token_id for lp in lps], offset, tok)}


def text_offsets(ids: list[int], start: int, tok: Tokenizer | None) -> list[int]:
    """Each token's character offset in the returned text, from `start`: the running length of the tokens'
    texts as the answer's text is decoded (special tokens skipped), as vLLM computes it. A character split over
    several byte-level tokens counts at each piece, so offsets after one may run ahead of the text."""
    out, at = [], start
    for t in ids:
        out.append(at)
        at += len(tok.decode([t])) if tok is not None else 0
    return out


def echo_logprobs(prompt_ids: list[int], prompt_lps: list, answer: dict, tok: Tokenizer | None) -> dict:
    """The legacy completions' logprobs with `echo`: the prompt's tokens first (the first has no log-prob:
    null, as have its top_logprobs), then the answer's (`answer`'s offsets already start after the echoed
    prompt's text)."""
    first = tok.decode(prompt_ids[:1], skip_special_tokens=False) if tok is not None and prompt_ids else ""
    return {"tokens": [first] + [lp.token for lp in prompt_lps] + answer["tokens"],
            "token_logprobs": [None] + [lp.logprob for lp in prompt_lps] + answer["token_logprobs"],
            "top_logprobs": [None] + [{t.token: t.logprob for t in lp.top} for lp in prompt_lps]
            + answer["top_logprobs"],
            "text_offset": text_offsets(prompt_ids, 0, tok) + answer["text_offset"]}


def prompt_logprobs(lps: list) -> list:
    """The `prompt_logprobs` extension, as vLLM writes it: per prompt token a map token id -> {logprob,
    decoded_token} (the token itself and its top alternatives); the first token has none (null)."""
    out: list = [None]
    for lp in lps:
        entry = {str(t.token_id): {"logprob": t.logprob, "decoded_token": t.token} for t in lp.top}
        entry[str(lp.token_id)] = {"logprob": lp.logprob, "decoded_token": lp.token}
        out.append(entry)
    return out


def usage(handler: RequestHandler, st: ActiveRequest) -> dict:
    pt, ct = st.prompt_tokens, st.completion_tokens
    u = {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct,
         "prompt_tokens_details": {"cached_tokens": st.cached_tokens}}
    kv = kv_moved(st.traces)
    if kv is not None:  # disaggregated: the KV it moved (docs/routing.md, "Proof of the path")
        u["kv_transfer"] = kv.usage()
    times = handler.stage_times(st)
    if times is not None:
        u["stage_times"] = times
    return u


def _base(form: OpenAIForm, st: ActiveRequest, obj: str) -> dict:
    return {"id": st.rid, "object": obj, "created": st.created, "model": form.model}


async def collect(handler: RequestHandler, st: ActiveRequest, form: OpenAIForm) -> bytes:
    """The whole answer's JSON body. Raises what `consume` raises (the caller renders it with `fail`), and the
    deadline's TIMED_OUT while the body is still being built: a big answer (echo, log-probs; bounded by
    `--max-logprob-entries`) is built and serialized one choice at a time, yielding to the event loop between
    choices, and it ends FINISHED only once it is built."""
    chat = form.chat
    n = st.n_choices
    texts = [""] * n
    ids: list[list[int]] = [[] for _ in range(n)]
    lps: list[list] = [[] for _ in range(n)]
    async for d in handler.consume(st, finish=False):
        for o in d.msg.outputs:
            texts[o.index] += o.text
            ids[o.index].extend(o.token_ids)
            lps[o.index].extend(o.logprobs)
    if st.call.prompt_only:  # echo with max_tokens 0: the sampled token is not part of the answer
        texts, ids, lps = [""] * n, [[] for _ in range(n)], [[] for _ in range(n)]
    parts = []
    for i in range(n):
        await _on_time(st.rec.deadline)
        parts.append(json.dumps(_choice(st, form, i, texts[i], ids[i], lps[i])))
    await _on_time(st.rec.deadline)
    await handler.finish(st)
    out = {**_base(form, st, "chat.completion" if chat else "text_completion"), "choices": None,
           "usage": usage(handler, st)}
    if st.degraded is not None:  # DEGRADED: fewer choices than asked, in the body and the x-pdserve-degraded header
        out["pdserve"] = {"degraded": st.degraded.to_json()}
    # the choices go in as serialized: `"choices": null` can only be the key (a string's quotes are escaped)
    head, tail = json.dumps(out).split('"choices": null', 1)
    return "".join((head, '"choices": [', ", ".join(parts), "]", tail)).encode()


async def _on_time(deadline: float | None) -> None:
    """Between two pieces of a big answer: let the event loop serve others, and stop at the deadline."""
    await asyncio.sleep(0)
    if deadline is not None and time.time() >= deadline:
        raise timed_out()


def _choice(st: ActiveRequest, form: OpenAIForm, i: int, t: str, ids: list[int], lps: list) -> dict:
    chat = form.chat
    want_lp = st.call.params.logprobs is not None
    per_prompt = st.n_choices // len(st.call.prompts)
    echoed = form.echo_prompts[i // per_prompt] if form.echo_prompts is not None else ""
    c = {"index": i, "finish_reason": st.finish_reasons[i] or "stop",
         "logprobs": choice_logprobs(chat, lps, len(echoed), form.tokenizer) if want_lp else None}
    if form.echo_prompts is not None:
        if want_lp:
            c["logprobs"] = echo_logprobs(st.call.prompts[i // per_prompt], st.prompt_logprobs[i], c["logprobs"],
                                          form.tokenizer)
        t = echoed + t
    if chat and form.tools is not None:
        c["message"], called = form.tools.message(t, c["finish_reason"])
        if called and c["finish_reason"] == "stop":
            c["finish_reason"] = "tool_calls"
    elif chat:
        c["message"] = {"role": "assistant", "content": t}
    else:
        c["text"] = t
    if form.echo_prompts is None and st.call.params.prompt_logprobs is not None:
        c["prompt_logprobs"] = prompt_logprobs(st.prompt_logprobs[i])
    if form.return_token_ids:
        c["token_ids"] = ids
    return c


async def stream(handler: RequestHandler, st: ActiveRequest, form: OpenAIForm) -> AsyncIterator[bytes]:
    """Server-sent events, ending with `[DONE]` or, if the request fails on the way, with one error event.
    A client that leaves mid-stream leaves this generator unfinished: the caller's `cancel` ends the request."""
    chat = form.chat
    base = _base(form, st, "chat.completion.chunk" if chat else "text_completion")
    want_lp = st.call.params.logprobs is not None
    chars = [0] * st.n_choices  # each choice's text so far: where its next tokens' text_offset starts
    streamers = [form.tools.streamer() for _ in range(st.n_choices)] if chat and form.tools is not None else None
    try:
        if st.degraded is not None:
            yield sse({**base, "choices": [], "pdserve": {"degraded": st.degraded.to_json()}})
        if chat:  # one choice per chunk, as OpenAI streams `n` > 1
            for i in range(st.n_choices):
                yield sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                "logprobs": None, "finish_reason": None}]})
        async for d in handler.consume(st):
            for o in d.msg.outputs:
                fr = FINISH_REASONS.get(o.finish_reason, "stop") if o.finish_reason else None
                if not o.text and not o.token_ids and fr is None:
                    continue
                c = {"index": o.index, "finish_reason": fr,
                     "logprobs": choice_logprobs(chat, list(o.logprobs), chars[o.index], form.tokenizer)
                     if want_lp and o.logprobs else None}
                chars[o.index] += len(o.text)
                if streamers is not None:  # content up to a call, then the calls as tool_calls deltas
                    text, calls = streamers[o.index].feed(o.text)
                    if fr is not None:
                        rest, more = streamers[o.index].finish(fr)
                        text, calls = text + rest, calls + more
                        fr = "tool_calls" if streamers[o.index].called and fr == "stop" else fr
                        c["finish_reason"] = fr
                    if calls and text:  # the text before the calls goes first
                        yield sse({**base, "choices": [{"index": o.index, "delta": {"content": text},
                                                        "logprobs": None, "finish_reason": None}]})
                        text = ""
                    for tc in calls:  # one chunk per delta: id + name, then the arguments
                        yield sse({**base, "choices": [{"index": o.index, "delta": {"tool_calls": [tc]},
                                                        "logprobs": None, "finish_reason": None}]})
                    c["delta"] = {"content": text} if text else {}
                    if not text and fr is None and c["logprobs"] is None:
                        continue
                elif chat:
                    c["delta"] = {"content": o.text} if o.text or fr is None else {}
                else:
                    c["text"] = o.text
                yield sse({**base, "choices": [c]})
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
