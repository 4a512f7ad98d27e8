"""`/v1/responses` in `/openapi.json`: the request schema from the field table (fields.py), the gateway's error
body, and both answer forms (a Response object, or typed server-sent events with `stream: true`)."""
from __future__ import annotations

from pdserve.services.gateway.responses_api.fields import request_schema

NAME = "ResponseCreateRequest"


def path_item() -> dict:
    err = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    return {"post": {
        "summary": "a response (the Responses API, text and function tools: docs/api.md, Responses API)",
        "operationId": "createResponse",
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{NAME}"}}}},
        "responses": {
            "200": {"description": "the Response object (JSON), or typed server-sent events with `stream: true`",
                    "content": {"application/json": {"schema": {"type": "object"}},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            "400": {"description": "invalid request; `error.param` names the field", **err},
            "401": {"description": "missing or invalid API key", **err},
            "404": {"description": "unknown model", **err},
            "429": {"description": "rate limit or quota", **err},
            "503": {"description": "no capacity or no workers", **err},
            "504": {"description": "the request's deadline passed", **err}}}}


def schemas(served: str | None = None) -> dict:
    return {NAME: request_schema(served)}
