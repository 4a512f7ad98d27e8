"""The gateway's gRPC front door (`Gateway.Generate`): the HTTP API's request handler (handler.py) for gRPC
clients.

Trust model: the same as the HTTP API's, by construction: both front doors call the same `RequestHandler`. The
caller's API key travels as `authorization: Bearer <key>` (or `x-api-key`) metadata and is checked against the
same keys file; the tenant's rate limit and quota, the deadline (the call's gRPC deadline, capped like an HTTP
`timeout`), KV admission and the one billing record all apply. The prefix-cache namespace is the tenant's: a
`namespace` in the request is ignored, so a caller cannot read another tenant's cached prefixes. Errors map to
gRPC codes (errors.grpc_status: 401 -> UNAUTHENTICATED, 429 -> RESOURCE_EXHAUSTED and 503 -> UNAVAILABLE with the
retry hint in the message, 400 -> INVALID_ARGUMENT, 504 -> DEADLINE_EXCEEDED). Worker and router error text is
logged under the request id, not sent (redact.py), and prompts are parsed and tokenized as the HTTP API does
(parse.py: big prompts off the event loop).

The request's `request_id` is the caller's label, echoed back in every response message; the request runs
under an id the gateway makes up (handler.start), so one tenant cannot name another's reservation, lease or
billing record by reusing its id. The label is bounded (`label`): a longer or unprintable one is refused, and
never logged whole.
"""
from __future__ import annotations

import logging

from pdserve.engine.grammar_limits import GrammarLimits
from pdserve.services import logs
from pdserve.services.convert import params_from_pb
from pdserve.services.gateway.errors import RequestFailed, grpc_status
from pdserve.services.gateway.handler import RequestHandler
from pdserve.services.gateway.params import APIError, check_guided, validate
from pdserve.services.gateway.parse import RequestParser
from pdserve.services.gateway.schema import GenerateCall
from pdserve.services.pb import common_pb2, gateway_pb2_grpc

log = logging.getLogger("pdserve.gateway")

MAX_LABEL = logs.MAX_REQUEST_ID  # as long as an x-request-id may be


def label(request_id: str) -> str | None:
    """The caller's `request_id` as a label to echo back (None: not given); 400 naming it when it is not at most
    MAX_LABEL printable ASCII characters."""
    if not request_id:
        return None
    if len(request_id) > MAX_LABEL or not (request_id.isascii() and request_id.isprintable()):
        raise APIError(400, f"invalid parameter 'request_id': at most {MAX_LABEL} printable ASCII characters "
                            f"(got {len(request_id)} characters)", param="request_id", code="invalid_parameter")
    return request_id


class GatewayGrpc(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, handler: RequestHandler, parser: RequestParser, grammar_limits: GrammarLimits | None = None):
        self.handler, self.parser = handler, parser
        self.grammar_limits = grammar_limits or GrammarLimits()

    async def Generate(self, request, context):
        handler = self.handler
        rec = handler.new_record()
        # the log lines' id is the caller's x-request-id (grpc_context.py); request.request_id is a label

        async def parse() -> GenerateCall:
            params = params_from_pb(request.params)
            validate(params, self.parser.vocab)
            check_guided(params, self.grammar_limits, "params.guided")
            prompt = list(request.prompt_token_ids) or request.prompt
            ids = (await self.parser.completion_prompts({"prompt": prompt}))[0]
            remaining = context.time_remaining()  # the call's gRPC deadline is the request's timeout
            return GenerateCall("grpc", [ids], params, client_label=label(request.request_id),
                                timeout_s=None if remaining is None else max(remaining, 1e-3),
                                allow_degrade=False, streamed=True, stage_times=False)

        failure, st = None, None
        try:
            st = await handler.open(rec, dict(context.invocation_metadata() or ()), parse)
            echo = st.call.client_label or st.rid
            try:
                async for d in handler.consume(st):
                    d.msg.request_id = echo
                    yield d.msg
            except RequestFailed as e:  # the worker ended it: its last message says how, without its detail
                # (no message: the gateway's own deadline cut a silent upstream; the same last message then)
                msg = e.msg if e.msg is not None else common_pb2.GenerateResponse(finished=True, state=e.state)
                msg.error = (await handler.fail(rec, e)).message
                msg.request_id = echo
                yield msg
        except Exception as e:  # noqa: BLE001 - every refusal is a typed reply (errors.reply_for)
            failure = grpc_status(await handler.fail(rec, e))
        finally:
            if rec.state is None:  # the caller cancelled: what was streamed is billed
                handler.cancel(st, rec, "client cancelled")
        if failure is not None:
            await context.abort(*failure)

