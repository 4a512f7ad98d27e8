"""One `/v1/responses` request on the chat completions path: what app.py's `_endpoint` asks of it.

`chat_body` translates the body (request.py), `renaming` puts the Responses field names on the chat checks'
errors, and `collect` / `stream` rewrite the chat answer the handler produced (output.py, events.py).
"""
from __future__ import annotations

import json
from typing import AsyncIterator, Awaitable, Callable

from pdserve.services.gateway.params import APIError
from pdserve.services.gateway.responses_api.events import EventWriter, events
from pdserve.services.gateway.responses_api.output import echo, from_chat
from pdserve.services.gateway.responses_api.request import rename, to_chat
from pdserve.services.gateway.schema import ActiveRequest


class ResponsesCall:
    def __init__(self, model: str):
        self.model = model  # the served model name
        self.where: list[str] | None = None  # set once translated: the chat checks' errors are renamed from then
        self.settings: dict = {}

    def chat_body(self, body: dict) -> dict:
        t = to_chat(body)
        self.where, self.settings = t.where, echo(body)
        return t.chat

    def renaming(self, parse: Callable[[], Awaitable]) -> Callable[[], Awaitable]:
        async def run():
            try:
                return await parse()
            except APIError as e:
                raise (rename(e, self.where) if self.where is not None else e) from None
        return run

    async def collect(self, chat_answer: Awaitable[bytes]) -> bytes:
        return json.dumps(from_chat(json.loads(await chat_answer), self.model, self.settings)).encode()

    def stream(self, chat_chunks: AsyncIterator[bytes], st: ActiveRequest) -> AsyncIterator[bytes]:
        return events(chat_chunks, EventWriter(st.rid, st.created, self.model, self.settings))
