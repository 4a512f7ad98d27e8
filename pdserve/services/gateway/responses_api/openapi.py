"""`/v1/responses` in `/openapi.json`: the request schema from the field table (fields.py) and what the path says;
gateway/openapi.py builds the path as it does the other generation endpoints'."""
from __future__ import annotations

from pdserve.services.gateway.responses_api.fields import request_schema

NAME = "ResponseCreateRequest"
SUMMARY = "a response (the Responses API, text and function tools: docs/api.md, Responses API)"
ANSWER = "the Response object (JSON), or typed server-sent events with `stream: true`"


def schemas(served: str | None = None) -> dict:
    return {NAME: request_schema(served)}
