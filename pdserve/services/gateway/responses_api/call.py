"""One `/v1/responses` request on the chat completions path: what app.py's `_endpoint` asks of it.

`chat_body` translates the body (request.py; with `previous_response_id`, after the stored conversation,
store.py), `renaming` puts the Responses field names on the chat checks' errors, and `collect` / `stream` rewrite
the chat answer the handler produced (output.py, events.py), storing the conversation unless `store: false`.
"""
from __future__ import annotations

import json
from typing import AsyncIterator, Awaitable, Callable

from pdserve.services.gateway.params import APIError, bad
from pdserve.services.gateway.responses_api.events import EventWriter, events
from pdserve.services.gateway.responses_api.fields import check_known
from pdserve.services.gateway.responses_api.output import echo, from_chat
from pdserve.services.gateway.responses_api.request import input_items, rename, to_chat
from pdserve.services.gateway.responses_api.store import ResponseStore
from pdserve.services.gateway.schema import ActiveRequest


class ResponsesCall:
    def __init__(self, model: str, store: ResponseStore | None = None):
        self.model = model  # the served model name
        self.store = store  # None: no Redis, nothing is stored
        self.rec = None  # the request's record (its tenant, once authorized): set by the front door
        self.where: list[str] | None = None  # set once translated: the chat checks' errors are renamed from then
        self.settings: dict = {}
        self.history: list[dict] = []  # the conversation before the answer: earlier items, this input
        self.keeping = False

    async def chat_body(self, body: dict) -> dict:
        check_known(body)
        earlier: list[dict] = []
        prev = body.get("previous_response_id")
        if prev is not None:
            if self.store is None:
                raise bad("previous_response_id", "responses are not stored by this gateway (it has no Redis): "
                                                  "send the whole conversation as input")
            earlier = await self.store.load(self.rec.tenant.name, prev)
        t = to_chat(body, earlier)
        self.where, self.settings = t.where, echo(body)
        self.history = earlier + input_items(body["input"])
        self.keeping = self.store is not None and body.get("store") is not False
        self.settings["store"] = self.keeping
        return t.chat

    def renaming(self, parse: Callable[[], Awaitable]) -> Callable[[], Awaitable]:
        async def run():
            try:
                return await parse()
            except APIError as e:
                raise (rename(e, self.where) if self.where is not None else e) from None
        return run

    async def keep(self, resp: dict) -> None:
        """Store the conversation this Response ends (bounded by the Redis client's timeout)."""
        if self.keeping:
            resp["store"] = await self.store.save(self.rec.tenant.name, resp["id"], self.history + resp["output"])

    async def collect(self, chat_answer: Awaitable[bytes]) -> bytes:
        resp = from_chat(json.loads(await chat_answer), self.model, self.settings)
        await self.keep(resp)
        return json.dumps(resp).encode()

    def stream(self, chat_chunks: AsyncIterator[bytes], st: ActiveRequest) -> AsyncIterator[bytes]:
        return events(chat_chunks, EventWriter(st.rid, st.created, self.model, self.settings), self.keep)
