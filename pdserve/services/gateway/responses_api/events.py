"""A streamed chat completion's chunks -> the Responses API's typed events.

`response.created`, `response.in_progress`, then per output item `response.output_item.added`; a message's text as
`response.content_part.added`, `response.output_text.delta`..., `response.output_text.done`,
`response.content_part.done`; a function call's arguments as `response.function_call_arguments.delta`...,
`.done`; each item ends with `response.output_item.done`; the stream with `response.completed` (or
`response.incomplete` when cut at max_output_tokens, `response.failed` when the request failed), carrying the
whole Response and its usage. Every event has its `sequence_number`; each goes out as `event: <type>` + `data:`.
"""
from __future__ import annotations

import contextlib
import json
from typing import AsyncIterator, Awaitable, Callable

from pdserve.services.gateway.responses_api.output import (
    call_item,
    finished,
    item_id,
    message_item,
    skeleton,
    text_part,
)


class EventWriter:
    """The events of one response, from its chat chunks in order."""

    def __init__(self, rid: str, created: int, model: str, settings: dict):
        self.resp = skeleton(rid, created, model, settings)
        self.seq = 0
        self.open: dict | None = None  # the output item being written
        self.finish_reason: str | None = None
        self.usage: dict | None = None

    def _event(self, kind: str, **fields) -> bytes:
        body = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n".encode()

    def start(self) -> list[bytes]:
        return [self._event("response.created", response=self.resp),
                self._event("response.in_progress", response=self.resp)]

    def _add(self, item: dict) -> list[bytes]:
        self.open = item
        self.resp["output"].append(item)
        return [self._event("response.output_item.added", output_index=len(self.resp["output"]) - 1,
                            item={**item, "content": []} if item["type"] == "message" else dict(item))]

    def text(self, delta: str) -> list[bytes]:
        out = [] if self.open is not None and self.open["type"] == "message" else self._open_message()
        self.open["content"][0]["text"] += delta
        out.append(self._event("response.output_text.delta", item_id=self.open["id"],
                               output_index=len(self.resp["output"]) - 1, content_index=0, delta=delta,
                               logprobs=[]))
        return out

    def _open_message(self) -> list[bytes]:
        out = self.close() + self._add(message_item(item_id("msg"), "", "in_progress"))
        return out + [self._event("response.content_part.added", item_id=self.open["id"],
                                  output_index=len(self.resp["output"]) - 1, content_index=0, part=text_part(""))]

    def call(self, tc: dict) -> list[bytes]:
        """One chat `tool_calls` delta: a new call (it has an id) opens an item, arguments extend it."""
        out = []
        f = tc.get("function") or {}
        if tc.get("id"):
            out += self.close()
            out += self._add(call_item(item_id("fc"), tc["id"], f.get("name") or "", "", "in_progress"))
        args = f.get("arguments")
        if args and self.open is not None and self.open["type"] == "function_call":
            self.open["arguments"] += args
            out.append(self._event("response.function_call_arguments.delta", item_id=self.open["id"],
                                   output_index=len(self.resp["output"]) - 1, delta=args))
        return out

    def close(self) -> list[bytes]:
        """The open item's closing events."""
        item, self.open = self.open, None
        if item is None:
            return []
        at = len(self.resp["output"]) - 1
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            item["status"] = "incomplete" if self.finish_reason == "length" else "completed"
            out += [self._event("response.output_text.done", item_id=item["id"], output_index=at, content_index=0,
                                text=part["text"], logprobs=[]),
                    self._event("response.content_part.done", item_id=item["id"], output_index=at, content_index=0,
                                part=part)]
        else:
            item["status"] = "completed"
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                                   name=item["name"], arguments=item["arguments"]))
        out.append(self._event("response.output_item.done", output_index=at, item=item))
        return out

    def chunk(self, c: dict) -> list[bytes]:
        """One chat chunk (its one choice, or the usage chunk at the end)."""
        if c.get("usage") is not None:
            self.usage = c["usage"]
        out = []
        for ch in c.get("choices") or []:
            d = ch.get("delta") or {}
            if d.get("content"):
                out += self.text(d["content"])
            for tc in d.get("tool_calls") or []:
                out += self.call(tc)
            if ch.get("finish_reason"):
                self.finish_reason = ch["finish_reason"]
        return out

    def end(self) -> list[bytes]:
        """The last item's closing events; the Response is finished (`final` sends it)."""
        # an empty answer is an empty message, as in the non-streamed one
        out = self._open_message() if not self.resp["output"] else []
        out += self.close()
        finished(self.resp, self.finish_reason, self.usage)
        return out

    def final(self) -> bytes:
        return self._event(f"response.{self.resp['status']}", response=self.resp)

    def failed(self, error: dict) -> list[bytes]:
        out = self.close()
        self.resp.update(status="failed", error={"code": error.get("code") or error.get("type") or "server_error",
                                                 "message": error.get("message") or ""})
        return out + [self._event("response.failed", response=self.resp)]


async def events(chunks: AsyncIterator[bytes], w: EventWriter,
                 keep: Callable[[dict], Awaitable[None]] | None = None) -> AsyncIterator[bytes]:
    """The chat stream's server-sent events (`responses.stream`: one `data:` event per item, `[DONE]` or an
    error event last) rewritten; `keep` stores the finished Response before its last event. Closing this closes
    `chunks`."""
    async with contextlib.aclosing(chunks):
        for e in w.start():
            yield e
        async for raw in chunks:
            data = raw.decode()[len("data: "):].strip()
            if data == "[DONE]":
                break
            c = json.loads(data)
            out = w.failed(c["error"]) if "error" in c else w.chunk(c)
            for e in out:
                yield e
            if "error" in c:
                return
        for e in w.end():
            yield e
        if keep is not None:
            await keep(w.resp)
        yield w.final()
