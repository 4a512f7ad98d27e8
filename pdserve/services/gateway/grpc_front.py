"""The gateway's gRPC front door (`Gateway.Generate`): the HTTP API's request path for gRPC clients.

Trust model: the same as the HTTP API's. The caller's API key travels as `authorization: Bearer <key>` (or
`x-api-key`) metadata and is checked against the same keys file; the tenant's rate limit and quota, the
deadline (the call's gRPC deadline, capped like an HTTP `timeout`), KV admission and the one billing record all
apply. The prefix-cache namespace is the tenant's: a `namespace` in the request is ignored, so a caller cannot
read another tenant's cached prefixes. Errors map to gRPC codes (401 -> UNAUTHENTICATED, 429/503 ->
RESOURCE_EXHAUSTED / UNAVAILABLE with the retry hint in the message, 400 -> INVALID_ARGUMENT, 504 ->
DEADLINE_EXCEEDED). Worker and router error text is logged under the request id, not sent (redact.py), and
prompts are parsed and tokenized as the HTTP API does (parse.py: big prompts off the event loop).
"""
from __future__ import annotations

import contextlib
import logging

import grpc

from pdserve.services.admission import AdmissionError
from pdserve.services.convert import lifecycle_to_pb, params_from_pb
from pdserve.services.gateway import redact
from pdserve.services.gateway.core import Dispatcher, NoWorkersError, UpstreamError, new_id, split
from pdserve.services.gateway.lifecycle import Lifecycle
from pdserve.services.gateway.params import APIError
from pdserve.services.gateway.parse import RequestParser
from pdserve.services.pb import gateway_pb2_grpc

log = logging.getLogger("pdserve.gateway")

_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
           403: grpc.StatusCode.PERMISSION_DENIED, 404: grpc.StatusCode.NOT_FOUND,
           413: grpc.StatusCode.INVALID_ARGUMENT, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
           503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}


class GatewayGrpc(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, life: Lifecycle, dispatcher: Dispatcher, parser: RequestParser):
        self.life, self.disp, self.parser = life, dispatcher, parser

    async def Generate(self, request, context):
        life = self.life
        rec = life.new_record()
        rid = request.request_id or new_id("grpc")
        redact.request_id.set(rid)
        failure: tuple[grpc.StatusCode, str] | None = None
        try:
            rec.tenant = life.gate.authenticate(dict(context.invocation_metadata() or ()))
            await life.gate.check_limits(rec.tenant)
            params = params_from_pb(request.params)
            try:
                params.validate(self.parser.vocab)
            except ValueError as e:
                raise APIError(400, str(e), code="invalid_parameter") from None
            prompt = list(request.prompt_token_ids) or request.prompt
            ids = (await self.parser.completion_prompts({"prompt": prompt}))[0]
            remaining = context.time_remaining()
            deadline = life.deadline_for({} if remaining is None else {"timeout": max(remaining, 1e-3)}, rec)
            ticket = await life.admit(rec, rid, [ids], params.max_tokens, params.n, self.parser.max_len,
                                      allow_degrade=False)
            lifecycle = lifecycle_to_pb(deadline, rec.tenant.priority,
                                        ticket.predicted_output if ticket is not None else None)
            agen = self.disp.generate_many(rid, split([ids], params), rec.tenant.namespace, lifecycle=lifecycle)
            end_state, error, cached = "FINISHED", None, 0
            async with contextlib.aclosing(agen):
                async for _, m in agen:
                    ntok = sum(len(o.token_ids) for o in m.outputs)
                    rec.emitted += ntok  # handed to the stream here
                    rec.generated = rec.emitted
                    if m.finished:
                        cached += m.usage.cached_tokens
                        if m.state and m.state != "FINISHED":
                            end_state, error = m.state, m.error or m.state
                            m.error = redact.failure_message(m.state, m.error)  # the detail is logged
                    m.request_id = rid
                    yield m
            rec.committed = rec.emitted
            rec.cached_tokens = cached
            await life.finish(rec, end_state, error)
        except AdmissionError as e:
            await life.finish(rec, e.state, e.message)
            failure = (_STATUS.get(e.status, grpc.StatusCode.UNAVAILABLE), f"{e.code}: {e.message}")
        except APIError as e:
            await life.finish(rec, "REJECTED", e.message)
            failure = (_STATUS.get(e.status, grpc.StatusCode.INVALID_ARGUMENT), f"{e.code or e.type}: {e.message}")
        except NoWorkersError as e:
            log.warning("request %s: no workers: %s", rid, e)
            await life.finish(rec, "REJECTED", str(e))
            failure = (grpc.StatusCode.UNAVAILABLE, redact.with_id("no workers available"))
        except UpstreamError as e:
            log.warning("request %s: upstream %s: %s", rid, e.code.name, e.details)
            await life.finish(rec, "FAILED", str(e))
            about_input = e.code == grpc.StatusCode.INVALID_ARGUMENT  # the client's own input: its text, scrubbed
            failure = (e.code, redact.scrub(e.details) if about_input else redact.with_id("a worker failed the request"))
        finally:
            if rec.state is None:  # the caller cancelled: what was streamed is billed
                rec.committed = rec.emitted
                await life.finish(rec, "CANCELLED", "client cancelled")
        if failure is not None:
            await context.abort(*failure)
